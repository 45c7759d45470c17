"""Record what the authors' own code generates on tiny random models, as test fixtures for dlm.

    python scripts/record_upstream.py dream --code PATH/TO/Fast-dLLM
    python scripts/record_upstream.py dream-block --code PATH/TO/Fast-dLLM   # its Dream block decoding, same model
    python scripts/record_upstream.py dream-block-one-step --code PATH/TO/Fast-dLLM   # the same, one step per block
    python scripts/record_upstream.py dream-threshold --code PATH/TO/Fast-dLLM   # Dream's confidence_threshold
    python scripts/record_upstream.py llada --code PATH/TO/LLaDA --code PATH/TO/Fast-dLLM
    python scripts/record_upstream.py fast-dllm-llada --code PATH/TO/Fast-dLLM
    python scripts/record_upstream.py sdar  --code PATH/TO/SDAR
    python scripts/record_upstream.py sdar-redraw --code PATH/TO/SDAR   # low_confidence_* with fewer steps, same model
    python scripts/record_upstream.py fast-dllm-v2 --code PATH/TO/FOLDER   # configuration.py + modeling.py
    python scripts/record_upstream.py llada2 --code PATH/TO/LLaDA2.0-FOLDER --code PATH/TO/LLaDA2.1-FOLDER   # transformers 4.x

Each PATH is the user's own checkout of a public repository: Dream's modeling code and `diffusion_generate` come
from Fast-dLLM's `dream/model/` (a copy of Dream's remote code), LLaDA's `generate` from ML-GSAI/LLaDA's
`generate.py` with the modeling code of Fast-dLLM's `llada/model/`, Fast-dLLM v1's LLaDA decoding (`generate`,
`generate_with_prefix_cache`, `generate_with_dual_cache`) from its `llada/generate.py` on the same model, SDAR's
`block_diffusion_generate` and modeling code from JetAstra/SDAR (`generate.py`, `training/model/SDAR-4B-Chat/`), Fast-dLLM v2's `generate` from
the remote code its model folder ships (`configuration.py`, `modeling.py`: Fast_dLLM_QwenForCausalLM), LLaDA 2.0's
and 2.1's `LLaDA2MoeModelLM.generate` from their model folders' `configuration_llada2_moe.py` /
`modeling_llada2_moe.py` (ZHZisZZ/dllm keeps copies: dllm/pipelines/llada2/models/, dllm/pipelines/llada21/models/;
that remote code imports transformers 4.x APIs, so it records under transformers 4.57). Nothing of
them is copied: this script imports them from the checkout. The shims written here are to the environment
(transformers 5.x dropped the default RoPE initialiser and APIs the older remote code uses; SDAR's flash-attn
kernels, on a CPU, as the computation they implement), never a change to a model's computation.

The script builds a tiny random fp32 model with the family's own classes (hidden 32, 2 layers, an 80-word
vocabulary after the family's special tokens), runs the family's generate in every setting its record function lists, once
with `<eos>` live (its LM-head row scaled up, so that it wins at some positions) and once suppressed (its row
zero: a logit of 0, below the largest of the others), and writes into tests/fixtures/upstream/FAMILY/:

    config.json, model.safetensors, tokenizer.json, tokenizer_config.json   the model in its public layout
    recordings.json   the prompts, the prompt's logits, and per setting: the upstream arguments, the generated
                      ids (every position the upstream returns) and, where cheap, the canvas after every step

The `<mask>` row is zero too: greedy decoding never proposes `<mask>`; sampling may draw it, and the upstream
samplers keep it among the candidates (dlm's `--mask-proposals`). tests/test_upstream_fixtures.py holds dlm to
every recording.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import itertools
import json
import subprocess
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, WORDS = 32, 64, 2, 4, 2, 80
PROMPTS = [[17, 42, 23, 61, 8], [30, 11, 75, 52, 19, 64, 27, 40, 13, 71, 36]]  # word ids (offset by the specials)


# shims to transformers 5.x (the environment, not the models) ---------------------------------------------------

def default_rope(config, device=None, seq_len=None, **_):
    """The plain RoPE initialiser transformers 4.x registered as ROPE_INIT_FUNCTIONS["default"]: inverse
    frequencies theta^(-2i/d) over the head dimension, attention scaling 1."""
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim))
    return inv, 1.0


def shim_transformers() -> None:
    from transformers import modeling_rope_utils
    from transformers.cache_utils import Cache

    modeling_rope_utils.ROPE_INIT_FUNCTIONS.setdefault("default", default_rope)
    if not hasattr(Cache, "__getitem__"):  # (4.x: cache[layer] is that layer's (keys, values))
        Cache.__getitem__ = lambda self, i: (self.layers[i].keys, self.layers[i].values)


def load_package(name: str, folder: Path) -> types.ModuleType:
    """A folder of remote code (relative imports between its files) as a package named `name`."""
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg
    if (folder / "__init__.py").is_file():
        spec.loader.exec_module(pkg)
    return pkg


def load_module(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def commit_of(path: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


# the tiny model's parts ---------------------------------------------------------------------------------------

def word_tokenizer(specials: list[str]) -> Tokenizer:
    """A word-level tokenizer: the family's special tokens first (ids 0..), then WORDS words w0, w1, ..."""
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": len(specials) + i for i in range(WORDS)})
    tk = Tokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tk.add_special_tokens(specials)
    return tk


def randomize(model: torch.nn.Module, head: torch.Tensor, eos: int, mask: int, eos_gain: float, head_std: float = 1.5,
              seed: int = 0) -> None:
    """Random weights with peaked predictions (choices far from ties); <mask>'s LM-head row zero, <eos>'s scaled
    by eos_gain (chosen per family so that <eos> wins at some positions, not at most)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("ln_f.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif n.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((head_std if p is head else 0.25) * torch.randn(p.shape, generator=g))
        head[mask] = 0.0
        head[eos] *= eos_gain


def write_fixture(out: Path, model, tok: Tokenizer, config: dict, tok_config: dict, recordings: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
               if "rotary" not in k and "inv_freq" not in k}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / "recordings.json").write_text(json.dumps(recordings, separators=(",", ":")) + "\n")
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1024:.0f} KiB)")


def write_recordings(out: Path, recordings: dict) -> None:
    """A fixture of recordings only (on another fixture's model: its "model" key names the folder)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "recordings.json").write_text(json.dumps(recordings, separators=(",", ":")) + "\n")
    print(f"wrote {out / 'recordings.json'} ({(out / 'recordings.json').stat().st_size / 1024:.0f} KiB)")


def logits_summary(logits: torch.Tensor) -> dict:
    """logits (T, V) of one forward -> what the test compares: every value, rounded to 1e-5."""
    return {"shape": list(logits.shape), "values": [[round(float(v), 5) for v in row] for row in logits]}


def with_eos(head: torch.Tensor, eos: int, live: bool):
    """A context in which the <eos> row is as built (live) or zero (suppressed)."""
    class Ctx:
        def __enter__(self):
            self.keep = head[eos].clone()
            if not live:
                with torch.no_grad():
                    head[eos] = 0.0

        def __exit__(self, *a):
            with torch.no_grad():
                head[eos] = self.keep
    return Ctx()


# Dream (Fast-dLLM's dream/model: modeling_dream.py, generation_utils.py) ---------------------------------------

DREAM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<|beginoftext|>"]


def each_case(head: torch.Tensor, eos: int, settings: list[dict], prompts: list[list[int]]):
    """Every run of a recording, in order: `<eos>` live then suppressed, each setting, each prompt; a setting's seed
    set before each of its runs. Yields (the case's record so far, the prompt, the setting's arguments)."""
    for live in (True, False):
        with with_eos(head, eos, live):
            for s in settings:
                for pi, p in enumerate(prompts):
                    if "seed" in s:
                        torch.manual_seed(s["seed"])
                    yield ({"prompt": pi, "eos": "live" if live else "suppressed", "args": s}, p,
                           {k: v for k, v in s.items() if k != "seed"})


def dream_model(fast: Path):
    """The tiny Dream model built with Fast-dLLM's dream/model classes: (model, its config, tokenizer, Dream's
    generation config class, prompts, eos, mask, bos)."""
    shim_transformers()
    pkg = load_package("dream_upstream", fast / "dream" / "model")
    DreamConfig, DreamModel = pkg.DreamConfig, pkg.DreamModel
    # transformers 5.x calls GenerationConfig.validate(user_set_attributes=...), which Dream's override does not take
    Gen = sys.modules["dream_upstream.generation_utils"].DreamGenerationConfig
    Gen.validate = lambda self, *a, **k: None
    tok = word_tokenizer(DREAM_SPECIALS)
    V = tok.get_vocab_size()
    eos, mask, bos = 0, 3, 4
    cfg = DreamConfig(vocab_size=V, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                      rms_norm_eps=1e-6, rope_theta=10000.0, mask_token_id=mask, pad_token_id=eos,
                      eos_token_id=eos, bos_token_id=bos, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = DreamModel(cfg).eval()
    randomize(model, model.lm_head.weight, eos, mask, eos_gain=2.2)
    prompts = [[len(DREAM_SPECIALS) + i for i in p] for p in PROMPTS]
    return model, cfg, tok, Gen, prompts, eos, mask, bos


def record_dream(code: list[Path], out: Path) -> None:
    (fast,) = code
    model, cfg, tok, Gen, prompts, eos, mask, bos = dream_model(fast)
    head = model.lm_head.weight

    cases = []
    settings = []
    for alg in ("maskgit_plus", "topk_margin", "entropy"):
        for n, steps in ((16, 16), (16, 8), (24, 6)):
            settings.append({"alg": alg, "max_new_tokens": n, "steps": steps, "temperature": 0.0})
    for n, steps in ((16, 16), (16, 8)):
        settings.append({"alg": "origin", "max_new_tokens": n, "steps": steps, "temperature": 0.0, "seed": 7})
    for alg in ("maskgit_plus", "topk_margin", "entropy"):  # sampled: Dream's README (0.2, top-p 0.95), and plain
        for temp, top_p in ((0.2, 0.95), (1.0, None)):
            settings.append({"alg": alg, "max_new_tokens": 16, "steps": 16, "temperature": temp, "top_p": top_p,
                             "seed": 5})
    # alg_temp: the positions to commit drawn (torch.multinomial over softmax(confidence / alg_temp)), greedy and
    # sampled tokens; origin sampled (its token draws after its transfer draw)
    for alg, temp, alg_temp, seed in (("maskgit_plus", 0.0, 0.5, 3), ("entropy", 0.0, 0.1, 3),
                                      ("maskgit_plus", 0.2, 0.5, 3), ("entropy", 1.0, 0.1, 3),
                                      ("topk_margin", 0.2, 0.05, 4)):
        settings.append({"alg": alg, "max_new_tokens": 16, "steps": 8, "temperature": temp, "alg_temp": alg_temp,
                         "seed": seed})
    for temp, top_p in ((0.2, 0.95), (1.0, None)):
        settings.append({"alg": "origin", "max_new_tokens": 16, "steps": 8, "temperature": temp, "top_p": top_p,
                         "seed": 5})
    for case, p, kw in each_case(head, eos, settings, prompts):
        # (an explicit generation config: transformers 5.x cannot derive Dream's from the model's)
        gc = Gen(output_history=True, return_dict_in_generate=True, mask_token_id=mask, eos_token_id=eos,
                 pad_token_id=eos, bos_token_id=bos, **kw)
        res = model.diffusion_generate(torch.tensor([p]), generation_config=gc)
        hist = [h[0, len(p):].tolist() for h in res.history] if case["prompt"] == 0 else None
        cases.append({**case, "ids": res.sequences[0, len(p):].tolist(), **({"steps": hist} if hist else {})})
    with torch.no_grad():
        logits = model(torch.tensor([prompts[1]])).logits[0]
    generic = ("_attn_implementation_autoset", "transformers_version", "_name_or_path", "id2label", "label2id",
               "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions", "output_hidden_states",
               "problem_type", "return_dict", "dtype")
    config = {**{k: v for k, v in json.loads(cfg.to_json_string(use_diff=False)).items() if k not in generic},
              "architectures": ["DreamModel"],
              "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
              "torch_dtype": "float32"}
    live_eos = sum(c["eos"] == "live" and eos in c["ids"] for c in cases)
    rec = {"family": "dream",
           "upstream": {"repo": "NVlabs/Fast-dLLM", "files": "dream/model/", "commit": commit_of(fast)},
           "eos_id": eos, "mask_id": mask, "prompts": prompts, "logits": logits_summary(logits), "cases": cases}
    print(f"dream: {len(cases)} cases, <eos> generated in {live_eos} of the live ones")
    write_fixture(out, model, tok, config, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                                            "mask_token": "<|mask|>", "bos_token": "<|beginoftext|>"}, rec)


def record_dream_threshold(code: list[Path], out: Path) -> None:
    """Dream's alg="confidence_threshold" in Fast-dLLM's dream/model/generation_utils.py (its diffusion_generate
    without blocks): recordings only, on the dream fixture's model (same build, asserted bit for bit). max_new_tokens
    must be a multiple of steps (asserted there)."""
    from safetensors.torch import load_file

    (fast,) = code
    model, cfg, tok, Gen, prompts, eos, mask, bos = dream_model(fast)
    want = load_file(str(ROOT / "tests" / "fixtures" / "upstream" / "dream" / "model.safetensors"))
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items() if k in want), "not the dream fixture"
    head = model.lm_head.weight
    settings = []
    for threshold in (0.9, 0.5, 1.0):
        for n, steps in ((16, 8), (16, 4), (24, 6), (16, 2)):
            settings.append({"alg": "confidence_threshold", "threshold": threshold, "max_new_tokens": n,
                             "steps": steps, "temperature": 0.0})
    for threshold, n, steps, temp, top_p, seed in ((0.9, 16, 4, 1.0, None, 5), (0.9, 16, 4, 0.2, 0.95, 5),
                                                   (0.5, 16, 2, 1.0, None, 7), (1.0, 24, 6, 1.0, None, 3)):
        settings.append({"alg": "confidence_threshold", "threshold": threshold, "max_new_tokens": n, "steps": steps,
                         "temperature": temp, "top_p": top_p, "seed": seed})
    cases = []
    for case, p, kw in each_case(head, eos, settings, prompts):
        threshold = kw.pop("threshold")
        gc = Gen(output_history=True, return_dict_in_generate=True, mask_token_id=mask, eos_token_id=eos,
                 pad_token_id=eos, bos_token_id=bos, **kw)
        res = model.diffusion_generate(torch.tensor([p]), generation_config=gc, threshold=threshold)
        hist = [h[0, len(p):].tolist() for h in res.history] if case["prompt"] == 0 else None
        cases.append({**case, "ids": res.sequences[0, len(p):].tolist(), **({"steps": hist} if hist else {})})
    live_eos = sum(c["eos"] == "live" and eos in c["ids"] for c in cases)
    rec = {"family": "dream-threshold", "model": "dream",
           "upstream": {"repo": "NVlabs/Fast-dLLM", "files": "dream/model/ (generation_utils.py)",
                        "commit": commit_of(fast)},
           "eos_id": eos, "mask_id": mask, "prompts": prompts, "cases": cases}
    print(f"dream-threshold: {len(cases)} cases, <eos> generated in {live_eos} of the live ones")
    write_recordings(out, rec)


