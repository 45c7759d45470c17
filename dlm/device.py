"""Where a model runs: the --device option of every command."""

from __future__ import annotations

import torch

from dlm.errors import DlmError, check


def resolve_device(name: str) -> torch.device:
    """--device: auto (CUDA when there is one), cpu, cuda or cuda:N."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    index = name.partition(":")[2]
    check(name in ("cpu", "cuda") or (name.startswith("cuda:") and index.isdigit() and index.isascii()),
          f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DlmError(f"--device {name}: no CUDA device is available")
    if index and int(index) >= torch.cuda.device_count():
        raise DlmError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices (cuda:0 .. "
                       f"cuda:{torch.cuda.device_count() - 1})")
    return torch.device(name)
