"""Running a generated program against its tests: in a child process, never in the dlm process.

Each program is written to a fresh temporary folder and run by the same Python interpreter in isolated
mode (`-I`: no user site, no PYTHON* variables, the script's folder not on the path... the folder is its
working directory), with limits set in the child before it starts: address space (`memory_mb`), CPU
seconds and open files, no core dumps; a wall-clock timeout kills its whole process group. It passes when
it exits with status 0 within the limits. The environment is emptied but for PATH, and stdin is closed.

This is a fence against accidents (a loop that never ends, a runaway allocation, a stray exit), the
protection HumanEval's own harness asks for; it is no security sandbox against a hostile program: run
untrusted models' code inside a container or VM as well.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

TIMEOUT = 10.0  # wall seconds per program
MEMORY_MB = 1024  # address space per program


@dataclass
class Outcome:
    passed: bool
    status: str  # passed | failed | timeout
    detail: str = ""  # the last line of stderr, for a failure


def _limits(memory_mb: int, cpu_seconds: int):
    def apply() -> None:  # runs in the child, before the interpreter starts
        import resource

        os.setsid()  # its own process group: the timeout kills whatever it spawned too
        mem = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    return apply


def run_program(source: str, timeout: float = TIMEOUT, memory_mb: int = MEMORY_MB) -> Outcome:
    """Run one Python program in a child process with limits; passed = exit status 0 in time."""
    with tempfile.TemporaryDirectory(prefix="dlm-exec-") as tmp:
        path = Path(tmp) / "program.py"
        path.write_text(source, encoding="utf-8")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.Popen([sys.executable, "-I", str(path)], cwd=tmp, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                preexec_fn=_limits(memory_mb, max(1, int(timeout) + 1)))
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            return Outcome(False, "timeout", f"over {timeout:g} s")
        if proc.returncode == 0:
            return Outcome(True, "passed")
        lines = err.decode("utf-8", "replace").strip().splitlines()
        return Outcome(False, "failed", lines[-1][:200] if lines else f"exit status {proc.returncode}")