# Fast-dLLM v1's block decoding for Dream (dream/model/generation_utils_block.py: diffusion_generate with
# block_length, threshold, dual_cache; bound to the model as Fast-dLLM's eval.py binds it) -------------------------

def dream_block_settings() -> list[dict]:
    """The settings recorded, each once with dual_cache False (the prefix cache) and once True (the dual cache).
    gen_length must be a multiple of block_length and steps of the number of blocks (the code asserts both)."""
    out = []
    for threshold in (0.9, 0.5, 1.0):  # alg confidence_threshold: steps are not read (any multiple of the blocks)
        for n, block in ((16, 4), (16, 8), (24, 8)):
            out.append({"alg": "confidence_threshold", "threshold": threshold, "max_new_tokens": n,
                        "block_length": block, "steps": n // block, "temperature": 0.0})
    for block, temp, top_p in ((8, 1.0, None), (8, 0.2, 0.95), (4, 1.0, None)):
        out.append({"alg": "confidence_threshold", "threshold": 0.9, "max_new_tokens": 16, "block_length": block,
                    "steps": 16 // block, "temperature": temp, "top_p": top_p, "seed": 5})
    # every other alg: the steps per block on Dream's time grid, ranked by entropy (the block code scores every alg
    # by sample_tokens(neg_entropy=True)), the first pass committing the block's first position alone
    for alg, combos in (("entropy", ((16, 8, 8), (16, 4, 8), (24, 8, 12), (16, 8, 16))),
                        ("maskgit_plus", ((16, 8, 8), (24, 8, 12))), ("topk_margin", ((16, 8, 8), (16, 4, 8))),
                        ("origin", ((16, 8, 8),))):
        for n, block, steps in combos:
            out.append({"alg": alg, "max_new_tokens": n, "block_length": block, "steps": steps, "temperature": 0.0})
    for alg, temp, top_p, alg_temp, seed in (("entropy", 1.0, None, None, 5), ("entropy", 0.2, 0.95, None, 5),
                                             ("entropy", 0.0, None, 0.1, 3), ("maskgit_plus", 0.2, 0.95, 0.5, 3)):
        out.append({"alg": alg, "max_new_tokens": 16, "block_length": 8, "steps": 8, "temperature": temp,
                    "top_p": top_p, "alg_temp": alg_temp, "seed": seed})
    return [{**s, "dual_cache": dual} for dual in (False, True) for s in out]


def dream_block_one_step_settings() -> list[dict]:
    """One step per block (steps = the number of blocks): Fast-dLLM's loop ends a block after its full pass (which
    writes the block's first position), leaving its other positions masked."""
    out = [{"alg": alg, "max_new_tokens": n, "block_length": block, "steps": n // block, "temperature": 0.0}
           for alg, n, block in (("entropy", 16, 8), ("entropy", 16, 4), ("entropy", 24, 8), ("entropy", 16, 2),
                                 ("entropy", 24, 2), ("maskgit_plus", 16, 8))]
    out += [{"alg": "entropy", "max_new_tokens": 16, "block_length": block, "steps": 16 // block, "temperature": temp,
             "top_p": top_p, "seed": 5} for block, temp, top_p in ((4, 1.0, None), (8, 0.2, 0.95), (2, 1.0, None))]
    return [{**s, "dual_cache": dual} for dual in (False, True) for s in out]


def record_dream_block_one_step(code: list[Path], out: Path) -> None:
    record_dream_block(code, out, dream_block_one_step_settings(), "dream-block-one-step")


def record_dream_block(code: list[Path], out: Path, settings: list[dict] | None = None,
                       family: str = "dream-block") -> None:
    """Recordings only (recordings.json): the model is the dream fixture's (same build, asserted bit for bit)."""
    from safetensors.torch import load_file

    (fast,) = code
    model, cfg, tok, Gen, prompts, eos, mask, bos = dream_model(fast)
    block = load_module("dream_upstream.generation_utils_block", fast / "dream" / "model" / "generation_utils_block.py")
    want = load_file(str(ROOT / "tests" / "fixtures" / "upstream" / "dream" / "model.safetensors"))
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items() if k in want), "not the dream fixture"
    model.diffusion_generate = types.MethodType(block.DreamGenerationMixin.diffusion_generate, model)
    model._sample = types.MethodType(block.DreamGenerationMixin._sample, model)
    seen: list[torch.Tensor] = []  # the sequence before each forward (a cached pass's input is a view of it)
    model.register_forward_pre_hook(
        lambda m, args: seen.append((args[0] if args[0]._base is None else args[0]._base)[0].clone()))
    head = model.lm_head.weight
    cases = []
    for case, p, kw in each_case(head, eos, settings or dream_block_settings(), prompts):
        extra = {k: kw.pop(k) for k in ("threshold", "block_length", "dual_cache") if k in kw}
        gc = Gen(return_dict_in_generate=True, mask_token_id=mask, eos_token_id=eos, pad_token_id=eos,
                 bos_token_id=bos, **kw)
        seen.clear()
        res = model.diffusion_generate(torch.tensor([p]), generation_config=gc, **extra)
        ids = res.sequences[0, len(p):].tolist()
        # the canvas after every pass: what the next pass reads, then the result
        passes = [s[len(p):].tolist() for s in seen[1:]] + [ids]
        cases.append({**case, "ids": ids, "forwards": len(seen), **({"passes": passes} if case["prompt"] == 0 else {})})
    live_eos = sum(c["eos"] == "live" and eos in c["ids"] for c in cases)
    rec = {"family": family, "model": "dream",
           "upstream": {"repo": "NVlabs/Fast-dLLM", "files": "dream/model/ (generation_utils_block.py)",
                        "commit": commit_of(fast)},
           "eos_id": eos, "mask_id": mask, "prompts": prompts, "cases": cases}
    print(f"{family}: {len(cases)} cases, <eos> generated in {live_eos} of the live ones")
    write_recordings(out, rec)


class Called:
    """model(...) with use_cache and return_dict given: LLaDA's remote code reads them from its config, where
    transformers 5.x no longer puts them."""

    def __init__(self, model):
        self.model, self.device = model, model.device

    def __call__(self, *a, **k):
        return self.model(*a, use_cache=False, return_dict=True, **k)


# LLaDA (ML-GSAI/LLaDA generate.py; Fast-dLLM's llada/model: modeling_llada.py, configuration_llada.py) ----------

LLADA_SPECIALS = ["<|endoftext|>", "<|startoftext|>", "<|eot_id|>", "<|mdm_mask|>"]
LLADA_KEYS = {"activation_type": "silu", "alibi": False, "attention_layer_norm": False, "block_group_size": 1,
              "block_type": "llama", "include_bias": False, "include_qkv_bias": False, "input_emb_norm": False,
              "layer_norm_type": "rms", "layer_norm_with_affine": True, "bias_for_layer_norm": False, "rope": True,
              "rope_full_precision": True, "scale_logits": False, "weight_tying": False, "flash_attention": False,
              "attention_dropout": 0.0, "residual_dropout": 0.0, "embedding_dropout": 0.0, "init_device": "cpu"}


def llada_generate(path: Path, eos: int, eot: int) -> types.ModuleType:
    """LLaDA's generate.py as a module, the ids its logits_eos_inf / confidence_eos_eot_inf switches name (the
    published tokenizer's <|endoftext|> 126081 and <|eot_id|> 126348) read as the tiny tokenizer's ids of those
    tokens: the one change to its text, to the vocabulary, not to the computation."""
    src = path.read_text()
    assert src.count("126081") == 2 and src.count("126348") == 1, "generate.py's EOS / EOT ids moved: check the shim"
    mod = types.ModuleType("llada_generate")
    mod.__file__ = str(path)
    sys.modules["llada_generate"] = mod
    exec(compile(src.replace("126081", str(eos)).replace("126348", str(eot)), str(path), "exec"), mod.__dict__)
    return mod


def llada_model(fast: Path):
    """The tiny LLaDA built with Fast-dLLM's llada/model classes (the same weights for every LLaDA recording):
    (model, its modeling module, tokenizer, config.json's dict, LM head, prompts)."""
    pkg = load_package("llada_upstream", fast / "llada" / "model")
    cfg_mod = sys.modules.get("llada_upstream.configuration_llada") or load_module(
        "llada_upstream.configuration_llada", fast / "llada" / "model" / "configuration_llada.py")
    mod = load_module("llada_upstream.modeling_llada", fast / "llada" / "model" / "modeling_llada.py")
    tok = word_tokenizer(LLADA_SPECIALS)
    V = tok.get_vocab_size()
    eos, bos, mask = 0, 1, 3
    hf = {"architectures": ["LLaDAModelLM"], "model_type": "llada", **LLADA_KEYS, "d_model": HIDDEN,
          "n_heads": HEADS, "n_kv_heads": KV_HEADS, "n_layers": LAYERS, "mlp_hidden_size": FFN, "mlp_ratio": 2,
          "max_sequence_length": 256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": V,
          "embedding_size": V, "eos_token_id": eos, "pad_token_id": eos, "mask_token_id": mask, "use_cache": False,
          "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM"},
          "torch_dtype": "float32"}
    cfg = cfg_mod.LLaDAConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    model = mod.LLaDAModelLM(cfg, init_params=True).eval()
    head = model.model.transformer.ff_out.weight
    randomize(model, head, eos, mask, eos_gain=-1.0)
    prompts = [[len(LLADA_SPECIALS) + i for i in p] for p in PROMPTS]
    return model, mod, pkg, tok, hf, head, prompts


EOT_GAIN = -2.0  # <|eot_id|>'s LM-head row scaled by this in the recordings that carry "eot_gain": it then wins


def scaled_row(head: torch.Tensor, row: int, gain: float):
    """A context in which head[row] is multiplied by gain."""
    class Ctx:
        def __enter__(self):
            self.keep = head[row].clone()
            with torch.no_grad():
                head[row] *= gain

        def __exit__(self, *a):
            with torch.no_grad():
                head[row] = self.keep
    return Ctx()


def record_llada(code: list[Path], out: Path) -> None:
    llada, fast = code
    eos, mask, eot = 0, 3, LLADA_SPECIALS.index("<|eot_id|>")
    gen = llada_generate(llada / "generate.py", eos=eos, eot=eot)
    model, _, _, tok, hf, head, prompts = llada_model(fast)

    settings = []
    for n, block, steps in ((16, 16, 16), (16, 8, 8), (24, 8, 12), (16, 4, 16), (16, 16, 4)):
        settings.append({"gen_length": n, "block_length": block, "steps": steps, "remasking": "low_confidence"})
    for n, block, steps in ((16, 8, 8), (16, 16, 16)):
        settings.append({"gen_length": n, "block_length": block, "steps": steps, "remasking": "random", "seed": 7})
    # sampled: the float64 Gumbel noise over the whole sequence (and, with random remasking, the uniforms after it)
    for n, block, steps in ((16, 16, 16), (16, 8, 8), (24, 8, 12), (16, 16, 4)):
        for temp in (0.5, 1.0):
            settings.append({"gen_length": n, "block_length": block, "steps": steps, "remasking": "low_confidence",
                             "temperature": temp, "seed": 5})
    settings.append({"gen_length": 16, "block_length": 8, "steps": 8, "remasking": "random", "temperature": 0.8,
                     "seed": 5})
    # its switches (appendix B.4 of the LLaDA paper), greedy and sampled
    for switch in ("logits_eos_inf", "confidence_eos_eot_inf"):
        for n, block, steps in ((16, 16, 16), (24, 8, 12)):
            settings.append({"gen_length": n, "block_length": block, "steps": steps, "remasking": "low_confidence",
                             switch: True})
        settings.append({"gen_length": 16, "block_length": 8, "steps": 8, "remasking": "low_confidence",
                         "temperature": 1.0, "seed": 5, switch: True})
    # its classifier-free guidance (the prompt masked in a second row of the same forward)
    for scale in (0.5, 2.0):
        for n, block, steps in ((16, 16, 16), (24, 8, 12)):
            settings.append({"gen_length": n, "block_length": block, "steps": steps, "remasking": "low_confidence",
                             "cfg_scale": scale})
    settings.append({"gen_length": 16, "block_length": 8, "steps": 8, "remasking": "low_confidence",
                     "temperature": 1.0, "seed": 5, "cfg_scale": 1.0})
    settings.append({"gen_length": 16, "block_length": 8, "steps": 8, "remasking": "random", "seed": 7,
                     "cfg_scale": 1.0})
    cases = []
    for case, p, kw in each_case(head, eos, settings, prompts):
        # (with cfg_scale > 0 its generate reads an attention mask: all ones, the same attention as none)
        ones = torch.ones(1, len(p), dtype=torch.long) if kw.get("cfg_scale") else None
        x = gen.generate(Called(model), torch.tensor([p]), attention_mask=ones, mask_id=mask,
                         **{"temperature": 0.0, "cfg_scale": 0.0, **kw})
        cases.append({**case, "ids": x[0, len(p):].tolist()})
    # <|eot_id|> winning (its LM-head row x EOT_GAIN; the random row never wins), confidence_eos_eot_inf on and off
    eot_settings = []
    for switch in (True, False):
        for n, block, steps in ((16, 16, 16), (24, 8, 12)):
            eot_settings.append({"gen_length": n, "block_length": block, "steps": steps,
                                 "remasking": "low_confidence", "confidence_eos_eot_inf": switch})
        eot_settings.append({"gen_length": 16, "block_length": 8, "steps": 8, "remasking": "low_confidence",
                             "temperature": 1.0, "seed": 5, "confidence_eos_eot_inf": switch})
    with scaled_row(head, eot, EOT_GAIN):
        for case, p, kw in each_case(head, eos, eot_settings, prompts):
            x = gen.generate(Called(model), torch.tensor([p]), mask_id=mask, **{"temperature": 0.0, **kw})
            cases.append({**case, "eot_gain": EOT_GAIN, "ids": x[0, len(p):].tolist()})
    print(f"llada: <|eot_id|> generated in {sum(eot in c['ids'] for c in cases if 'eot_gain' in c)} of the "
          f"{sum('eot_gain' in c for c in cases)} <|eot_id|> cases")
    with torch.no_grad():
        logits = Called(model)(torch.tensor([prompts[1]])).logits[0]
    live_eos = sum(c["eos"] == "live" and eos in c["ids"] for c in cases)
    rec = {"family": "llada", "upstream": {"repo": "ML-GSAI/LLaDA", "files": "generate.py", "commit": commit_of(llada),
                                           "modeling": {"repo": "NVlabs/Fast-dLLM", "files": "llada/model/",
                                                        "commit": commit_of(fast)}},
           "eos_id": eos, "mask_id": mask, "prompts": prompts, "logits": logits_summary(logits), "cases": cases}
    print(f"llada: {len(cases)} cases, <eos> generated in {live_eos} of the live ones")
    write_fixture(out, model, tok, hf, {"eos_token": "<|endoftext|>", "bos_token": "<|startoftext|>",
                                        "mask_token": "<|mdm_mask|>"}, rec)


# Fast-dLLM v1 on LLaDA (NVlabs/Fast-dLLM llada/generate.py: generate, generate_with_prefix_cache,
# generate_with_dual_cache; its llada/model, which reads past_key_values and replace_position) -------------------

class CalledWithCache(Called):
    """model(...) with return_dict given and use_cache as the caller asks (Fast-dLLM's cached generate functions ask
    for the K/V; LLaDA's remote code otherwise reads use_cache from its config)."""

    def __call__(self, *a, **k):
        return self.model(*a, return_dict=True, **{"use_cache": False, **k})


FAST_DLLM_FUNCTIONS = ("generate", "generate_with_prefix_cache", "generate_with_dual_cache")


def record_fast_dllm_llada(code: list[Path], out: Path) -> None:
    (fast,) = code
    model, mod, pkg, tok, hf, head, prompts = llada_model(fast)
    sys.modules["model"], sys.modules["model.modeling_llada"] = pkg, mod  # (generate.py: from model.modeling_llada)
    gen = load_module("fast_dllm_llada_generate", fast / "llada" / "generate.py")
    eos, mask = 0, 3
    settings = []
    for fn in FAST_DLLM_FUNCTIONS:
        # steps (threshold None): a quota per step; with a threshold its steps are not read (only divided)
        for n, block, steps in ((16, 4, 16), (16, 8, 8), (24, 8, 12), (16, 16, 16), (16, 8, 4)):
            settings.append({"function": fn, "gen_length": n, "block_length": block, "steps": steps,
                             "remasking": "low_confidence", "threshold": None})
        for threshold, shapes in ((0.9, ((16, 4), (16, 8), (24, 8), (16, 16))), (0.5, ((16, 8), (24, 8), (16, 16)))):
            for n, block in shapes:
                settings.append({"function": fn, "gen_length": n, "block_length": block, "steps": n,
                                 "remasking": "low_confidence", "threshold": threshold})
        # sampled: its float64 Gumbel noise over the rows each forward returns; random remasking's uniforms likewise
        settings.append({"function": fn, "gen_length": 16, "block_length": 8, "steps": 8,
                         "remasking": "low_confidence", "threshold": None, "temperature": 1.0, "seed": 5})
        settings.append({"function": fn, "gen_length": 24, "block_length": 8, "steps": 24,
                         "remasking": "low_confidence", "threshold": 0.9, "temperature": 0.5, "seed": 5})
        settings.append({"function": fn, "gen_length": 16, "block_length": 4, "steps": 16,
                         "remasking": "low_confidence", "threshold": 0.5, "temperature": 1.0, "seed": 5})
        settings.append({"function": fn, "gen_length": 16, "block_length": 8, "steps": 8, "remasking": "random",
                         "threshold": None, "seed": 7})
        settings.append({"function": fn, "gen_length": 16, "block_length": 8, "steps": 8, "remasking": "random",
                         "threshold": None, "temperature": 0.8, "seed": 5})
    cases = []
    for case, p, kw in each_case(head, eos, settings, prompts):
        f = getattr(gen, kw.pop("function"))
        x, nfe = f(CalledWithCache(model), torch.tensor([p]), mask_id=mask, **{"temperature": 0.0, **kw})
        cases.append({**case, "ids": x[0, len(p):].tolist(), "nfe": nfe})
    with torch.no_grad():
        logits = Called(model)(torch.tensor([prompts[1]])).logits[0]
    live_eos = sum(c["eos"] == "live" and eos in c["ids"] for c in cases)
    rec = {"family": "fast-dllm-llada",
           "upstream": {"repo": "NVlabs/Fast-dLLM", "files": "llada/generate.py, llada/model/",
                        "commit": commit_of(fast)},
           "eos_id": eos, "mask_id": mask, "prompts": prompts, "logits": logits_summary(logits), "cases": cases}
    print(f"fast-dllm-llada: {len(cases)} cases, <eos> generated in {live_eos} of the live ones")
    write_fixture(out, model, tok, hf, {"eos_token": "<|endoftext|>", "bos_token": "<|startoftext|>",
                                        "mask_token": "<|mdm_mask|>"}, rec)


# SDAR (JetAstra/SDAR: generate.py, training/model/SDAR-4B-Chat/modeling_sdar.py) -------------------------------

SDAR_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]


def shim_sdar() -> None:
    """SDAR's modeling code imports flash-attn's kernels (RMSNorm, attention) at the top, Liger's and a Triton loss
    used in training, and transformers 4.x's LossKwargs. On a CPU: the two kernels as the plain computation they
    implement (RMSNorm in fp32; attention softmax(q k^T * scale) v over all keys, GQA), the training-only modules
    absent, LossKwargs an empty TypedDict."""
    import typing

    import transformers.utils as tu

    def rms_norm_fn(x, weight, bias=None, eps=1e-6, **_):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (weight * h).to(x.dtype) if bias is None else (weight * h + bias).to(x.dtype)

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **_):  # (B, L, H, D)
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             is_causal=causal, scale=softmax_scale, enable_gqa=True)
        return o.transpose(1, 2)

    fa = types.ModuleType("flash_attn")
    fa.flash_attn_func, fa.flash_attn_varlen_func = flash_attn_func, None
    bp = types.ModuleType("flash_attn.bert_padding")
    bp.index_first_axis = bp.pad_input = bp.unpad_input = None
    ln = types.ModuleType("flash_attn.ops.triton.layer_norm")
    ln.rms_norm_fn = rms_norm_fn
    for name, m in (("flash_attn", fa), ("flash_attn.bert_padding", bp), ("flash_attn.ops", types.ModuleType("o")),
                    ("flash_attn.ops.triton", types.ModuleType("t")), ("flash_attn.ops.triton.layer_norm", ln)):
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)  # (no distribution: transformers sees none installed)
        sys.modules[name] = m
    if not hasattr(tu, "LossKwargs"):
        tu.LossKwargs = typing.TypedDict("LossKwargs", {}, total=False)
    if "transformers.modeling_attn_mask_utils" not in sys.modules:  # (gone in 5.x; only its unused mask helper)
        try:
            import transformers.modeling_attn_mask_utils  # noqa: F401
        except ImportError:
            am = types.ModuleType("transformers.modeling_attn_mask_utils")
            am.AttentionMaskConverter = None
            sys.modules[am.__name__] = am
    loss = types.ModuleType("sdar_upstream.fused_linear_diffusion_cross_entropy")
    loss.FusedLinearDiffusionCrossEntropyLoss = None
    sys.modules[loss.__name__] = loss


