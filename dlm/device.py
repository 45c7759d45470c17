"""Where a model runs: the --device option of every command."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dlm.errors import DlmError, check

if TYPE_CHECKING:
    import torch


def check_device_name(name: str) -> None:
    """--device's spelling, checked before torch is imported."""
    index = name.partition(":")[2]
    check(name in ("auto", "cpu", "cuda") or (name.startswith("cuda:") and index.isdigit() and index.isascii()),
          f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")


def resolve_device(name: str) -> torch.device:
    """--device: auto (CUDA when there is one), cpu, cuda or cuda:N."""
    import torch

    check_device_name(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    index = name.partition(":")[2]
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DlmError(f"--device {name}: no CUDA device is available")
    if index and int(index) >= torch.cuda.device_count():
        raise DlmError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices (cuda:0 .. "
                       f"cuda:{torch.cuda.device_count() - 1})")
    return torch.device(name)
