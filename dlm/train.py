"""One training loop for every objective.

AdamW, linear warmup + cosine decay, gradient clipping, bf16 autocast and optional torch.compile
on GPU, periodic validation, a rich progress bar, metrics.jsonl, atomic checkpoints and an exact
--resume: the data order and every random draw depend only on (seed, step), and model + optimizer
state are restored from safetensors, so the losses after a resume equal an uninterrupted run's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlm.checkpoint import (
    find_state, read_json, read_tensors, load_weights, restore_optimizer, save_checkpoint, save_state,
)
from dlm.data.corpus import Corpus
from dlm.data.tokens import Batches, load_tokens
from dlm.errors import DlmError, check
from dlm.objectives import Objective, make_objective
from dlm.tokenizer import Tokenizer


@dataclass
class TrainConfig:
    objective: str = "ar"
    preset: str = "tiny"
    data: str = "stdlib"
    tokenizer: str | None = None  # a tokenizer.json or a checkpoint folder; default: train one on the corpus
    vocab_size: int = 4096  # when training a tokenizer
    seq_len: int = 256
    batch_size: int = 16
    max_steps: int = 1000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup: float = 0.04  # < 1: fraction of max_steps; >= 1: steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 250
    log_every: int = 10
    seed: int = 0
    device: str = "auto"
    compile: bool = False
    init_from: str | None = None  # start from this checkpoint's weights (e.g. diffusion from AR)
    # masked / block diffusion (mdlm)
    block_length: int = 0  # 0: whole-sequence diffusion; B: block diffusion with blocks of B tokens
    # uniform-state diffusion (usdm)
    canvas_length: int = 256
    loss_weight: str = "constant"  # usdm canvas loss: "constant" (1) or "inverse" (1 / (1 - t))
    self_cond_prob: float = 0.5
    # DFlash drafter (dflash)
    target: str | None = None
    block_size: int = 16
    draft_layers: int = 0  # 0: the objective's default
    anchors: int = 0  # blocks per sequence; 0: the objective's default
    target_layers: list[int] = dataclasses.field(default_factory=list)  # target layer ids; []: the objective's default
    injection: str = "kv"  # dflash ablation: "kv" (context K/V in every layer) or "input" (context as input tokens)
    target_features: bool = True  # dflash ablation: False = context from token embeddings, not target hidden states

    def validate(self) -> None:
        from dlm.objectives import REGISTRY

        check(self.objective in REGISTRY, f"--objective must be one of {sorted(REGISTRY)}, got {self.objective!r}")
        from dlm.config import PRESETS

        check(self.preset in PRESETS, f"--preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        for f in ("seq_len", "batch_size", "max_steps", "eval_batches", "eval_every", "save_every", "log_every"):
            check(getattr(self, f) > 0, f"--{f.replace('_', '-')} must be > 0, got {getattr(self, f)}")
        check(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        check(0 <= self.min_lr_ratio <= 1, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        check(self.warmup >= 0, f"--warmup must be >= 0, got {self.warmup}")
        check(self.grad_clip >= 0, f"--grad-clip must be >= 0, got {self.grad_clip}")
        check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
              f"--device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.objective == "usdm":
            check(0 < self.canvas_length <= self.seq_len,
                  f"--canvas-length must be in [1, --seq-len {self.seq_len}] (a prefix precedes the canvas), "
                  f"got {self.canvas_length}")
            check(self.loss_weight in ("constant", "inverse"),
                  f"--loss-weight must be constant or inverse, got {self.loss_weight!r}")
            check(0 <= self.self_cond_prob <= 1, f"--self-cond-prob must be in [0, 1], got {self.self_cond_prob}")
        if self.objective == "dflash":
            from dlm.objectives.dflash import check_config

            check_config(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def lr_at(cfg: TrainConfig, step: int) -> float:
    warm = int(cfg.warmup * cfg.max_steps) if cfg.warmup < 1 else int(cfg.warmup)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = (step - warm) / max(1, cfg.max_steps - warm)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DlmError(f"--device {name}: no CUDA device is available")
    return torch.device(name)


def step_generator(device: torch.device, seed: int, step: int) -> torch.Generator:
    """The random stream of one training step: a function of (seed, step) only."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step * 7919 + 1) % (2**63))
    return g


def make_optimizer(params: list[nn.Parameter], cfg: TrainConfig, fused: bool) -> torch.optim.AdamW:
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused or None)


def resolve_tokenizer(cfg: TrainConfig, corpus: Corpus, out: Path, resuming: bool) -> Tokenizer:
    if resuming:
        return Tokenizer.from_file(out / "tokenizer.json")
    if cfg.tokenizer:
        return Tokenizer.from_file(cfg.tokenizer)
    if cfg.init_from:
        return Tokenizer.from_file(Path(cfg.init_from) / "tokenizer.json")
    if cfg.target:
        return Tokenizer.from_file(Path(cfg.target) / "tokenizer.json")
    return Tokenizer.train(corpus.texts("train"), vocab_size=cfg.vocab_size)


@torch.no_grad()
def validate(model: nn.Module, objective: Objective, val: Batches, cfg: TrainConfig, device: torch.device,
             autocast: Any) -> float:
    model.eval()
    losses = []
    for i, batch in enumerate(val.sequential(cfg.eval_batches)):
        with autocast():
            loss, _ = objective.loss(model, batch.to(device), step_generator(device, cfg.seed + 1, i))
        losses.append(float(loss))
    model.train()
    return sum(losses) / len(losses)