def sdar_generate(path: Path) -> types.ModuleType:
    """SDAR's generate.py as a module, with one line added: its `entropy_bounded` branch sets `transfer_index[j, ...]`
    without creating it (the other three branches start with `transfer_index = torch.zeros_like(x0,
    dtype=torch.bool)`), so as published it raises UnboundLocalError at its first step; the same line is added at the
    top of that branch. Nothing else of the text changes (the other branches never reach it)."""
    src = path.read_text()
    branch = 'elif remasking_strategy == "entropy_bounded":\n'
    assert src.count(branch) == 1 and "transfer_index = torch.zeros_like(x0, dtype=torch.bool)" in src, \
        "generate.py's entropy_bounded branch moved: check the patch"
    after = src.split(branch)[1]
    indent = " " * (len(after) - len(after.lstrip(" ")))
    src = src.replace(branch, branch + indent + "transfer_index = torch.zeros_like(x0, dtype=torch.bool)\n")
    mod = types.ModuleType("sdar_generate")
    mod.__file__ = str(path)
    sys.modules["sdar_generate"] = mod
    exec(compile(src, str(path), "exec"), mod.__dict__)
    return mod


def sdar_model(sdar: Path):
    """The tiny SDAR built with its training/model/SDAR-4B-Chat classes: (model, its config, the folder, generate.py
    as published, generate.py with its one line added, tokenizer, LM head, prompts, eos, im_end, mask)."""
    shim_transformers()
    shim_sdar()
    folder = sdar / "training" / "model" / "SDAR-4B-Chat"
    load_package("sdar_upstream", folder)
    cfg_mod = load_module("sdar_upstream.configuration_sdar", folder / "configuration_sdar.py")
    mod = load_module("sdar_upstream.modeling_sdar", folder / "modeling_sdar.py")
    published = load_module("sdar_generate_published", sdar / "generate.py")
    gen = sdar_generate(sdar / "generate.py")
    tok = word_tokenizer(SDAR_SPECIALS)
    V = tok.get_vocab_size()
    eos, im_end, mask = 0, 2, 3
    cfg = cfg_mod.SDARConfig(vocab_size=V, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                             num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=16,
                             max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                             tie_word_embeddings=False, attention_bias=False, bos_token_id=eos, eos_token_id=eos,
                             pad_token_id=eos, fuse_cross_entropy=True, debug=False, micro_forward=False,
                             skip_checkpoint=False, ep_size=1, use_deepep=False)  # (the published config's keys)
    cfg._attn_implementation = "sdpa"
    model = mod.SDARForCausalLM(cfg).eval()
    head = model.lm_head.weight
    randomize(model, head, im_end, mask, eos_gain=3.0, head_std=0.2)  # (flatter: the threshold and the draws matter)
    with torch.no_grad():  # <|endoftext|> never wins; <|im_end|> (what the chat turns end with) is the live one
        head[eos] = 0.0
    prompts = [[len(SDAR_SPECIALS) + i for i in p] for p in PROMPTS]
    return model, cfg, folder, published, gen, tok, head, prompts, eos, im_end, mask


