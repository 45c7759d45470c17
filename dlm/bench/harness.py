"""The bench harness: methods, cases, interleaved repeated timing (dlm.bench describes the method)."""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from dlm.errors import DlmError
from dlm.sampling import SampleConfig, options_read, stream
from dlm.sampling.common import Result, drain
from dlm.tasks.common import Case


@dataclass
class Method:
    name: str  # row label, e.g. "ar (KV cache)"
    paradigm: str  # ar | mdlm | usdm | spec | ...
    model: Any
    ck: Any
    cfg: SampleConfig
    settings: dict[str, Any] = field(default_factory=dict)  # what a reader needs to reproduce the row
    drafter: Any = None  # speculation: the drafter, loaded once
    rows: Any = None  # --compile: the row batch (dlm.sampling.rows.Programs) its cases run through, as dlm serve's

    def __post_init__(self) -> None:
        """A row sets only options its sampler reads (dlm.sampling.OPTIONS): a setting that would be ignored is a
        bug in the row, not a measurement."""
        if not isinstance(self.cfg, SampleConfig) or not hasattr(self.ck, "objective"):
            return  # a stand-in row (the harness's tests)
        paradigm = "speculative" if self.drafter is not None or self.cfg.draft else self.ck.objective
        kind = getattr(self.drafter, "kind", None)
        defaults = SampleConfig()
        ignored = [f.name for f in dataclasses.fields(self.cfg) if getattr(self.cfg, f.name) != getattr(defaults, f.name)
                   and f.name not in options_read(paradigm, kind)]
        if ignored:
            raise ValueError(f"bench row {self.name!r}: {paradigm} does not read {', '.join(ignored)}")

    def run(self, ids: list[int]) -> Result:
        tok = self.ck.tokenizer
        return drain(stream(self.model, self.ck, [ids], self.cfg, self.drafter), tok.text, tok.eos_ids)


@dataclass
class Item:
    """One bench prompt: a case of a task."""

    task: ModuleType
    case: Case


def run_item(method: Method, item: Item, context: int) -> dict[str, Any]:
    """One case through one method (the task builds the request for the method's paradigm)."""
    from dlm.tasks import run_case, run_case_rows

    if method.rows is not None:
        return run_case_rows(item.task, item.case, method.rows, method.ck, method.cfg, context, method.drafter)
    return run_case(item.task, item.case, method.model, method.ck, method.cfg, method.drafter, context)


def schedule(n_methods: int, n_items: int, repeat: int) -> list[tuple[int, int, int]]:
    """The order of the timed runs as (repetition, item, method): round-robin over the methods for each item,
    the methods' order rotated by one each repetition."""
    out = []
    for r in range(repeat):
        order = [(r + j) % n_methods for j in range(n_methods)]
        for i in range(n_items):
            out += [(r, i, m) for m in order]
    return out


def run_interleaved(methods: list[Method], items: list[Item], repeat: int, warmup: int,
                    run: Callable[[Method, Item], dict[str, Any]],
                    progress: Callable[[], None] | None = None) -> list[list[list[dict[str, Any]]]]:
    """rows[method][repetition][item], after `warmup` untimed runs of each method on its own (first item)."""
    for m in methods:
        for _ in range(warmup):
            run(m, items[0])
    rows: list[list[list[Any]]] = [[[None] * len(items) for _ in range(repeat)] for _ in methods]
    for r, i, k in schedule(len(methods), len(items), repeat):
        rows[k][r][i] = run(methods[k], items[i])
        if progress:
            progress()
    return rows


def environment() -> dict[str, Any]:
    return {
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_json(path: str | os.PathLike, report: dict[str, Any]) -> None:
    from dlm.files import write_json as atomic_write

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(p, report)


def check_positive(name: str, v: int) -> None:
    if v <= 0:
        raise DlmError(f"--{name} must be > 0, got {v}")
