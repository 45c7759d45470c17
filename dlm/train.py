"""One training loop for every objective.

AdamW, linear warmup + cosine decay, gradient clipping, gradient accumulation, bf16 autocast and
optional torch.compile on GPU, activation checkpointing, periodic validation, a rich progress bar,
metrics.jsonl, atomic checkpoints and an exact --resume: the data order and every random draw depend
only on (seed, step), and model + optimizer state are restored from safetensors, so the losses after a
resume equal an uninterrupted run's. Under torchrun the same loop runs data-parallel (DDP, or FSDP2
with --fsdp; dlm.parallel), and its losses equal one process's on the same global batch.

A run folder belongs to one process at a time (`RunLock`); every option is checked before anything
is written, so a refused run leaves the folder as it found it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from dlm.checkpoint import SIDE_FILES, load_weights, open_checkpoint, recorded_tokenizer, save_checkpoint
from dlm.trainstate import find_state, restore_optimizer, save_state
from dlm.files import read_json, read_tensors
from dlm.device import resolve_device
from dlm.config import TrainConfig
from dlm.data.corpus import Corpus
from dlm.data.tokens import Batches, PairedBatches, load_flags, load_tokens
from dlm.errors import DlmError
from dlm.objectives import Objective, make_objective, objective_class
from dlm.parallel import (
    Dist, check_world, full_optimizer_state, full_state, grad_sync, scalar, shard_optimizer_state, wrap,
)
from dlm.tokenizer import Tokenizer

# options a resumed run may change: the rest define the run and must match what was saved (how a step is computed
# may change: precision, sharding, accumulation and recomputation leave its batch and its random draws as they were)
RESUMABLE = {"max_steps", "eval_every", "eval_batches", "save_every", "log_every", "device", "compile", "dtype",
             "grad_accum", "fsdp", "activation_checkpointing"}


def lr_at(cfg: TrainConfig, step: int) -> float:
    warm = int(cfg.warmup * cfg.max_steps) if cfg.warmup < 1 else int(cfg.warmup)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = (step - warm) / max(1, cfg.max_steps - warm)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


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
        if (out / "config.json").is_file():  # with the EOS ids it records
            return recorded_tokenizer(out, read_json(out / "config.json"))
        return Tokenizer.from_file(out / "tokenizer.json")
    if cfg.tokenizer == "char":  # (a file named char: --tokenizer ./char)
        return Tokenizer.train_chars(corpus.texts("train"))
    if cfg.tokenizer:
        path = Path(cfg.tokenizer)
        if not path.exists():
            raise DlmError(f"--tokenizer {cfg.tokenizer}: no such file or checkpoint folder (or 'char')")
        return Tokenizer.from_file(path / "tokenizer.json" if path.is_dir() else path)
    for option, source in (("--init-from", cfg.init_from), ("--target", cfg.target)):
        if source:
            return open_checkpoint(source, option).tokenizer
    return Tokenizer.train(corpus.texts("train"), vocab_size=cfg.vocab_size)


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """--dtype: the autocast precision (None: fp32). auto = bf16 on a CUDA device that has it."""
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if cfg.dtype == "bf16" and device.type == "cuda" and not cuda_bf16:
        raise DlmError(f"--dtype bf16: {torch.cuda.get_device_name(device)} has no bf16; use --dtype fp32")
    if cfg.dtype == "bf16" or (cfg.dtype == "auto" and cuda_bf16):
        return torch.bfloat16
    return None


@torch.no_grad()
def validate(step_module: nn.Module, val: Batches | PairedBatches, cfg: TrainConfig, device: torch.device, autocast: Any,
             par: Dist) -> float:
    """Mean loss of the first eval_batches validation batches; each process computes its share of a batch."""
    step_module.eval()
    losses = []
    for i, (batch, sup) in enumerate(val.sequential(cfg.eval_batches, sup=True)):
        n = batch.shape[0]
        rows = par.even_rows(n)
        weight = (rows.stop - rows.start) / n  # this process's part of the batch loss
        if weight == 0:  # fewer rows than processes: compute row 0 for nothing, to keep FSDP's gathers in step
            rows = slice(0, 1)
        with autocast():
            loss, _ = step_module(batch.to(device), step_generator(device, cfg.seed + 1, i), rows,
                                  None if sup is None else sup.to(device))
        losses.append(scalar(loss.detach()) * weight)
    step_module.train()
    return sum(par.sum(losses, device)) / len(losses)


# the run folder -----------------------------------------------------------------------------------

class RunLock:
    """OUT/.lock holds the pid of the process training into OUT; a lock whose process is gone is stale."""

    def __init__(self, out: Path):
        self.path = out / ".lock"
        self.held = False

    def acquire(self) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if self._alive():
                    raise DlmError(f"--out {self.path.parent}: another training (pid {self._pid()}) is writing "
                                   "this folder; wait for it or choose another folder") from None
                self.path.unlink(missing_ok=True)  # stale: its process is gone
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(str(os.getpid()))
            self.held = True
            return
        raise DlmError(f"--out {self.path.parent}: could not take the run lock {self.path}")

    def _pid(self) -> int | None:
        try:
            return int(self.path.read_text().strip() or 0) or None
        except (OSError, ValueError):
            return None

    def _alive(self) -> bool:
        pid = self._pid()
        if pid is None or pid == os.getpid():
            return pid == os.getpid()
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def remove_stale_temps(out: Path) -> None:
    """Temporary files of writes a killed process left behind (each as big as what it was writing).
    Called with the run lock held, before this run writes anything: every one of them is stale."""
    for p in [*out.glob(".*.tmp"), *out.glob("state.tmp"), *out.glob("state/.*.tmp")]:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


class MetricsLog:
    """metrics.jsonl: one JSON object per logged step; on resume, rows past the resumed step (and a line
    torn by a crash) are dropped."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is not None and path.exists():
            keep = []
            for ln in path.read_text(errors="replace").splitlines():
                try:
                    row = json.loads(ln)
                except json.JSONDecodeError:
                    continue  # the last line of a killed run may be cut short
                if isinstance(row, dict) and row.get("step", 0) <= resume_step:
                    keep.append(ln)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text("".join(ln + "\n" for ln in keep))
            os.replace(tmp, path)
        elif path.exists():
            path.unlink()

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
            fh.flush()