def record_sdar(code: list[Path], out: Path) -> None:
    (sdar,) = code
    model, cfg, folder, published, gen, tok, head, prompts, eos, im_end, mask = sdar_model(sdar)

    settings = []
    for strategy, thr in (("low_confidence_dynamic", 0.85), ("low_confidence_dynamic", 0.5),
                          ("low_confidence_static", None)):
        # (steps = block length: one position a step at least. With fewer steps, a step's quota can exceed the
        # positions still masked, and generate.py's top-k then re-draws committed positions, prompt tokens included:
        # record_sdar_redraw)
        for n, block, steps, temp, top_k in ((16, 4, 4, 1.0, 0), (16, 8, 8, 1.0, 0), (12, 4, 4, 0.7, 20),
                                             (16, 4, 4, 0.4, 0)):
            settings.append({"gen_length": n, "block_length": block, "denoising_steps": steps,
                             "temperature": temp, "top_k": top_k, "top_p": 1.0, "remasking_strategy": strategy,
                             **({"confidence_threshold": thr} if thr is not None else {}), "seed": 11})
    cases = []
    settings = [{**s, "stopping_criteria_idx": stop} for s in settings for stop in (None, [im_end, eos])]
    for case, p, kw in each_case(head, im_end, settings, prompts):
        x = published.block_diffusion_generate(model, {"input_ids": torch.tensor([p])}, mask_id=mask, **kw)
        cases.append({**case, "ids": x[0, len(p):].tolist()})
    try:  # (entropy_bounded as published: see sdar_generate)
        published.block_diffusion_generate(model, {"input_ids": torch.tensor([prompts[0]])}, mask_id=mask,
                                           remasking_strategy="entropy_bounded", eb_threshold=0.35)
        raise AssertionError("generate.py's entropy_bounded ran as published: drop the patch")
    except UnboundLocalError:
        pass
    # sequential and entropy_bounded (generate.py with the one line added), appended: (gen length, block, steps,
    # temperature, top_k, top_p, eb_threshold, seed); steps equal to and fewer than the block, lengths ending
    # mid-block. A run the upstream code cannot finish (generate.py indexes its step quota past the planned steps
    # when a <|MASK|> drawn at the last step leaves a hole) is recorded as its error.
    more = []
    for strategy, rows in (("sequential", ((16, 4, 4, 1.0, 0, 1.0, None, 11), (16, 4, 2, 0.7, 0, 1.0, None, 11),
                                            (13, 8, 8, 1.0, 0, 1.0, None, 5), (16, 8, 4, 0.4, 0, 1.0, None, 5),
                                            (14, 8, 3, 0.7, 20, 1.0, None, 11), (12, 4, 4, 1.0, 0, 0.9, None, 5),
                                            # (seeds where a <|MASK|> is drawn before a committed position, which
                                            # sequential then draws again, and the run still ends)
                                            (16, 8, 2, 1.0, 0, 1.0, None, 28), (16, 8, 2, 1.0, 0, 1.0, None, 140))),
                           ("entropy_bounded", ((16, 4, 4, 1.0, 0, 1.0, 0.35, 11), (16, 4, 2, 0.7, 0, 1.0, 0.8, 11),
                                                (16, 8, 8, 1.0, 0, 1.0, 2.0, 5), (13, 8, 4, 0.4, 0, 1.0, 0.35, 5),
                                                (14, 8, 8, 0.7, 20, 1.0, 0.8, 11), (12, 4, 4, 1.0, 0, 0.9, 2.0, 5)))):
        for n, block, steps, temp, top_k, top_p, eb, seed in rows:
            more.append({"gen_length": n, "block_length": block, "denoising_steps": steps, "temperature": temp,
                         "top_k": top_k, "top_p": top_p, "remasking_strategy": strategy,
                         **({"eb_threshold": eb} if eb is not None else {}), "seed": seed})
    more = [{**s, "stopping_criteria_idx": stop} for s in more for stop in (None, [im_end, eos])]
    for case, p, kw in each_case(head, im_end, more, prompts):
        try:
            x = gen.block_diffusion_generate(model, {"input_ids": torch.tensor([p])}, mask_id=mask, **kw)
            cases.append({**case, "ids": x[0, len(p):].tolist()})
        except IndexError as e:
            cases.append({**case, "error": f"{type(e).__name__}: {e}"})
    with torch.no_grad():
        ids = torch.tensor([prompts[1]])
        full = torch.ones(1, len(prompts[1]), len(prompts[1]))
        logits = model(ids, attention_mask=full.tril(), use_cache=False).logits[0]  # causal: the prompt alone
    config = {**{k: v for k, v in json.loads(cfg.to_json_string(use_diff=False)).items()
                 if k in json.loads((folder / "config.json").read_text()) and k != "transformers_version"},
              "architectures": ["SDARForCausalLM"], "block_size": 4, "torch_dtype": "float32",
              "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                           "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"}}
    config.pop("mask_token_id", None)  # (as some SDAR folders: the tokenizer's <|MASK|> is the one)
    live_eos = sum(c["eos"] == "live" and im_end in c.get("ids", ()) for c in cases)
    rec = {"family": "sdar", "upstream": {"repo": "JetAstra/SDAR", "files": "generate.py, training/model/SDAR-4B-Chat/",
                                          "commit": commit_of(sdar)},
           "eos_id": im_end, "eos_ids": [im_end, eos], "mask_id": mask, "prompts": prompts,
           "logits": logits_summary(logits), "cases": cases}
    print(f"sdar: {len(cases)} cases ({sum('error' in c for c in cases)} the upstream code fails), <|im_end|> "
          f"generated in {live_eos} of the live ones, <|MASK|> left in {sum(mask in c.get('ids', ()) for c in cases)}")
    write_fixture(out, model, tok, config, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                            "mask_token": "<|MASK|>"}, rec)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eos, "eos_token_id": [im_end, eos],
                                                            "pad_token_id": eos}, indent=2) + "\n")


