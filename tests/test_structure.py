"""The package's shape: no import circles inside dlm/, inference never imports training code, and one layer stack.

Every import statement of every module (function-level ones too) is read with `ast`; `from a import b`
counts as an import of the module a.b when that is a module of the package, else of a.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dlm

ROOT = Path(dlm.__file__).parent
# the model layer: what every paradigm's model, checkpoint and tokenizer need, and nothing above it
MODEL_LAYER = {"dlm.config", "dlm.errors", "dlm.files", "dlm.device", "dlm.masks", "dlm.rope", "dlm.model",
               "dlm.moe", "dlm.drafter", "dlm.checkpoint", "dlm.tokenizer", "dlm.hf", "dlm.hf_gemma", "dlm.noise",
               "dlm.families", "dlm.hf_layout", "dlm.hf_mdlm", "dlm.hf_joint"}
TRAINING = ("dlm.objectives", "dlm.train", "dlm.cli", "dlm.distill")  # dlm.train covers dlm.trainstate


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The dlm modules a file imports."""
    out: set[str] = set()
    pkg = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("dlm")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("dlm"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in known else base)
    return out & known


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(path, set(mods)) - {name} for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_reader_sees_every_import():
    g = graph()
    assert "dlm.model" in g["dlm.checkpoint"] and "dlm.drafter" in g["dlm.checkpoint"]
    assert "dlm.sampling.ar" in g["dlm.sampling"]  # `from dlm.sampling import ar` is the module
    assert "dlm.objectives.base" in g["dlm.objectives.ar"]


def test_no_import_circles():
    assert cycles(graph()) == []


def test_a_circle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_inference_never_imports_training_code():
    g = graph()
    bad = {m: sorted(d for d in deps if d.startswith(TRAINING))
           for m, deps in g.items() if m.startswith("dlm.sampling") or m in MODEL_LAYER}
    assert {m: d for m, d in bad.items() if d} == {}


def test_registries_are_plain_dicts_of_imported_code():
    for path in ROOT.rglob("*.py"):
        assert "importlib" not in path.read_text(), f"{path}: string registries resolved through importlib"


BACKBONE = ("KVCache", "RMSNorm", "Attention", "MLP", "Block")  # dlm.model's, one class each for every family


def test_one_layer_stack_shaped_by_configuration():
    """Every family runs the one backbone's layers (dlm.model), their shape chosen by ModelConfig's typed fields: no
    module of a family's own layers, no class of these names elsewhere, no untyped `arch` switch read anywhere."""
    defs: dict[str, list[str]] = {}
    arch: list[str] = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name in BACKBONE:
                defs.setdefault(node.name, []).append(name)
            if isinstance(node, ast.Attribute) and node.attr == "arch":
                arch.append(f"{name}:{node.lineno}")
    assert defs == {k: ["dlm.model"] for k in BACKBONE}
    assert arch == []
    assert "dlm.gemma4" not in modules()


INTEROP = ("dlm.families", "dlm.hf_layout", "dlm.hf_gemma", "dlm.hf_mdlm", "dlm.hf_joint")  # the rows and their maps
DRIVER_STEPS = {"save_checkpoint", "write_folder", "write_tensors", "copyfile", "all_finite", "read_hf_weights"}


def test_one_import_export_driver():
    """Every transformers family is a row of dlm.families that dlm.hf's one driver runs: no other interop module
    reads a folder's weights or writes tensors or folders, checks finiteness, or defines an importer or exporter of its own; and each
    config.json model_type has one row."""
    from dlm.families import FAMILIES

    mods = modules()
    for name in INTEROP:
        tree = ast.parse(mods[name].read_text())
        called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
                  for n in ast.walk(tree) if isinstance(n, ast.Call)}
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert not called & DRIVER_STEPS, (name, called & DRIVER_STEPS)
        assert not {d for d in defined if d.startswith(("import_", "export_folder", "export_hf"))}, (name, defined)
    types = [t for f in FAMILIES for t in f.model_types]
    assert len(types) == len(set(types)) and "qwen3_moe" in types


def _classes_of_kind(kind: str) -> set[str]:
    """Every class of the package that derives (directly or not) from the class named `kind`."""
    bases: dict[str, set[str]] = {}
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                                                          for b in node.bases)
    out, grew = {kind}, True
    while grew:
        new = {c for c, bs in bases.items() if bs & out} - out
        out |= new
        grew = bool(new)
    return out


def test_one_batch_engine_and_no_drafter_class_checks():
    """AR decoding is a row program like every sampler's, on the one row batch: the server has one batcher kind (no
    ARBatcher) and no sampler logic of its own (the samplers draw, stop and score); every sampler module builds its
    rows with `row_program`; and the row batch, the verifier and the server ask a drafter (or a model) what it can do
    rather than check its class."""
    from dlm.sampling import SAMPLERS, speculative

    engine = (ROOT / "serve" / "engine.py").read_text()
    assert "ARBatcher" not in engine
    tree = ast.parse(engine)
    called = {n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
              for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert called.isdisjoint({"sample_token", "draw", "sample_from", "log_softmax", "topk", "eos_set",
                              "make_generator", "prefill"})
    for module in (*SAMPLERS.values(), speculative):
        assert callable(getattr(module, "row_program", None)), module.__name__
    drafters = _classes_of_kind("Drafter") | {"DFlashDrafter"}
    assert {"PromptLookup", "ARDraft", "DFlashDraft", "DiffusionDraft", "SelfDraft"} <= drafters
    checks = []
    for rel in ("sampling/rows.py", "sampling/speculative.py", "serve/engine.py"):
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                checks += [f"{rel}:{node.lineno}" for k in kinds if getattr(k, "id", "") in drafters]
    assert checks == []
