"""The catalogue of bench methods: the rows each paradigm contributes (AR, mdlm, usdm, joint, speculative)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from torch import nn

from dlm.bench.harness import Item, Method
from dlm.checkpoint import load_model
from dlm.errors import DlmError
from dlm.sampling import SampleConfig


def ar_methods(model, ck, max_new_tokens: int, naive: bool = True) -> list[Method]:
    cfg = SampleConfig(max_new_tokens=max_new_tokens)
    settings = {"model": str(ck.path), "greedy": True}
    methods = [Method("ar (KV cache)", "ar", model, ck, cfg, settings)]
    if naive:
        methods.append(Method("ar (naive, no cache)", "ar", model, ck, cfg.replace(naive=True), settings))
    return methods


def load_paired(path: str, objective: str, ref_ck, like: nn.Module | None = None):
    """A diffusion checkpoint for the bench, on the device and in the dtype of the reference model `like` (default:
    the CPU, float32): of the given objective, with the reference model's tokenizer (the quality column scores its text
    under that model)."""
    where = {} if like is None else dict(device=like.device, dtype=like.embed_tokens.weight.dtype)
    net, ck = load_model(path, option=f"--{objective}", **where)
    if ck.objective != objective:
        raise DlmError(f"--{objective} {path}: objective {ck.objective!r}, expected a {objective} checkpoint")
    if ck.tokenizer.sha256 != ref_ck.tokenizer.sha256:
        raise DlmError(f"--{objective} {path}: its tokenizer differs from the reference model's {ref_ck.path} "
                       "(the quality column needs one)")
    return net, ck


def usdm_settings(sweep: bool) -> list[tuple[str, dict[str, Any]]]:
    """(row name, SampleConfig fields) of the usdm rows: its defaults (48 steps at most, adaptive stopping) and a
    parallel setting (8 steps per canvas at most); the sweep adds fixed steps and entropy bounds."""
    rows = [("usdm (adaptive)", {}), ("usdm (adaptive, 8 steps)", dict(steps=8))]
    if sweep:
        rows += [("usdm (fixed 48 steps)", dict(adaptive=False))]
        rows += [(f"usdm steps={n}", dict(steps=n)) for n in (24, 16, 4)]
        rows += [(f"usdm bound={b}", dict(entropy_bound=b)) for b in (0.5, 2.0)]
    return rows


def usdm_methods(path: str, ref_ck, max_new_tokens: int, sweep: bool = False, like=None) -> list[Method]:
    """Rows for a usdm checkpoint (`usdm_settings`), with the reference AR model's tokenizer."""
    from dlm.sampling.usdm import check_options

    net, ck = load_paired(path, "usdm", ref_ck, like)

    def method(name: str, cfg: SampleConfig) -> Method:
        L, steps = check_options(net, ck, cfg)
        settings = {"model": str(ck.path), "sampler": "entropy_bound", "canvas_length": L, "steps": steps,
                    "adaptive": cfg.adaptive, "entropy_bound": cfg.entropy_bound, "seed": cfg.seed}
        return Method(name, "usdm", net, ck, cfg, settings)

    cfg = SampleConfig(max_new_tokens=max_new_tokens)
    return [method(name, cfg.replace(**opts)) for name, opts in usdm_settings(sweep)]