def record_sdar_redraw(code: list[Path], out: Path) -> None:
    """SDAR's low_confidence_dynamic / low_confidence_static with fewer steps than the block: a step's quota (the
    block's length over the steps, prompt positions included) can exceed the positions still masked, and generate.py's
    torch.topk over the block's confidences (-inf where nothing is masked) then re-draws committed positions, prompt
    tokens in the block included. Recordings only, on the sdar fixture's model (same build, asserted bit for bit). A
    run the upstream code cannot finish (a <|MASK|> drawn at the last step: its quota indexed past the steps) is
    recorded as its error."""
    from safetensors.torch import load_file

    (sdar,) = code
    model, cfg, folder, published, gen, tok, head, prompts, eos, im_end, mask = sdar_model(sdar)
    want = load_file(str(ROOT / "tests" / "fixtures" / "upstream" / "sdar" / "model.safetensors"))
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items() if k in want), "not the sdar fixture"
    settings = []
    for strategy, thr in (("low_confidence_dynamic", 0.85), ("low_confidence_dynamic", 0.5),
                          ("low_confidence_static", None)):
        for n, block, steps, temp, top_k, top_p, seed in ((16, 4, 2, 1.0, 0, 1.0, 11), (16, 8, 4, 0.7, 0, 1.0, 5),
                                                          (13, 8, 3, 1.0, 20, 1.0, 11), (16, 4, 3, 0.4, 0, 0.9, 5),
                                                          (16, 8, 2, 1.0, 0, 1.0, 28), (24, 4, 2, 1.0, 0, 1.0, 7),
                                                          (24, 8, 3, 0.7, 0, 1.0, 3)):
            settings.append({"gen_length": n, "block_length": block, "denoising_steps": steps, "temperature": temp,
                             "top_k": top_k, "top_p": top_p, "remasking_strategy": strategy,
                             **({"confidence_threshold": thr} if thr is not None else {}), "seed": seed,
                             "stopping_criteria_idx": [im_end, eos]})
    cases = []
    for case, p, kw in each_case(head, im_end, settings, prompts):
        try:
            x = published.block_diffusion_generate(model, {"input_ids": torch.tensor([p])}, mask_id=mask, **kw)
            cases.append({**case, "ids": x[0, len(p):].tolist(), "prompt_after": x[0, :len(p)].tolist()})
        except IndexError as e:
            cases.append({**case, "error": f"{type(e).__name__}: {e}"})
    live_eos = sum(c["eos"] == "live" and im_end in c.get("ids", ()) for c in cases)
    moved = sum(c.get("prompt_after", prompts[c["prompt"]]) != prompts[c["prompt"]] for c in cases)
    rec = {"family": "sdar-redraw", "model": "sdar",
           "upstream": {"repo": "JetAstra/SDAR", "files": "generate.py", "commit": commit_of(sdar)},
           "eos_id": im_end, "eos_ids": [im_end, eos], "mask_id": mask, "prompts": prompts, "cases": cases}
    print(f"sdar-redraw: {len(cases)} cases ({sum('error' in c for c in cases)} the upstream code fails), <|im_end|> "
          f"generated in {live_eos} of the live ones, a prompt token re-drawn in {moved}")
    write_recordings(out, rec)


# Fast-dLLM v2 (its remote code: configuration.py, modeling.py with Fast_dLLM_QwenForCausalLM.generate) ----------

FDLLM2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
# a prompt of exactly two blocks of 8 (the first token after it is the prefill's argmax; a prompt of exactly one block
# the generate denoises without the prompt in view, a quirk not recorded)
WHOLE_PROMPT = [5, 58, 33, 70, 2, 47, 19, 66, 12, 39, 77, 24, 51, 9, 63, 28]


