"""Data-parallel training under torchrun: DDP by default, FSDP2 with --fsdp; gloo on CPU, NCCL on CUDA.

    torchrun --standalone --nproc-per-node 8 -m dlm train --objective ar --preset base ...

torchrun starts one process per device and sets RANK, WORLD_SIZE and LOCAL_RANK (and the rendezvous);
`Dist.from_env` reads them and `Dist.session` joins the process group. Every process reads the whole
global batch of a step (a function of (seed, step) only) and computes its own rows: process r of W
takes the r-th of W equal contiguous slices, and --grad-accum K cuts that into K micro-batches. The
objectives draw their noise for the whole batch and normalise over it (dlm.objectives.base), so the
gradient that DDP averages (or FSDP reduce-scatters) is the one-process gradient of the same batch,
and a run's losses do not depend on how many processes computed them.

What is computed where:
  DDP    every process holds the model and the optimizer; gradients are averaged in buckets during
         the backward pass (PyTorch's DistributedDataParallel).
  FSDP   every decoder layer, and the rest of the model as one unit, is sharded over the processes
         (torch.distributed.fsdp.fully_shard): parameters, gradients and optimizer state are DTensors,
         each process keeps 1/W of them and gathers a layer's full weights only while it runs.
Rank 0 writes metrics and checkpoints; under FSDP the full state is gathered first, so a checkpoint is
the same safetensors folder one process writes. The DFlash target is frozen and replicated (it lives
in the objective, outside the wrapped module).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dlm.errors import DlmError


@dataclass(frozen=True)
class Dist:
    """This process's place in the run: rank of world (one process: 0 of 1, not launched)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    launched: bool = False  # started by torchrun (the environment names the process group)

    @classmethod
    def from_env(cls) -> Dist:
        if "WORLD_SIZE" not in os.environ:
            return cls()
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            local = int(os.environ.get("LOCAL_RANK", rank))
        except (KeyError, ValueError):
            raise DlmError("WORLD_SIZE is set but RANK/LOCAL_RANK are missing or not integers: launch data-parallel "
                           "training with torchrun (torchrun --nproc-per-node N -m dlm train ...)") from None
        return cls(rank, world, local, launched=True)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self, device: torch.device, option: str) -> torch.device:
        """The device of this process: cuda:LOCAL_RANK under torchrun with CUDA."""
        if not self.launched or device.type != "cuda":
            return device
        if device.index is not None and option not in ("auto", "cuda"):
            raise DlmError(f"--device {option}: under torchrun each process takes the GPU of its local rank; "
                           "pass --device cuda (or auto), and choose the GPUs with CUDA_VISIBLE_DEVICES")
        if self.local_rank >= torch.cuda.device_count():
            raise DlmError(f"local rank {self.local_rank} has no GPU ({torch.cuda.device_count()} visible): "
                           "start at most as many processes per node as there are GPUs")
        return torch.device("cuda", self.local_rank)

    @contextlib.contextmanager
    def session(self, device: torch.device) -> Iterator[None]:
        """Join the process group for the duration of a run (NCCL on CUDA, gloo on CPU), then leave it."""
        if not self.launched or dist.is_initialized():
            yield
            return
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # NCCL for CUDA tensors, gloo for CPU ones (a resumed run may keep the saved run's --device cpu)
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
        try:
            yield
            # leave together: a rank that tears the group down while its peer still talks to it (rank 0 hosts the
            # store) could abort the peer ("terminate called without an active exception" under gloo on a busy CPU)
            dist.barrier()
        finally:
            dist.destroy_process_group()

    def barrier(self) -> None:
        if self.launched:
            dist.barrier()

    def micro_rows(self, batch_size: int, accum: int) -> list[slice]:
        """This process's rows of a global batch, as `accum` equal micro-batches (rank-major contiguous slices)."""
        n = batch_size // (self.world * accum)
        start = self.rank * accum * n
        return [slice(start + k * n, start + (k + 1) * n) for k in range(accum)]

    def even_rows(self, n: int) -> slice:
        """This process's share of n rows when n need not divide evenly (evaluation's last batch); may be empty."""
        return slice(self.rank * n // self.world, (self.rank + 1) * n // self.world)

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        """The sum of each value over the processes (one all-reduce)."""
        if not self.launched:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()


def check_world(batch_size: int, accum: int, world: int) -> None:
    if batch_size % (world * accum):
        raise DlmError(f"--batch-size {batch_size} must be a multiple of the number of processes ({world}) times "
                       f"--grad-accum ({accum}): each process computes equal slices of the global batch")


class Step(nn.Module):
    """The objective's loss as one module: what DDP and FSDP wrap, so that their hooks see one forward per
    micro-batch. forward(batch, gen, rows, sup) -> (loss, extra metrics) of the rows `rows` of the global batch
    (sup: the batch's response flags, or None)."""

    def __init__(self, model: nn.Module, objective):
        super().__init__()
        self.model = model
        self.objective = objective  # not a module: the DFlash target stays outside the wrapped parameters

    def forward(self, batch: Tensor, gen: torch.Generator, rows: slice,
                sup: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        return self.objective.loss(self.model, batch, gen, rows, sup)


def wrap(model: nn.Module, objective, par: Dist, device: torch.device, fsdp: bool, compile: bool) -> nn.Module:
    """The training module of this process: Step over the (compiled) model, under DDP or FSDP when launched."""
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (par.world,))
        for layer in model.layers:  # one unit per decoder layer: gathered while it runs, resharded after
            fully_shard(layer, mesh=mesh)
    step = Step(torch.compile(model) if compile else model, objective)
    if fsdp:
        fully_shard(step, mesh=mesh)  # embeddings, final norm, head (and the drafter's fc) as the root unit
        return step
    if par.launched:
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(step, device_ids=[device.index] if device.type == "cuda" else None,
                   find_unused_parameters=not objective.uses_every_param)
    return step


@contextlib.contextmanager
def grad_sync(module: nn.Module, sync: bool) -> Iterator[None]:
    """Reduce gradients across processes in this backward pass only when `sync` (the last micro-batch)."""
    if sync:
        yield
    elif hasattr(module, "no_sync"):  # DDP
        with module.no_sync():
            yield
    elif hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


def _full(t: Tensor) -> Tensor:
    """A DTensor's full value (a collective: every process calls it, in the same order); a tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def scalar(t: Tensor) -> float:
    return float(_full(t))


def full_state(model: nn.Module) -> dict[str, Tensor]:
    """The model's full weights on every process (gathered from the shards under FSDP); a tied tensor stays
    one tensor under both names."""
    out: dict[str, Tensor] = {}
    seen: dict[int, Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen[id(t)] = _full(t.detach()).cpu()
        out[name] = seen[id(t)]
    return out


def full_optimizer_state(opt: torch.optim.Optimizer) -> dict:
    """opt.state_dict() with every sharded state tensor gathered (the layout one process saves)."""
    sd = opt.state_dict()
    sd["state"] = {i: {k: _full(v) if torch.is_tensor(v) else v for k, v in st.items()}
                   for i, st in sd["state"].items()}
    return sd


def shard_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """After a full optimizer state was loaded into an optimizer of FSDP parameters: shard each state tensor
    the way its parameter is sharded."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for group in opt.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            for k, v in opt.state.get(p, {}).items():
                if torch.is_tensor(v) and not isinstance(v, DTensor) and v.shape == p.shape:
                    opt.state[p][k] = distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