def mdlm_settings(block: int, sweep: bool) -> list[dict[str, Any]]:
    """The sampler settings of the mdlm rows (SampleConfig fields); `block` is the sampling block size.

    Without sweep: LLaDA confidence at one token per step (the quality reference), and a parallel setting: the
    entropy bound 1.0 with a budget of block/4 steps (so at least 4 tokens per forward in a block of 32).
    With sweep: confidence at block/1, /2, /3, /4, /6, /8 steps; entropy bounds 0.01 .. 12; thresholds 0.999 .. 0.1
    (the near-certain end decides sudoku, where two cells committed together can clash); the entropy-bound sampler
    at half and twice the block length; confidence at two tokens per step in blocks of 4 and 8.
    """
    rows: list[dict[str, Any]] = [dict(sampler="confidence"),
                                  dict(sampler="entropy_bound", entropy_bound=1.0, steps=max(1, block // 4))]
    if sweep:  # small models are unsure (entropies of several nats): the useful bounds reach far above 0.1
        steps = sorted({max(1, round(block / d)) for d in (1, 2, 3, 4, 6, 8)}, reverse=True)
        rows = [dict(sampler="confidence", steps=s) for s in steps]
        rows += [dict(sampler="entropy_bound", entropy_bound=b) for b in (0.01, 0.1, 1.0, 3.0, 5.0, 8.0, 12.0)]
        rows += [dict(sampler="threshold", threshold=t) for t in (0.999, 0.99, 0.9, 0.5, 0.3, 0.1)]
        rows += [dict(sampler="entropy_bound", entropy_bound=5.0, block_size=b)
                 for b in (max(1, block // 2), 2 * block)]
        # two tokens per step in short blocks: near left-to-right order, which a small model's line completions
        # need (docs/mdlm.md: 0.90-0.93x its one-token edit similarity at 2 tokens per forward)
        rows += [dict(sampler="confidence", block_size=b, steps=b // 2) for b in (4, 8) if b < block]
    return rows


def mdlm_methods(path: str, ref_ck, max_new_tokens: int, sweep: bool = False, like=None) -> list[Method]:
    """Rows for an mdlm checkpoint, greedy, with the reference AR model's tokenizer."""
    net, ck = load_paired(path, "mdlm", ref_ck, like)
    block = ck.block_size or max_new_tokens
    methods = []
    for opts in mdlm_settings(block, sweep):
        cfg = SampleConfig(max_new_tokens=max_new_tokens, **opts)
        short = {"steps": "steps", "entropy_bound": "bound", "threshold": "thr", "block_size": "block"}  # (names)
        name = " ".join([f"mdlm {opts['sampler']}"] + [f"{short[k]}={v}" for k, v in opts.items() if k != "sampler"])
        settings = {"model": str(ck.path), "greedy": True, "block_size": cfg.block_size or ck.block_size or "whole",
                    **opts}
        methods.append(Method(name, "mdlm", net, ck, cfg, settings))
    return methods


def target_method(model, ck, max_new_tokens: int, temperature: float, seed: int = 0) -> Method:
    """The target alone (AR with its KV cache) at a temperature: what speculation is measured against."""
    cfg = SampleConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    return Method(f"target alone T={temperature:g}", "ar", model, ck, cfg,
                  {"model": str(ck.path), "temperature": temperature, "spec_base": True})


def joint_methods(path: str, ref_ck, max_new_tokens: int, blocks: tuple[int, ...],
                  like=None) -> tuple[Method, list[Method]]:
    """A joint checkpoint's AR mode (the baseline its self-speculation must reproduce) and one row per
    self-speculation mode and block size, greedy."""
    from dlm.sampling.joint import SELF_SPEC

    net, ck = load_paired(path, "joint", ref_ck, like)
    cfg = SampleConfig(max_new_tokens=max_new_tokens)
    base = Method("joint ar mode", "ar", net, ck, cfg.replace(sampler="ar"),
                  {"model": str(ck.path), "sampler": "ar", "greedy": True, "spec_base": True})
    rows = [Method(f"joint {mode} B={b}", "spec", net, ck, cfg.replace(sampler=mode, block_size=b),
                   {"model": str(ck.path), "sampler": mode, "gamma": b, "block_size": b, "temperature": 0.0})
            for mode in SELF_SPEC for b in blocks]
    return base, rows


def spec_methods(model, ck, drafts: list[str], max_new_tokens: int, temperature: float,
                 block_size: int | None = None, seed: int = 0) -> list[Method]:
    """One row per drafter ('lookup' or a drafter checkpoint), in the lossless speculative loop."""
    from dlm.drafters import load_drafter
    from dlm.sampling.speculative import Sampling, resolve_block_size

    methods, seen = [], set()
    for given in drafts:
        spec, passes, top_k, branches = split_spec(given)
        drafter = load_drafter(spec, model, ck, Sampling(temperature), passes=passes, top_k=top_k)
        g = resolve_block_size(drafter, block_size)
        cfg = SampleConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, block_size=g,
                           draft_passes=passes, draft_top_k=top_k, draft_branches=branches)
        name = (drafter.name + (f", {passes} passes" if passes > 1 else "") + (f", top {top_k}" if top_k else "")
                + (f", {branches} branches" if branches > 1 else ""))
        name = name if name not in seen else f"{name} [{spec}]"  # two folders, one name
        seen.add(name)
        methods.append(Method(f"{name} T={temperature:g}", "spec", model, ck, cfg,
                              {"draft": spec, "gamma": g, "temperature": temperature, "draft_passes": passes,
                               "draft_top_k": top_k, "draft_branches": branches},
                              drafter=drafter))
    return methods


def split_spec(spec: str) -> tuple[str, int, int | None, int]:
    """'FOLDER@N' -> (FOLDER, N draft passes, None, 1); 'FOLDER@topK' -> (FOLDER, 1, K candidates per slot: a DFlash 2
    drafter's --draft-top-k, 1); 'FOLDER@xW', 'FOLDER@topKxW' -> ... W branches (--draft-branches); any other spec
    drafts one path in one pass with the drafter's own candidates."""
    head, at, tail = spec.rpartition("@")
    if not at:
        return spec, 1, None, 1
    if tail.isdigit():
        return head, int(tail), None, 1
    m = re.fullmatch(r"(?:top(\d+))?(?:x(\d+))?", tail)
    if m and tail:
        return head, 1, int(m[1]) if m[1] else None, int(m[2]) if m[2] else 1
    return spec, 1, None, 1


def build_methods(net, ck, max_new_tokens: int, naive: bool, mdlm: str | None, usdm: str | None, sweep: bool,
                  draft: list[str] | None, temperatures: tuple[float, ...], block_size: int | None,
                  joint: str | None = None, joint_blocks: tuple[int, ...] = (16,)):
    """Every row of a bench run; the speculative groups as (temperature, baseline, drafter rows)."""
    methods = ar_methods(net, ck, max_new_tokens, naive=naive)
    if mdlm:
        methods += mdlm_methods(mdlm, ck, max_new_tokens, sweep, like=net)
    if usdm:
        methods += usdm_methods(usdm, ck, max_new_tokens, sweep, like=net)
    spec_groups: list[tuple[float, Method, list[Method]]] = []
    for t in (temperatures if draft else ()):
        base = methods[0] if t == 0 else target_method(net, ck, max_new_tokens, t)
        group = spec_methods(net, ck, list(draft), max_new_tokens, t, block_size)
        spec_groups.append((t, base, group))
        methods += ([] if t == 0 else [base]) + group
    if joint:  # self-speculation: measured against the joint model's own AR mode
        base, group = joint_methods(joint, ck, max_new_tokens, joint_blocks, like=net)
        spec_groups.append((0.0, base, group))
        methods += [base] + group
    return methods, spec_groups


INFILL_NEW_TOKENS = 64  # the infill column's cap: one removed line needs ~10 tokens, and a window must hold both sides


def infill_method(m: Method) -> Method:
    """The method as the infill column runs it: at most INFILL_NEW_TOKENS new tokens (a long completion run,
    e.g. 256 tokens, would leave no room in the window for the hole's prefix and suffix)."""
    if m.cfg.max_new_tokens <= INFILL_NEW_TOKENS:
        return m
    return replace(m, cfg=m.cfg.replace(max_new_tokens=INFILL_NEW_TOKENS))


def bench_items(task: str | None, data: str | None, n: int, span: str) -> tuple[list[Item], list[Item]]:
    """The timed items (completion cases, or --task's) and the infill cases run alongside (none with --task)."""
    from dlm.tasks import complete, infill, task_module

    if task:
        mod = task_module(task)
        return [Item(mod, c) for c in mod.cases(data, n, 0, span)], []
    return ([Item(complete, c) for c in complete.cases(data, n, 0)],
            [Item(infill, c) for c in infill.cases(data, n, 0, "line")])