def record_fast_dllm_v2(code: list[Path], out: Path) -> None:
    """code: a folder holding Fast-dLLM v2's remote code as its model folder ships it: configuration.py and
    modeling.py (which imports `configuration` as a top-level module)."""
    (folder,) = code
    shim_transformers()
    sys.path.insert(0, str(folder))
    cfg_mod = load_module("configuration", folder / "configuration.py")
    mod = load_module("fdllm2_modeling", folder / "modeling.py")
    tok = word_tokenizer(FDLLM2_SPECIALS)
    V = tok.get_vocab_size()
    eos, im_end, mask = 0, 2, 3
    block = 8
    cfg = cfg_mod.Fast_dLLM_QwenConfig(vocab_size=V, hidden_size=HIDDEN, intermediate_size=FFN,
                                       num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                       num_key_value_heads=KV_HEADS, max_position_embeddings=256, rms_norm_eps=1e-6,
                                       rope_theta=1000000.0, tie_word_embeddings=False, bd_size=block,
                                       bos_token_id=eos, eos_token_id=im_end, pad_token_id=eos)
    cfg._attn_implementation = "sdpa"
    model = mod.Fast_dLLM_QwenForCausalLM(cfg).eval()
    head = model.lm_head.weight
    randomize(model, head, im_end, mask, eos_gain=4.0)
    prompts = [[len(FDLLM2_SPECIALS) + i for i in p] for p in PROMPTS]
    settings = [{"max_new_tokens": n, "block_size": block, "small_block_size": sb, "threshold": thr,
                 "temperature": 0.0} for n in (16, 24) for sb in (4, 8) for thr in (0.9, 0.5, 1.0)]
    # the block cache (use_block_cache: the block's K/V kept across its sub-blocks' passes), the same grid
    cached = [{**s, "use_block_cache": True} for s in settings]
    # sampled (torch.manual_seed(S) before it): a top-p draw for the current sub-block's rows, the threshold read on
    # the drawn token's probability; each setting its own seed. The model's predictions are peaked (its tokens
    # rarely differ from the argmax at temperature 1): temperatures 2 and 4 draw other tokens
    sampled = [{"max_new_tokens": 16, "block_size": block, "small_block_size": sb, "threshold": thr,
                "temperature": t, "top_p": tp, "use_block_cache": c, "seed": 3 + i}
               for i, ((t, tp), (sb, thr, c)) in enumerate(
                   (tt, v) for tt in ((0.7, 0.9), (1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (2.0, 0.95), (4.0, 1.0))
                   for v in ((4, 0.9, False), (8, 0.5, True), (4, 1.0, True)))]
    whole = prompts + [[len(FDLLM2_SPECIALS) + i for i in WHOLE_PROMPT]]  # the third: two whole blocks
    cases = []

    def run(runs, at=0):
        for case, p, kw in runs:
            x = model.generate(torch.tensor([p]), mask_id=mask, stop_token=im_end, **kw)
            cases.append({**case, "prompt": case["prompt"] + at, "ids": x[0, len(p):].tolist()})

    run(each_case(head, im_end, settings, prompts))  # (the first 48: greedy, no block cache)
    run(each_case(head, im_end, settings, whole[2:]), at=2)
    run(each_case(head, im_end, cached + sampled, whole))
    with torch.no_grad():
        logits = model(torch.tensor([prompts[1]]), use_cache=False, block_size=1).logits[0]  # causal: blocks of 1
    generic = ("_attn_implementation_autoset", "transformers_version", "_name_or_path", "id2label", "label2id",
               "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions", "output_hidden_states",
               "problem_type", "return_dict", "dtype")
    config = {**{k: v for k, v in json.loads(cfg.to_json_string(use_diff=False)).items() if k not in generic},
              "architectures": ["Fast_dLLM_QwenForCausalLM"], "torch_dtype": "float32",
              "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                           "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"}}
    live_eos = sum(c["eos"] == "live" and im_end in c["ids"] for c in cases)
    rec = {"family": "fast-dllm-v2", "upstream": {"files": "the model folder's configuration.py and modeling.py",
                                                  "commit": commit_of(folder)},
           "eos_id": im_end, "mask_id": mask, "prompts": whole, "logits": logits_summary(logits), "cases": cases}
    print(f"fast-dllm-v2: {len(cases)} cases, <|im_end|> generated in {live_eos} of the live ones")
    write_fixture(out, model, tok, config, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                            "mask_token": "<|mask|>"}, rec)


# LLaDA 2.0 / 2.1 (the remote code of the model folders: configuration_llada2_moe.py, modeling_llada2_moe.py with
# LLaDA2MoeModelLM.generate; 2.1's generate adds token editing) -------------------------------------------------

LLADA2_SPECIALS = ["<|endoftext|>", "<|startoftext|>", "<|role_end|>", "<|mask|>"]
# config.json's keys as LLaDA2.0-mini's (configuration_llada2_moe.py)
LLADA2_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "first_k_dense_replace", "hidden_act",
               "max_position_embeddings", "moe_intermediate_size", "norm_topk_prob", "num_experts_per_tok",
               "norm_head", "num_attention_heads", "num_experts", "num_key_value_heads", "rope_theta",
               "rope_scaling", "tie_word_embeddings", "use_bias", "use_rmsnorm", "rms_norm_eps", "head_dim",
               "num_shared_experts", "use_cache", "use_qkv_bias", "embedding_dropout", "output_dropout",
               "vocab_size", "rotary_dim", "router_dtype", "moe_router_enable_expert_bias", "routed_scaling_factor",
               "n_group", "topk_group", "score_function", "initializer_range", "output_router_logits",
               "pad_token_id", "eos_token_id", "mask_token_id", "partial_rotary_factor", "use_sliding_window",
               "attention_dropout", "use_qk_norm")


def llada2_classes(folder: Path, name: str):
    """(config class, LLaDA2MoeModelLM) from a folder of LLaDA 2 remote code: configuration_*.py and modeling_*.py
    (the hub's folders name them *_llada2_moe.py; a copy may name 2.1's *_llada21_moe.py)."""
    load_package(name, folder)
    (cfg_path,) = folder.glob("configuration_llada2*_moe.py")
    (mod_path,) = folder.glob("modeling_llada2*_moe.py")
    cfg_mod = load_module(f"{name}.{cfg_path.stem}", cfg_path)
    mod = load_module(f"{name}.{mod_path.stem}", mod_path)
    return cfg_mod.LLaDA2MoeConfig, mod.LLaDA2MoeModelLM


def float_mask(model) -> None:
    """LLaDA 2's generate builds its block mask (0 / -inf) in bfloat16, the dtype of the published weights; SDPA
    wants the queries' dtype, so the mask reaches a float32 model as float32 (the same 0 / -inf values)."""
    fwd = model.forward

    def forward(*a, attention_mask=None, **k):
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = attention_mask.float()
        return fwd(*a, attention_mask=attention_mask, **k)
    model.forward = forward


def record_llada2(code: list[Path], out: Path) -> None:
    """code: a folder with LLaDA 2.0's remote code (its generate: threshold decoding), then one with LLaDA 2.1's
    (its generate: threshold decoding with token editing). Needs transformers 4.x (the remote code imports
    transformers.modeling_attn_mask_utils, gone in 5.x): run this with transformers 4.57."""
    v20, v21 = code
    Config, Model20 = llada2_classes(v20, "llada2_upstream")
    _, Model21 = llada2_classes(v21, "llada21_upstream")
    tok = word_tokenizer(LLADA2_SPECIALS)
    V = tok.get_vocab_size()
    eos, mask = 0, 3
    cfg = Config(vocab_size=V, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
                 moe_intermediate_size=16, num_experts=8, num_shared_experts=1, num_experts_per_tok=3, n_group=4,
                 topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, use_qkv_bias=False, use_bias=False,
                 use_qk_norm=True, use_rmsnorm=True, norm_head=False, rms_norm_eps=1e-6, max_position_embeddings=256,
                 rope_theta=600000, rope_scaling=None, partial_rotary_factor=0.5, rotary_dim=(HIDDEN // HEADS) // 2,
                 embedding_dropout=0.0, attention_dropout=0.0, output_dropout=0.0, pad_token_id=eos,
                 eos_token_id=eos, mask_token_id=mask, moe_router_enable_expert_bias=True, score_function="sigmoid",
                 router_dtype="fp32", norm_topk_prob=True, tie_word_embeddings=False, use_cache=False,
                 output_router_logits=False, use_sliding_window=False, initializer_range=0.02, hidden_act="silu")
    cfg._attn_implementation = "sdpa"
    model = Model20(cfg).eval()
    head = model.lm_head.weight
    randomize(model, head, eos, mask, eos_gain=2.5, head_std=0.6)  # (flatter: thresholds and edits both matter)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.expert_bias.copy_(0.3 * torch.randn(layer.mlp.gate.expert_bias.shape, generator=g))
    model21 = Model21(cfg).eval()
    model21.load_state_dict(model.state_dict())
    for m in (model, model21):
        float_mask(m)
    prompts = [[len(LLADA2_SPECIALS) + i for i in p] for p in PROMPTS]

    # 2.0: generate(gen_length, block_length, steps, threshold, temperature 0; the step's quota when fewer are above
    # the threshold); steps above gen_length shrink to it; eos_early_stop changes when it returns, not what
    v20_settings = [{"gen_length": n, "block_length": b, "steps": st, "threshold": t}
                    for n, b, st, t in ((16, 8, 8, 0.95), (16, 8, 8, 0.5), (16, 8, 8, 1.0), (24, 8, 4, 0.9),
                                        (12, 4, 4, 0.7), (16, 8, 32, 0.9), (20, 8, 2, 0.8),
                                        (6, 8, 8, 0.9), (3, 4, 4, 1.0))]
    v20_settings.append({**v20_settings[1], "eos_early_stop": True})
    # sampled (torch.manual_seed(S) before it): a multinomial draw for every position of the block, the threshold read
    # on the drawn token's probability under the tempered, top-k / top-p distribution
    v20_settings += [{"gen_length": 16, "block_length": 8, "steps": 8, "threshold": 0.9, **s, "seed": 5}
                     for s in ({"temperature": 0.8, "top_p": 0.95}, {"temperature": 1.0, "top_k": 20},
                               {"temperature": 0.7})]
    # 2.1: generate(gen_length, block_length, threshold, editing_threshold, max_post_steps, num_to_transfer): masks
    # committed above `threshold` (else the num_to_transfer most confident), and in the same pass every committed,
    # non-prompt token of the block whose re-prediction differs with probability above `editing_threshold` replaced;
    # after the block's last mask, up to max_post_steps passes that only edit
    v21_settings = [{"gen_length": n, "block_length": b, "threshold": t, "editing_threshold": et,
                     "max_post_steps": mp, "num_to_transfer": k}
                    for n, b, t, et, mp, k in ((16, 8, 0.7, 0.5, 16, 1), (16, 8, 0.5, 0.0, 16, 1),
                                               (16, 8, 0.95, 0.9, 16, 1), (16, 8, 0.7, 0.5, 0, 1),
                                               (12, 4, 0.5, 0.3, 4, 2), (24, 8, 0.9, 0.6, 2, 1))]
    # sampled: one draw for every position of the block, read by the mask commits and the edits alike
    v21_settings += [{**v21_settings[0], **s, "seed": 5} for s in ({"temperature": 0.8, "top_p": 0.95},
                                                                    {"temperature": 1.0, "top_k": 20})]
    cases = []
    for case, p, kw in each_case(head, eos, [{**s, "version": "2.0"} for s in v20_settings], prompts):
        kw.pop("version")
        x = model.generate(torch.tensor([p]), eos_id=eos, mask_id=mask, **{"temperature": 0.0, **kw})
        cases.append({**case, "ids": x[0].tolist()})
    for case, p, kw in each_case(model21.lm_head.weight, eos, [{**s, "version": "2.1"} for s in v21_settings],
                                 prompts):
        kw.pop("version")
        x = model21.generate(torch.tensor([p]), eos_id=eos, mask_id=mask, **{"temperature": 0.0, **kw})
        cases.append({**case, "ids": x[0].tolist()})
    with torch.no_grad():
        ids = torch.tensor([prompts[1]])
        full = torch.zeros(1, 1, len(prompts[1]), len(prompts[1]))  # every position attending to every other
        logits = model(ids, attention_mask=full).logits[0]
        assert torch.equal(logits, model21(ids, attention_mask=full).logits[0])  # (2.0's and 2.1's classes agree)
    hf = json.loads(cfg.to_json_string(use_diff=False))
    config = {**{k: hf[k] for k in LLADA2_KEYS if k in hf}, "architectures": ["LLaDA2MoeModelLM"],
              "model_type": "llada2_moe", "torch_dtype": "float32",
              "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                           "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                           "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"}}
    live_eos = sum(c["eos"] == "live" and eos in c["ids"] for c in cases)
    rec = {"family": "llada2", "upstream": {"repo": "ZHZisZZ/dllm", "files": "dllm/pipelines/llada2/models/, "
                                            "dllm/pipelines/llada21/models/ (the LLaDA2.0 / LLaDA2.1 model folders' "
                                            "remote code)", "commit": commit_of(v20) if commit_of(v20) == commit_of(v21)
                                            else [commit_of(v20), commit_of(v21)]},
           "eos_id": eos, "mask_id": mask, "prompts": prompts, "logits": logits_summary(logits), "cases": cases}
    print(f"llada2: {len(cases)} cases, <eos> generated in {live_eos} of the live ones")
    write_fixture(out, model, tok, config, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                                            "mask_token": "<|mask|>"}, rec)