def resumed_config(saved: TrainConfig, given: TrainConfig, explicit: set[str]) -> TrainConfig:
    """The saved run's config with the options the user changed on purpose: those a resume can apply
    (max_steps, logging, device) are applied; any other change is refused, naming the options."""
    conflicts = [f.name for f in dataclasses.fields(TrainConfig)
                 if f.name in explicit and f.name not in RESUMABLE
                 and getattr(given, f.name) != getattr(saved, f.name)]
    if conflicts:
        detail = ", ".join(f"--{n.replace('_', '-')} {getattr(given, n)!r} (saved: {getattr(saved, n)!r})"
                           for n in conflicts)
        raise DlmError(f"--resume continues the saved run; these options differ from it: {detail}. "
                       "Drop them, or start a new run in another folder")
    return dataclasses.replace(saved, **{n: getattr(given, n) for n in RESUMABLE if n in explicit})


@dataclass
class Run:
    """Everything a training run needs, built and checked before the first byte is written."""

    cfg: TrainConfig
    out: Path
    state_dir: Path | None
    start_step: int
    device: torch.device
    tok: Tokenizer
    objective: Objective
    model: nn.Module
    train_batches: Batches | PairedBatches
    val_batches: Batches | PairedBatches


def prepare(cfg: TrainConfig, out: Path, resume: bool, explicit: set[str] | None, par: Dist = Dist(),
            say: Callable[[str], None] = lambda step: None) -> Run:
    """Check the options, resolve the resumed state, build tokenizer, objective, model and data. say(step): what it
    is doing now (the first run on a corpus trains a tokenizer and tokenizes it: a minute or two)."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise DlmError(f"--out {out}: exists and is not a folder")
    state_dir = find_state(out) if resume and out.is_dir() else None
    if resume and state_dir is None and (out / "config.json").exists():
        raise DlmError(f"--resume: {out} holds a checkpoint but no training state (state/) to resume from")
    if state_dir is None and out.exists() and any(p.name != ".lock" for p in out.iterdir()):
        hint = "pass --resume to continue it or " if not resume else ""
        raise DlmError(f"--out {out} exists and is not empty; {hint}choose another folder")
    start_step = 0
    if state_dir is not None:
        trainer = read_json(state_dir / "trainer.json")
        saved = TrainConfig.from_dict(trainer["config"])
        if explicit is None:  # a library call: the saved run, extended when asked for more steps
            explicit = {"max_steps"} if cfg.max_steps > saved.max_steps else set()
        cfg = resumed_config(saved, cfg, explicit)
        start_step = int(trainer["step"])
    cfg.validate()
    cfg = cfg.resolved()
    objective_class(cfg.objective).check_config(cfg)
    check_world(cfg.batch_size, cfg.grad_accum, par.world)
    device = par.device(resolve_device(cfg.device), cfg.device)
    autocast_dtype(cfg, device)
    torch.manual_seed(cfg.seed)
    say(f"reading the corpus ({cfg.data})")
    corpus = Corpus(cfg.data)
    trains = state_dir is None and not cfg.tokenizer and not cfg.init_from and not cfg.target
    say(f"training a byte-level BPE tokenizer ({cfg.vocab_size} tokens) on the corpus" if trains else
        "loading the tokenizer")
    tok = resolve_tokenizer(cfg, corpus, out, resuming=state_dir is not None)
    say("building the model" + (f" (from {cfg.init_from})" if cfg.init_from else ""))
    objective = make_objective(cfg, tok)
    model = objective.build_model().to(device)
    if cfg.freeze_router:
        routers = [p for n, p in model.named_parameters() if ".router." in n or ".mlp.gate." in n]  # gemma4, dlm.moe
        if not routers:
            raise DlmError("--freeze-router: this model has no mixture-of-experts router")
        for p in routers:
            p.requires_grad_(False)
    if cfg.lora_rank:
        from dlm.lora import add_lora

        targets = tuple(t.strip() for t in cfg.lora_targets.split(",") if t.strip())
        add_lora(model, cfg.lora_rank, cfg.lora_alpha or 2.0 * cfg.lora_rank, targets)
    fim = cfg.fim_rate or 0.0

    def flags(split: str, fim: float = 0.0):  # a prompted corpus: the losses read responses only
        return None if cfg.prompt_loss else load_flags(corpus, tok, split, fim, cfg.seed)

    say("tokenizing the corpus (once per corpus and tokenizer: cached)")
    train_batches = Batches(load_tokens(corpus, tok, "train", fim, cfg.seed), cfg.seq_len, cfg.batch_size, cfg.seed,
                            flags("train", fim), f"--data {cfg.data}, its train split")
    val_batches = Batches(load_tokens(corpus, tok, "val"), cfg.seq_len, cfg.batch_size, cfg.seed, flags("val"),
                          f"--data {cfg.data}, its val split")
    if cfg.dlm_data is not None:  # joint: the diffusion loss reads a corpus of its own, side by side
        second = Corpus(cfg.dlm_data)

        def second_flags(split: str):
            return None if cfg.prompt_loss else load_flags(second, tok, split)

        def stream(split: str) -> Batches:
            try:
                return Batches(load_tokens(second, tok, split), cfg.seq_len, cfg.batch_size, cfg.seed + 1,
                               second_flags(split))
            except DlmError as e:
                raise DlmError(f"--dlm-data {cfg.dlm_data}, {split} split: {e}") from None

        train_batches = PairedBatches(train_batches, stream("train"))
        val_batches = PairedBatches(val_batches, stream("val"))
    return Run(cfg, out, state_dir, start_step, device, tok, objective, model, train_batches, val_batches)


def make_progress(objective: str, quiet: bool):
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    # loss, val and tok/s are text: "–" until the first figure exists (a NaN would read as a diverged run)
    return Progress(
        TextColumn(f"[bold]{objective}[/] step {{task.completed}}/{{task.total}}"), BarColumn(),
        TextColumn("loss {task.fields[loss]}  val {task.fields[val]}  {task.fields[tps]} tok/s"),
        TimeRemainingColumn(),
        disable=quiet,
    )


@contextlib.contextmanager
def status(quiet: bool) -> Iterator[Callable[[str], None]]:
    """A spinner that names the step under way, until the progress bar takes over; say(text) changes it. (Not on a
    terminal: nothing, so that an error stays the one line on stderr.)"""
    from rich.console import Console

    con = Console(stderr=True)
    if quiet or not con.is_interactive:
        yield lambda text: None
        return
    with con.status("[bold]train[/] starting") as spinner:
        yield lambda text: spinner.update(f"[bold]train[/] {text}")


def train(cfg: TrainConfig, out: str | os.PathLike, resume: bool = False, quiet: bool = False,
          explicit: set[str] | None = None) -> Path:
    """Train cfg.objective into the checkpoint folder `out`; return it.

    explicit: the options the user gave (on --resume, those may not contradict the saved run);
    None = the saved run's options, with cfg.max_steps when it is larger (extending a run).
    Under torchrun every process calls this; rank 0 owns the folder.
    """
    out = Path(out)
    par = Dist.from_env()
    if cfg.fsdp and not par.launched:
        raise DlmError("--fsdp shards the model over the processes that torchrun starts: "
                       "torchrun --standalone --nproc-per-node N -m dlm train ... --fsdp")
    with par.session(par.device(resolve_device(cfg.device), cfg.device)):
        if par.main:
            return _train_main(cfg, out, resume, quiet, explicit, par)
        par.barrier()  # rank 0 holds the run lock and has checked the options
        run = prepare(cfg, out, resume, explicit, par)
        par.barrier()  # every process has read the folder before rank 0 writes to it
        _loop(run, True, par)
        return out


def _train_main(cfg: TrainConfig, out: Path, resume: bool, quiet: bool, explicit: set[str] | None,
                par: Dist) -> Path:
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise DlmError(f"--out {out}: exists and is not a folder")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DlmError(f"--out {out}: cannot create it ({e.strerror})") from None
    lock = RunLock(out)
    fresh = False
    try:
        lock.acquire()
        with status(quiet) as say:
            run = prepare(cfg, out, resume, explicit, par, say)
        par.barrier()
        par.barrier()
        remove_stale_temps(out)
        fresh = run.state_dir is None
        if fresh:
            run.tok.save(out / "tokenizer.json")
            if cfg.init_from and Path(cfg.init_from).is_dir():  # an imported model's chat template, EOS ids, ...
                for name in SIDE_FILES:
                    if (Path(cfg.init_from) / name).is_file():
                        shutil.copyfile(Path(cfg.init_from) / name, out / name)
                copy_remote_code(Path(cfg.init_from), out)
        _loop(run, quiet, par)
    except BaseException:
        if fresh and find_state(out) is None:  # a new run that failed before its first checkpoint: nothing to resume
            for name in ("tokenizer.json", "metrics.jsonl", "config.json", "model.safetensors"):
                (out / name).unlink(missing_ok=True)
            remove_stale_temps(out)
        raise
    finally:
        lock.release()
        if created and out.is_dir() and not any(out.iterdir()):  # a refused or failed run leaves nothing behind
            out.rmdir()
    return out


def copy_remote_code(src: Path, out: Path) -> None:
    """An imported model's remote code (kept beside its checkpoint by the import) travels into the fine-tuned
    checkpoint, so that its export is a folder the authors' code loads."""
    from dlm.hf_layout import remote_code

    hf = read_json(src / "config.json").get("hf_config") if (src / "config.json").is_file() else None
    for name in remote_code(src, hf) if isinstance(hf, dict) else []:
        shutil.copyfile(src / name, out / name)