class MetricsLog:
    """metrics.jsonl: one JSON object per logged step; on resume, rows past the resumed step are dropped."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is not None and path.exists():
            keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= resume_step]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(ln + "\n" for ln in keep))
            os.replace(tmp, path)
        elif path.exists():
            path.unlink()

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
            fh.flush()


def train(cfg: TrainConfig, out: str | os.PathLike, resume: bool = False, quiet: bool = False) -> Path:
    """Train cfg.objective into the checkpoint folder `out`; return it."""
    out = Path(out)
    cfg.validate()
    state_dir = find_state(out) if resume else None
    if resume and state_dir is None and out.exists() and (out / "config.json").exists():
        raise DlmError(f"--resume: {out} holds a checkpoint but no training state (state/) to resume from")
    if state_dir is None and out.exists() and any(out.iterdir()) and not resume:
        raise DlmError(f"--out {out} exists and is not empty; pass --resume to continue it or choose another folder")
    start_step = 0
    trainer: dict[str, Any] = {}
    if state_dir is not None:
        trainer = read_json(state_dir / "trainer.json")
        saved = TrainConfig(**trainer["config"])
        if saved.max_steps != cfg.max_steps and cfg.max_steps > saved.max_steps:
            saved.max_steps = cfg.max_steps  # extending a finished run is allowed
        cfg = saved
        start_step = trainer["step"]

    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    corpus = Corpus(cfg.data)
    created = not out.exists()
    try:
        tok = resolve_tokenizer(cfg, corpus, out, resuming=state_dir is not None)
        objective = make_objective(cfg.objective, cfg, tok)
        model = objective.build_model().to(device)
        train_batches = Batches(load_tokens(corpus, tok, "train"), cfg.seq_len, cfg.batch_size, cfg.seed)
        val_batches = Batches(load_tokens(corpus, tok, "val"), cfg.seq_len, cfg.batch_size, cfg.seed)
        out.mkdir(parents=True, exist_ok=True)
        if state_dir is None:
            tok.save(out / "tokenizer.json")
    except BaseException:
        if created:  # a refused run leaves nothing behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    params = objective.trainable(model)
    opt = make_optimizer(params, cfg, fused=device.type == "cuda")
    if state_dir is not None:
        load_weights(model, read_tensors(state_dir / "model.safetensors"), state_dir / "model.safetensors")
        restore_optimizer(opt, read_tensors(state_dir / "optimizer.safetensors"), read_json(state_dir / "optimizer.json"))

    use_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)

    fwd_model = torch.compile(model) if cfg.compile and device.type == "cuda" else model
    log = MetricsLog(out / "metrics.jsonl", start_step if state_dir is not None else None)
    n_params = sum(p.numel() for p in params)

    def meta(step: int) -> dict[str, Any]:
        mc = getattr(model, "cfg", None)
        return {"objective": cfg.objective, "model": mc.to_dict() if mc is not None else {},
                "train": cfg.to_dict(), "data": cfg.data, "step": step, "params": n_params, **objective.meta()}

    def checkpoint(step: int) -> None:
        save_state(out, model, opt, {"step": step, "config": cfg.to_dict()})
        save_checkpoint(out, model, tok, meta(step))

    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn(f"[bold]{cfg.objective}[/] step {{task.completed}}/{{task.total}}"), BarColumn(),
        TextColumn("loss {task.fields[loss]:.4f}  val {task.fields[val]:.4f}  {task.fields[tps]:,.0f} tok/s"),
        TimeRemainingColumn(),
        disable=quiet,
    )
    model.train()
    tokens_per_step = cfg.batch_size * cfg.seq_len
    t_log, steps_since, loss_acc = time.perf_counter(), 0, 0.0
    with progress:
        task = progress.add_task("train", total=cfg.max_steps, completed=start_step, loss=float("nan"),
                                 val=float("nan"), tps=0.0)
        for step in range(start_step, cfg.max_steps):
            lr = lr_at(cfg, step)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = train_batches.batch(step).to(device, non_blocking=True)
            with autocast():
                loss, extra = objective.loss(fwd_model, batch, step_generator(device, cfg.seed, step))
            if not torch.isfinite(loss):
                raise DlmError(f"loss became {float(loss)} at step {step + 1}; lower --lr or check the data")
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip > 0 else torch.tensor(0.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_acc += float(loss.detach())
            steps_since += 1
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.max_steps:
                dt = time.perf_counter() - t_log
                tps = steps_since * tokens_per_step / max(dt, 1e-9)
                row = {"step": done, "loss": loss_acc / steps_since, "lr": lr, "tokens_per_second": tps,
                       "grad_norm": float(gnorm), **extra}
                log.write(row)
                progress.update(task, loss=row["loss"], tps=tps)
                t_log, steps_since, loss_acc = time.perf_counter(), 0, 0.0
            if done % cfg.eval_every == 0 or done == cfg.max_steps:
                val = validate(model, objective, val_batches, cfg, device, autocast)
                log.write({"step": done, "val_loss": val})
                progress.update(task, val=val)
                t_log = time.perf_counter()
            if done % cfg.save_every == 0 or done == cfg.max_steps:
                checkpoint(done)
                t_log = time.perf_counter()
            progress.update(task, completed=done)
    if start_step >= cfg.max_steps:  # nothing left to do; make sure the folder is a checkpoint
        checkpoint(start_step)
    return out