# Nemotron-Labs-Diffusion (the model folders' remote code: modeling_nemotron_labs_diffusion.py with
# configuration_nemotron_labs_diffusion.py for `generate` and `linear_spec_generate`; the earlier folders'
# modeling_ministral_dlm.py with configuration_ministral_dlm.py for the quadratic `self_spec_generate` and their
# `linear_spec_generate`). Both import `.modeling_ministral`, which no copy reachable here holds: the script puts in
# its place the backbone that code reads, built from transformers' own Ministral 3 parts (nemotron_backbone). -----

NEMO_SPECIALS = ["<unk>", "<s>", "</s>", "<mask>"]
NEMO_ROPE = dict(rope_type="yarn", rope_theta=1000000.0, factor=16.0, original_max_position_embeddings=4096,
                 beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)


def nemotron_backbone(name: str) -> types.ModuleType:
    """The module the remote code imports as `.modeling_ministral`, on transformers 5.x's Ministral 3 parts (MLP,
    RMSNorm, YaRN rotary embedding, rotate-half RoPE, repeat_kv, the pretrained-model base). What the remote code
    reads from it, as its callers use it (the attention classes of modeling_ministral_dlm.py and of a public port's
    mask-aware subclass, which re-states the native forward):
      Ministral3Attention   q/k/v/o projections; RoPE; the queries times 1 + beta * log(1 + floor(p / original
                            max positions)) at the cache positions p; with a cache: written (use_cache) or read
                            and concatenated (not use_cache); attention over every key when `diffusion_lm` is on,
                            else under the model's causal mask (none: every key). softmax(q k^T / sqrt(d)) v.
      Ministral3Model       layers of `config.attn_class`; positions and cache positions counted from the cache;
                            the causal mask (query i sees the cache and the block's keys <= i) only when
                            use_causal_mask=True; returns last_hidden_state and past_key_values.
    The recordings keep every position below original_max_position_embeddings (4096), where that factor is 1, so
    which positions feed it (cache positions or position ids, which differ in the quadratic rows) does not matter."""
    from dataclasses import dataclass

    from transformers.cache_utils import DynamicCache
    from transformers.models.ministral3 import modeling_ministral3 as stock

    m = types.ModuleType(name)
    m.apply_rotary_pos_emb, m.repeat_kv = stock.apply_rotary_pos_emb, stock.repeat_kv

    def llama_4_attn_scale(positions, beta, max_position_embeddings):
        return (1 + beta * torch.log(1 + torch.floor(positions / max_position_embeddings))).unsqueeze(-1)

    class Ministral3Attention(torch.nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.config, self.layer_idx = config, layer_idx
            self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
            self.scaling = self.head_dim ** -0.5
            self.diffusion_lm = getattr(config, "diffusion_lm", False)
            H, KV, D = config.num_attention_heads, config.num_key_value_heads, self.head_dim
            self.q_proj = torch.nn.Linear(config.hidden_size, H * D, bias=False)
            self.k_proj = torch.nn.Linear(config.hidden_size, KV * D, bias=False)
            self.v_proj = torch.nn.Linear(config.hidden_size, KV * D, bias=False)
            self.o_proj = torch.nn.Linear(H * D, config.hidden_size, bias=False)

        def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
                    cache_position=None, use_cache=False, **_):
            shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            q = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # (B, H, T, D)
            k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
            v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
            cos, sin = position_embeddings
            q, k = stock.apply_rotary_pos_emb(q, k, cos, sin)
            rp = self.config.rope_parameters
            q = q * llama_4_attn_scale(cache_position, rp.get("llama_4_scaling_beta"),
                                       rp.get("original_max_position_embeddings")).to(q.dtype)
            if past_key_values is not None:
                if use_cache:
                    k, v = past_key_values.update(k, v, self.layer_idx)
                else:
                    layer = past_key_values.layers[self.layer_idx]
                    k, v = torch.cat([layer.keys, k], dim=-2), torch.cat([layer.values, v], dim=-2)
            k, v = stock.repeat_kv(k, self.num_key_value_groups), stock.repeat_kv(v, self.num_key_value_groups)
            mask = None if self.diffusion_lm else attention_mask
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
            return self.o_proj(o.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None

    class Ministral3DecoderLayer(torch.nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.self_attn = getattr(config, "attn_class", Ministral3Attention)(config, layer_idx)
            self.mlp = stock.Ministral3MLP(config)
            self.input_layernorm = stock.Ministral3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.post_attention_layernorm = stock.Ministral3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

        def forward(self, h, attention_mask, position_embeddings, past_key_values, cache_position, use_cache,
                    is_training):
            r = h
            h, _ = self.self_attn(hidden_states=self.input_layernorm(h), position_embeddings=position_embeddings,
                                  attention_mask=attention_mask, past_key_values=past_key_values,
                                  cache_position=cache_position, use_cache=use_cache, is_training=is_training)
            h = r + h
            return h + self.mlp(self.post_attention_layernorm(h))

    @dataclass
    class Output:
        last_hidden_state: torch.Tensor | None = None
        past_key_values: object = None

    class Ministral3Model(stock.Ministral3PreTrainedModel):
        def __init__(self, config):
            super().__init__(config)
            self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = torch.nn.ModuleList([Ministral3DecoderLayer(config, i)
                                               for i in range(config.num_hidden_layers)])
            self.norm = stock.Ministral3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.rotary_emb = stock.Ministral3RotaryEmbedding(config=config)
            self.post_init()

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    inputs_embeds=None, use_cache=None, cache_position=None, is_training=False,
                    use_causal_mask=False, **_):
            h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, C)
            if use_cache and past_key_values is None:
                past_key_values = DynamicCache()
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            T = h.shape[1]
            if cache_position is None:
                cache_position = torch.arange(past, past + T, device=h.device)
            if position_ids is None:
                position_ids = cache_position.unsqueeze(0)
            causal = None
            if use_causal_mask:  # (T, past + T): query i sees the cache and the block's keys up to itself
                causal = torch.arange(past + T, device=h.device)[None, :] <= past + torch.arange(T, device=h.device)[:, None]
            pe = self.rotary_emb(h, position_ids=position_ids)
            for layer in self.layers:
                h = layer(h, causal, pe, past_key_values, cache_position, use_cache, is_training)
            return Output(last_hidden_state=self.norm(h), past_key_values=past_key_values if use_cache else None)

    m.Ministral3Attention, m.Ministral3Model = Ministral3Attention, Ministral3Model
    m.Ministral3PreTrainedModel = stock.Ministral3PreTrainedModel
    m._get_llama_4_attn_scale = llama_4_attn_scale
    return m


def shim_nemotron(pkg: str) -> None:
    """The backbone module (nemotron_backbone); transformers 5.x's renaming of `past_key_values=` off; DynamicCache.crop(n) keeping n positions, as
    before 5.x (5.x takes the number to remove); flash-attn's kernel as SDPA with the same causal flag (bottom-right
    aligned, as flash-attn aligns a shorter query block with the keys); flex attention's block masks made on the CPU
    (`create_block_mask(..., device="cuda")` -> device "cpu"; flex_attention itself runs eagerly on the CPU)."""
    import torch.nn.attention.flex_attention as fx
    import transformers.utils.generic as generic

    # (5.x renames past_key_values to cache in every ModelOutput, on construction and on every attribute write: the
    # remote code's output classes declare a past_key_values field and read it back, which would read None)
    generic._rename_kwargs_for_bc = lambda kwargs: None
    generic.ModelOutput._replace_old_cache_name = lambda self, key: key
    sys.modules[f"{pkg}.modeling_ministral"] = nemotron_backbone(f"{pkg}.modeling_ministral")
    from transformers.cache_utils import DynamicCache

    def crop(self, max_length: int) -> None:  # (transformers < 5.x: keep max_length positions; 5.x refuses a positive)
        for layer in self.layers:
            if layer.is_initialized:
                n = layer.keys.shape[-2]
                keep = max_length if max_length >= 0 else n + max_length
                layer.keys, layer.values = layer.keys[..., :keep, :], layer.values[..., :keep, :]

    DynamicCache.crop = crop

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **_):  # (B, L, H, D)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        mask = None
        if causal:
            Lq, Lk = q.shape[2], k.shape[2]
            mask = torch.arange(Lk)[None, :] <= (Lk - Lq) + torch.arange(Lq)[:, None]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                scale=softmax_scale).transpose(1, 2)

    fa = types.ModuleType("flash_attn")
    fa.flash_attn_func = flash_attn_func
    fa.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    sys.modules["flash_attn"] = fa
    make = fx.create_block_mask

    def create_block_mask(*a, device=None, **k):
        return make(*a, device="cpu", **k)

    fx.create_block_mask = create_block_mask  # (read at the remote code's import: `from ... import create_block_mask`)


class Calls:
    """The input ids of every forward of the model's encoder, in order (a forward pre-hook: what each step of a
    generate function ran on, read without touching the function)."""

    def __init__(self, encoder):
        self.ids: list[list[int]] = []
        encoder.register_forward_pre_hook(lambda mod, a, k: self.ids.append((k.get("input_ids") if "input_ids" in k
                                                                             else a[0])[0].tolist()),
                                          with_kwargs=True)