def _loop(run: Run, quiet: bool, par: Dist = Dist()) -> None:
    cfg, model, objective, device, out = run.cfg, run.model, run.objective, run.device, run.out
    if run.state_dir is not None:  # the full weights, before FSDP shards them
        sd = run.state_dir
        load_weights(model, read_tensors(sd / "model.safetensors"), sd / "model.safetensors")
    if cfg.activation_checkpointing:
        for layer in model.layers:
            layer.checkpointing = True
    step_module = wrap(model, objective, par, device, cfg.fsdp, cfg.compile and device.type == "cuda")
    params = objective.trainable(model)  # after wrap: FSDP replaces the parameters by their shards
    opt = make_optimizer(params, cfg, fused=device.type == "cuda" and not cfg.fsdp)
    if run.state_dir is not None:
        restore_optimizer(opt, read_tensors(sd / "optimizer.safetensors"), read_json(sd / "optimizer.json"))
        if cfg.fsdp:
            shard_optimizer_state(opt)
    amp = autocast_dtype(cfg, device)

    def autocast():
        return torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None)

    log = MetricsLog(out / "metrics.jsonl", run.start_step if run.state_dir is not None else None) if par.main else None
    n_params = sum(p.numel() for p in params)
    # an imported model's transformers config travels on: the export of the fine-tuned model writes it back
    source = open_checkpoint(cfg.init_from, "--init-from").config if cfg.init_from else {}
    inherited = {k: source[k] for k in ("hf_config",) if k in source}

    def checkpoint(step: int) -> None:
        weights = full_state(model) if cfg.fsdp else model  # FSDP: every process takes part in the gathers
        opt_state = full_optimizer_state(opt) if cfg.fsdp else opt
        if not par.main:
            return
        mc = getattr(model, "cfg", None)
        meta = {"objective": cfg.objective, "model": mc.to_dict() if mc is not None else {},
                "train": cfg.to_dict(), "data": cfg.data, "step": step, "params": n_params, **objective.meta(),
                **inherited}
        save_state(out, weights, opt_state, {"step": step, "config": cfg.to_dict()})
        if cfg.lora_rank:  # the checkpoint: adapters merged, under the plain model's names
            from dlm.lora import merged_state

            weights = merged_state(model)
            meta.update(params=sum(t.numel() for t in weights.values()),
                        lora={"rank": cfg.lora_rank, "alpha": cfg.lora_alpha or 2.0 * cfg.lora_rank,
                              "targets": cfg.lora_targets, "trainable_params": n_params})
        save_checkpoint(out, weights, run.tok, meta)

    step_fn = _step_function(cfg, step_module, params, opt, device, autocast, par)
    step_module.train()
    tokens_per_step = cfg.batch_size * cfg.seq_len
    t_log, steps_since, loss_acc = time.perf_counter(), 0, 0.0
    progress = make_progress(cfg.objective, quiet or not par.main)
    with progress:
        task = progress.add_task("train", total=cfg.max_steps, completed=run.start_step, loss="–", val="–", tps="–")
        for step in range(run.start_step, cfg.max_steps):
            batch, sup = run.train_batches.batch_sup(step)
            objective.step = step
            loss, gnorm, lr, extra = step_fn(step, batch.to(device, non_blocking=True),
                                             None if sup is None else sup.to(device, non_blocking=True))
            loss_acc += loss
            steps_since += 1
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.max_steps:
                dt = time.perf_counter() - t_log
                tps = steps_since * tokens_per_step / max(dt, 1e-9)
                row = {"step": done, "loss": loss_acc / steps_since, "lr": lr, "tokens_per_second": tps,
                       "grad_norm": gnorm, **extra}
                if log is not None:
                    log.write(row)
                progress.update(task, loss=f"{row['loss']:.4f}", tps=f"{tps:,.0f}")
                t_log, steps_since, loss_acc = time.perf_counter(), 0, 0.0
            if done % cfg.eval_every == 0 or done == cfg.max_steps:
                val = validate(step_module, run.val_batches, cfg, device, autocast, par)
                if log is not None:
                    log.write({"step": done, "val_loss": val})
                progress.update(task, val=f"{val:.4f}")
                t_log = time.perf_counter()
            if done % cfg.save_every == 0 or done == cfg.max_steps:
                checkpoint(done)
                t_log = time.perf_counter()
            progress.update(task, completed=done)
    if run.start_step >= cfg.max_steps:  # nothing left to do; make sure the folder is a checkpoint
        checkpoint(run.start_step)