def record_nemotron(code: list[Path], out: Path) -> None:
    """code: one folder holding the remote code of both generations of the model folders (modeling_nemotron_labs_
    diffusion.py, configuration_nemotron_labs_diffusion.py, modeling_ministral_dlm.py, configuration_ministral_dlm.py;
    relative imports between them, so loaded as a package); `.modeling_ministral` is shimmed (shim_nemotron)."""
    (folder,) = code  # (+ chat_utils.py, which modeling_ministral_dlm.py imports)
    shim_nemotron("nld_upstream")
    new = load_package("nld_upstream", folder)
    new_cfg = load_module("nld_upstream.configuration_nemotron_labs_diffusion",
                          folder / "configuration_nemotron_labs_diffusion.py")
    new_mod = load_module("nld_upstream.modeling_nemotron_labs_diffusion", folder / "modeling_nemotron_labs_diffusion.py")
    old_cfg = load_module("nld_upstream.configuration_ministral_dlm", folder / "configuration_ministral_dlm.py")
    old_mod = load_module("nld_upstream.modeling_ministral_dlm", folder / "modeling_ministral_dlm.py")
    del new
    tok = word_tokenizer(NEMO_SPECIALS)
    V = tok.get_vocab_size()
    bos, eos, mask = 1, 2, 3
    shape = dict(vocab_size=V, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
                 max_position_embeddings=128, rms_norm_eps=1e-5, rope_parameters=dict(NEMO_ROPE), bos_token_id=bos,
                 eos_token_id=eos, pad_token_id=0, mask_token_id=mask, block_size=8, tie_word_embeddings=False)
    cfg = new_cfg.NemotronLabsDiffusionConfig(dlm_paradigm="bidirectional", **shape)
    cfg._attn_implementation = "sdpa"
    model = new_mod.NemotronLabsDiffusionModel(cfg).eval()
    head = model.diffusion_head.weight
    randomize(model, head, eos, mask, eos_gain=1.6)

    def old_model(paradigm: str):
        """The earlier class on the same weights: sbd_block_diff (the joint folders' paradigm: MinistralFlexAttention
        on every layer) for generate_diffusion and self_spec_generate; bidirectional with the plain attention for
        linear_spec_generate (under sbd_block_diff its encoder calls would take the training block mask)."""
        # (rope_scaling given too: on transformers 5.x it is an alias of rope_parameters, and the class's
        # `self.rope_scaling = rope_scaling` would otherwise reset them to plain RoPE)
        c = old_cfg.MinistralDLMConfig(dlm_paradigm=paradigm, dlm_type="llada", max_seq_length=64,
                                       rope_scaling=dict(NEMO_ROPE), **shape)
        assert c.rope_parameters == model.config.rope_parameters
        c._attn_implementation = "sdpa"
        m = old_mod.MinistralDiffEncoderModel(c).eval()
        m.load_state_dict(model.state_dict())
        return m

    prompts = [[len(NEMO_SPECIALS) + i for i in p] for p in PROMPTS]
    cases = []
    settings = [{"mode": "generate", "max_new_tokens": n, "block_length": b, "threshold": t}
                for n, b in ((16, 4), (16, 8), (24, 8)) for t in (None, 0.9, 0.5)]
    settings += [{"mode": "generate", "max_new_tokens": 16, "block_length": b, "threshold": t, "temperature": 0.8,
                  "seed": 5} for b, t in ((4, None), (8, 0.9))]
    settings += [{"mode": "linear_spec_generate", "max_new_tokens": n, "block_length": b, "threshold": t}
                 for n, b in ((16, 4), (24, 8)) for t in (0.0, 0.5, 0.9)]
    settings += [{"mode": "linear_spec_generate", "code": "ministral_dlm", "max_new_tokens": n, "block_length": b,
                  "threshold": 0.0} for n, b in ((16, 4), (24, 8))]
    settings += [{"mode": "self_spec_generate", "code": "ministral_dlm", "max_new_tokens": n, "block_length": b,
                  "steps": n} for n, b in ((16, 4), (24, 8), (16, 8))]
    settings += [{"mode": "generate_diffusion", "code": "ministral_dlm", "max_new_tokens": n, "block_length": b,
                  "steps": st, "threshold": t} for n, b, st in ((16, 8, 16), (16, 8, 8), (24, 4, 12))
                 for t in (None, 0.9)]
    settings += [{"mode": "generate_diffusion", "code": "ministral_dlm", "max_new_tokens": 16, "block_length": 8,
                  "steps": 16, "threshold": 0.5, "temperature": 0.7, "seed": 3}]
    # the options of generate / generate_diffusion / self_spec_generate recorded later (after the first 116 cases,
    # which stay as they were): causal_context=False, shift_logits, ar_mix_weight
    more = [{"mode": "generate_diffusion", "code": "ministral_dlm", "max_new_tokens": n, "block_length": b,
             "steps": st, "threshold": t, "causal_context": cc, "shift_logits": sh}
            for cc, sh in ((True, True), (False, False), (False, True))
            for n, b, st, t in ((16, 8, 16, None), (16, 8, 8, 0.9), (24, 4, 12, None))]
    more += [{"mode": "generate_diffusion", "code": "ministral_dlm", "max_new_tokens": 16, "block_length": 8,
              "steps": 16, "threshold": 0.5, "temperature": 0.7, "seed": 3, "causal_context": cc, "shift_logits": sh}
             for cc, sh in ((True, True), (False, False), (False, True))]
    more += [{"mode": "generate", "max_new_tokens": n, "block_length": b, "threshold": t, "causal_context": False}
             for n, b, t in ((16, 4, None), (16, 8, 0.9), (24, 8, 0.5))]
    more += [{"mode": "generate", "max_new_tokens": 16, "block_length": 8, "threshold": 0.9, "temperature": 0.8,
              "seed": 5, "causal_context": False}]
    more += [{"mode": "self_spec_generate", "code": "ministral_dlm", "max_new_tokens": n, "block_length": b,
              "steps": n, "ar_mix_weight": w} for n, b, w in ((16, 4, 0.5), (24, 8, 0.3), (16, 8, 0.0))]
    # then the thinking budgets of generate / generate_diffusion (end_think_token_id: w28, a token these prompts
    # generate unasked, so that some runs hold it before their budget runs out; max_thinking_tokens a multiple of the
    # block too, where the injection overwrites the AR seed)
    think = [{"mode": "generate", "max_new_tokens": n, "block_length": b, "threshold": t, "max_thinking_tokens": m,
              "end_think_token_id": len(NEMO_SPECIALS) + 28}
             for n, b, t, m in ((16, 4, None, 6), (16, 8, 0.9, 8), (24, 8, None, 5))]
    think += [{"mode": "generate", "max_new_tokens": 16, "block_length": 8, "threshold": 0.9, "temperature": 0.8,
               "seed": 5, "max_thinking_tokens": 3, "end_think_token_id": len(NEMO_SPECIALS) + 28},
              {"mode": "generate", "max_new_tokens": 16, "block_length": 8, "threshold": None, "causal_context": False,
               "max_thinking_tokens": 4, "end_think_token_id": len(NEMO_SPECIALS) + 28}]
    think += [{"mode": "generate_diffusion", "code": "ministral_dlm", "max_new_tokens": n, "block_length": b,
               "steps": st, "threshold": None, "shift_logits": sh, "max_thinking_tokens": m,
               "end_think_token_id": len(NEMO_SPECIALS) + 28} for n, b, st, sh, m in ((16, 8, 16, False, 10),
                                                                                    (24, 4, 12, True, 9))]
    for case, p, kw in itertools.chain(each_case(head, eos, settings, prompts), each_case(head, eos, more, prompts),
                                       each_case(head, eos, think, prompts)):
        kw = dict(kw)
        mode, which = kw.pop("mode"), kw.pop("code", "nemotron_labs_diffusion")
        if which == "ministral_dlm":
            rng = torch.get_rng_state()  # (building a model draws its initial weights: the case's seed stays)
            m = old_model("bidirectional" if mode == "linear_spec_generate" else "sbd_block_diff")
            torch.set_rng_state(rng)
            with torch.no_grad():
                m.diffusion_head.weight.copy_(head)  # (the <eos> row as this case has it)
        else:
            m = model
        calls = Calls(m.encoder)
        x, nfe = getattr(m, mode)(torch.tensor([p]), **kw)
        cases.append({**case, "ids": x[0, len(p):].tolist(), "nfe": nfe, "calls": [c for c in calls.ids]})
        m.encoder._forward_pre_hooks.clear()
    with torch.no_grad():
        for layer in model.encoder.layers:
            layer.self_attn.diffusion_lm = False
        logits = model(torch.tensor([prompts[1]]), use_causal_mask=True).logits[0]  # the AR mode
        for layer in model.encoder.layers:
            layer.self_attn.diffusion_lm = True
    generic = ("_attn_implementation_autoset", "transformers_version", "_name_or_path", "id2label", "label2id",
               "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions", "output_hidden_states",
               "problem_type", "return_dict", "dtype", "rope_scaling", "rope_theta")
    config = {**{k: v for k, v in json.loads(cfg.to_json_string(use_diff=False)).items() if k not in generic},
              "architectures": ["NemotronLabsDiffusionModel"], "torch_dtype": "float32",
              "auto_map": {"AutoConfig": "configuration_nemotron_labs_diffusion.NemotronLabsDiffusionConfig",
                           "AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel"}}
    live_eos = sum(c["eos"] == "live" and eos in c["ids"] for c in cases)
    rec = {"family": "nemotron", "upstream": {"files": "modeling_nemotron_labs_diffusion.py, "
                                              "configuration_nemotron_labs_diffusion.py, modeling_ministral_dlm.py, "
                                              "configuration_ministral_dlm.py (docs/log/parity.md: where from)",
                                              "backbone": "modeling_ministral.py reconstructed (nemotron_backbone)"},
           "eos_id": eos, "mask_id": mask, "prompts": prompts, "logits": logits_summary(logits), "cases": cases}
    print(f"nemotron: {len(cases)} cases, <eos> generated in {live_eos} of the live ones")
    write_fixture(out, model, tok, config, {"eos_token": "</s>", "bos_token": "<s>", "unk_token": "<unk>",
                                            "mask_token": "<mask>"}, rec)


FAMILIES = {"dream": record_dream, "llada": record_llada, "fast-dllm-llada": record_fast_dllm_llada,
            "sdar": record_sdar, "fast-dllm-v2": record_fast_dllm_v2,
            "llada2": record_llada2, "nemotron": record_nemotron}
FAMILIES["dream-block"] = record_dream_block  # (its recordings only: the model is the dream fixture's)
FAMILIES["dream-block-one-step"] = record_dream_block_one_step  # (the same)
FAMILIES["dream-threshold"] = record_dream_threshold  # (the same)
FAMILIES["sdar-redraw"] = record_sdar_redraw  # (its recordings only: the model is the sdar fixture's)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family", choices=sorted(FAMILIES))
    ap.add_argument("--code", type=Path, action="append", required=True,
                    help="a checkout of the family's public repository (see the module docstring for which)")
    ap.add_argument("--out", type=Path, default=None, help="default: tests/fixtures/upstream/FAMILY")
    a = ap.parse_args()
    torch.set_num_threads(1)
    FAMILIES[a.family](a.code, a.out or ROOT / "tests" / "fixtures" / "upstream" / a.family)


if __name__ == "__main__":
    main()