def _step_function(cfg: TrainConfig, step_module: nn.Module, params: list[nn.Parameter], opt: torch.optim.Optimizer,
                   device: torch.device, autocast: Callable,
                   par: Dist) -> Callable[..., tuple[float, float, float, dict]]:
    """One optimizer step: (step, global batch, its response flags or None) -> (loss, grad norm, lr, the
    objective's extra metrics), each the whole batch's: this process's micro-batches are summed here, the
    processes' sums added by one all-reduce."""
    slices = par.micro_rows(cfg.batch_size, cfg.grad_accum)
    parts = len(slices) * par.world  # equal slices of the global batch: its loss is their mean

    def step_fn(step: int, batch: torch.Tensor, sup: torch.Tensor | None = None):
        lr = lr_at(cfg, step)
        for g in opt.param_groups:
            g["lr"] = lr
        totals: dict[str, float] = {}
        for k, rows in enumerate(slices):
            with grad_sync(step_module, k == len(slices) - 1):
                with autocast():  # every slice draws the whole batch's noise from the step's generator
                    loss, extra = step_module(batch, step_generator(device, cfg.seed, step), rows, sup)
                (loss / len(slices)).backward()
            for name, v in {"loss": float(loss.detach()), **extra}.items():
                totals[name] = totals.get(name, 0.0) + float(v)
        means = dict(zip(totals, (v / parts for v in par.sum(list(totals.values()), device))))
        loss = means.pop("loss")
        if not math.isfinite(loss):
            raise DlmError(f"loss became {loss} at step {step + 1}; lower --lr or check the data")
        gnorm = scalar(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)) if cfg.grad_clip > 0 else 0.0
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss, gnorm, lr, means

    return step_fn
