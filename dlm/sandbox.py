"""Running an untrusted program contained: the one runner for model-written code (docs/reliability.md).

`run(source)` runs a Python program in a child and says whether it reached its end: the program is run by a
small harness that first reads a per-run random marker from a pipe (then closes it), runs the program, and
prints the marker on stdout only when the program returned; the run passes when the last line of stdout is
that marker and the exit status is 0. `sys.exit(0)` or `os._exit(0)` before the tests therefore fail.

Limits, at every level: wall time (the whole tree is killed), CPU seconds, address space, processes
(RLIMIT_NPROC), file size (RLIMIT_FSIZE: stdout and stderr go to files of at most that size, read back
tail only), open files, no core dumps; stdin is closed; every wait is bounded; the run's temporary folder is
removed whatever is left in it. Isolation, the strongest the machine allows (`DLM_SANDBOX` picks one):

    namespace  dlm runs as root: new PID, mount, network, IPC and UTS namespaces (util-linux `unshare`); a
               fresh root of its own (a size-capped tmpfs with /usr, /etc and the interpreter bound read-only
               and nosuid, a new /proc that shows only the run's processes); the program runs as a fresh uid
               of its own with no capabilities and no_new_privs. It sees nothing of the parent and can write
               only its tmpfs; when it ends, the namespace's every process dies with it.
    userns     dlm runs as a user that may create user namespaces: the same, the uid being the user mapped to
               root in the namespace with every capability dropped (files the user owns that lie under the
               read-only binds stay readable).
    uid        root without namespaces: the program runs as a fresh uid (every process of that uid is killed
               after the run); it cannot read the parent's /proc entries or 0600 files, but it sees the
               filesystem, may write world-writable folders (/tmp) and has the network.
    process    neither (never for root): its own session, the limits, and every descendant killed (the launcher
               is a child subreaper); the program runs as the user that runs dlm and can read and write what
               that user can. Use it only inside a container or VM.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

LEVELS = ("namespace", "userns", "uid", "process")
WHAT = {
    "namespace": "PID/mount/network namespaces, a read-only root of its own, a fresh unprivileged uid",
    "userns": "user/PID/mount/network namespaces, a read-only root of its own, no capabilities",
    "uid": "a fresh unprivileged uid, no namespaces: it sees the filesystem and the network",
    "process": "its own session and limits only: it runs as you and can read and write your files",
}
UNSHARE = ("--pid", "--net", "--mount", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc")


class SandboxError(Exception):
    """The runner cannot run a program at the isolation asked for (the machine's fault, not the program's)."""


@dataclass
class Limits:
    wall: float = 10.0  # seconds of wall time for the whole run
    cpu: int = 10  # CPU seconds per process
    memory_mb: int = 1024  # address space per process
    nproc: int = 32  # processes (of the run's uid / user namespace)
    fsize_mb: int = 16  # largest file written, stdout and stderr included
    nofile: int = 64  # open files per process
    disk_mb: int = 64  # the run's tmpfs (namespace levels)


@dataclass
class Outcome:
    passed: bool
    status: str  # passed | failed | timeout
    detail: str = ""  # the last line of stderr, for a failure
    level: str = ""
    stdout: str = ""  # the last 4 KiB of stdout, the marker line removed


# --- choosing the level --------------------------------------------------------------------------------


def _probe(args: list[str]) -> bool:
    try:
        return subprocess.run(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


_LEVEL: dict[str, str] = {}


def level() -> str:
    """The isolation level runs get: DLM_SANDBOX if set (it must be available), else the strongest available."""
    want = os.environ.get("DLM_SANDBOX", "")
    key = want or "auto"
    if key in _LEVEL:
        return _LEVEL[key]
    if want and want not in LEVELS:
        raise SandboxError(f"DLM_SANDBOX must be one of {', '.join(LEVELS)}, got {want!r}")
    if not sys.platform.startswith("linux"):
        raise SandboxError(f"running model-written code needs Linux (its namespaces and /proc), not {sys.platform}")
    root = os.geteuid() == 0
    unshare = shutil.which("unshare")
    ok = {"process": not root, "uid": root,  # root never runs a program as itself
          "namespace": bool(root and unshare and _probe([unshare, *UNSHARE, "true"])),
          "userns": bool(unshare and _probe([unshare, "--user", "--map-root-user", *UNSHARE, "true"]))}
    if want:
        if not ok[want]:
            why = ("dlm runs as root: it never runs a program as root" if want == "process" else
                   "needs root" if want in ("namespace", "uid") and not root else "unshare refused")
            raise SandboxError(f"DLM_SANDBOX={want}: not available on this machine ({why})")
        got = want
    else:
        got = next(lv for lv in LEVELS if ok[lv])
    _LEVEL[key] = got
    return got


def describe(lv: str | None = None) -> str:
    lv = lv or level()
    return f"code execution isolation: {lv} ({WHAT[lv]})"


# --- the parent's side ---------------------------------------------------------------------------------

# reads the marker, closes the pipe, runs the program as __main__, prints the marker only if it returned
HARNESS = (
    "import os,sys\n"
    "def _dlm_run():\n"
    " m=sys.stdin.readline().strip();sys.stdin.close()\n"
    " fd=os.open(os.devnull,os.O_RDONLY)\n"
    " if fd:os.dup2(fd,0);os.close(fd)\n"
    " src=open('program.py',encoding='utf-8').read()\n"
    " sys.argv=['program.py']\n"
    " g={'__name__':'__main__','__file__':'program.py','__builtins__':__builtins__}\n"
    " exec(compile(src,'program.py','exec'),g)\n"
    " sys.stdout.flush();sys.stderr.flush()\n"
    " os.write(1,('\\n'+m+'\\n').encode());os._exit(0)\n"
    "_dlm_run()\n"
)


def _readable_by_others(path: str) -> bool:
    p = Path(path).resolve()
    try:
        if not p.stat().st_mode & stat.S_IXOTH:
            return False
        return all(d.stat().st_mode & stat.S_IXOTH for d in p.parents)
    except OSError:
        return False


def _interpreter(lv: str) -> tuple[str, str]:
    """The Python that runs the program, and the folder to bind for it (namespace levels)."""
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable) or sys.executable)
    if lv in ("namespace", "userns", "process"):
        return base, os.path.realpath(sys.base_prefix)
    for cand in (base, shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")):
        if cand and _readable_by_others(cand):
            return os.path.realpath(cand), ""
    raise SandboxError("no Python interpreter that an unprivileged user may run (the runner's uid needs one: "
                       "install python3 system-wide)")


def _tail(path: Path, n: int = 4096) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(pid: int) -> list[int]:
    """Every process below pid, by walking /proc."""
    kids, out, todo = _children_map(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _uid_procs(uid: int) -> list[int]:
    """The live processes of uid (zombies, already dead, left out)."""
    out = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and os.stat(f"/proc/{d}").st_uid == uid:
                with open(f"/proc/{d}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                        out.append(int(d))
        except (OSError, IndexError):
            pass
    return out


def _kill(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def _kill_uid(uid: int) -> None:
    """Kill every process of uid: kill(-1) run as that uid reaches exactly them, even a fork bomb. (The drop to uid
    happens in subprocess's C code between fork and exec: no Python runs in a child of this threaded process.)"""
    kill = shutil.which("kill", path="/usr/bin:/bin")
    for _ in range(50):
        if not _uid_procs(uid):
            return
        if kill is None:
            _kill(_uid_procs(uid))
        else:
            try:
                subprocess.run([kill, "-9", "-1"], user=uid, group=uid, extra_groups=[], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=5)
            except (OSError, subprocess.SubprocessError):
                _kill(_uid_procs(uid))
        time.sleep(0.01)


def _rmtree(path: str) -> None:
    for _ in range(5):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return
        time.sleep(0.05)
    print(f"dlm: could not remove {path} entirely", file=sys.stderr)


def run(source: str, limits: Limits | None = None) -> Outcome:
    """Run one Python program contained; passed = the harness's marker came out last, with exit status 0."""
    lim = limits or Limits()
    lv = level()
    python, prefix = _interpreter(lv)
    marker = "dlm-pass-" + secrets.token_hex(16)
    uid = secrets.randbelow(1_000_000_000) + 1_000_000_000 if lv in ("namespace", "uid") else -1
    tmp = tempfile.mkdtemp(prefix="dlm-exec-")
    try:
        run_dir = Path(tmp)
        (run_dir / "program.py").write_text(source, encoding="utf-8")
        (run_dir / "root").mkdir()
        work = run_dir / "work"  # the program's folder at the uid and process levels
        work.mkdir()
        if lv == "uid":
            os.chown(work, uid, uid)
            os.chmod(tmp, 0o711)
        cfg = {"level": lv, "uid": uid, "python": python, "prefix": prefix, "run": tmp, "limits": asdict(lim)}
        cmd = [sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(cfg)]
        if lv == "namespace":
            cmd = [shutil.which("unshare") or "unshare", *UNSHARE, "--", *cmd]
        elif lv == "userns":
            cmd = [shutil.which("unshare") or "unshare", "--user", "--map-root-user", *UNSHARE, "--", *cmd]
        out_p, err_p, log_p = run_dir / "stdout", run_dir / "stderr", run_dir / "launcher.log"
        with open(out_p, "wb") as out, open(err_p, "wb") as err, open(log_p, "wb") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=err, pass_fds=(log.fileno(),),
                                    env={"PATH": "/usr/local/bin:/usr/bin:/bin", "DLM_SANDBOX_LOG": str(log.fileno())},
                                    start_new_session=True, cwd=tmp)
        status, detail = "", ""
        try:
            try:
                assert proc.stdin is not None
                proc.stdin.write((marker + "\n").encode())
                proc.stdin.close()
            except OSError:  # it ended before reading: the outcome says why
                pass
            try:
                proc.wait(timeout=lim.wall)
            except subprocess.TimeoutExpired:
                status, detail = "timeout", f"over {lim.wall:g} s"
        finally:
            # the whole tree: the launcher's descendants (also those that left its group), its group, its uid
            for _ in range(3):
                _kill(descendants(proc.pid))
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            _kill(descendants(proc.pid))
            if uid >= 0 and lv == "uid":
                _kill_uid(uid)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        problem = _tail(log_p).strip()
        if problem:
            raise SandboxError(f"the {lv} sandbox failed: {problem.splitlines()[-1]}")
        text = _tail(out_p)
        lines = text.rstrip("\n").split("\n")
        reached = lines[-1] == marker
        shown = "\n".join(lines[:-1] if reached else lines)
        if status:
            return Outcome(False, status, detail, lv, shown)
        if reached and proc.returncode == 0:
            return Outcome(True, "passed", "", lv, shown)
        errs = _tail(err_p).strip().splitlines()
        why = errs[-1][:200] if errs else (f"exit status {proc.returncode}" if proc.returncode
                                           else "it ended before its tests had run (exit status 0, no marker)")
        return Outcome(False, "failed", why, lv, shown)
    finally:
        _rmtree(tmp)


# --- the launcher: the child's side, run as `python -I -S sandbox.py CONFIG` ------------------------------

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
PR_SET_CHILD_SUBREAPER, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 36, 24, 28, 38
SECBIT_LOCKED = 0x1 | 0x2 | 0x20  # noroot and its lock, keep_caps off and locked
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _mount(libc, src, target, fstype, flags, data=None) -> None:
    import ctypes

    enc = [None if s is None else s.encode() for s in (src, target, fstype, data)]
    if libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {src} on {target}: {os.strerror(e)}")


def _keep_flags(path: str) -> int:
    f = os.statvfs(path).f_flag
    out = f & (MS_NOSUID | MS_NODEV | MS_NOEXEC)
    out |= MS_NOATIME if f & 1024 else 0
    out |= MS_NODIRATIME if f & 2048 else 0
    out |= MS_RELATIME if f & 4096 else 0
    return out


def _bind_ro(libc, src: str, dst: str) -> None:
    _mount(libc, src, dst, None, MS_BIND | MS_REC)
    _mount(libc, None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | _keep_flags(dst))


def _new_root(libc, cfg: dict, source: bytes) -> None:
    """A tmpfs root of our own with /usr, /etc and the interpreter read-only; then chroot into it."""
    lim, uid = cfg["limits"], cfg["uid"]
    owner = uid if uid >= 0 else 0
    r = os.path.join(cfg["run"], "root")
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    _mount(libc, "tmpfs", r, "tmpfs", MS_NOSUID | MS_NODEV, f"size={lim['disk_mb']}m,nr_inodes=4096,mode=755")
    binds = []
    for top in ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc"):
        src = "/" + top
        if os.path.islink(src):
            os.symlink(os.readlink(src), os.path.join(r, top))
        elif os.path.isdir(src):
            binds.append(src)
    prefix = cfg["prefix"]
    if prefix and not any(prefix == b or prefix.startswith(b + "/") for b in binds):
        binds.append(prefix)
    for src in binds:
        dst = r + src
        os.makedirs(dst, exist_ok=True)
        _bind_ro(libc, src, dst)
    os.makedirs(r + "/dev", exist_ok=True)
    for dev in ("null", "zero", "full", "random", "urandom"):
        open(f"{r}/dev/{dev}", "w").close()
        _mount(libc, f"/dev/{dev}", f"{r}/dev/{dev}", None, MS_BIND)
    os.makedirs(r + "/proc")
    _mount(libc, "proc", r + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for d in ("tmp", "work"):
        os.makedirs(f"{r}/{d}", mode=0o700)
        os.chown(f"{r}/{d}", owner, owner)
    with open(f"{r}/work/program.py", "wb") as f:
        f.write(source)
    os.chmod(f"{r}/work/program.py", 0o644)
    os.chroot(r)
    os.chdir("/")


def _drop(libc, cfg: dict) -> None:
    """In the program's child, before exec: session, limits, no capabilities, the run's uid."""
    import resource

    lim = cfg["limits"]
    os.setsid()
    mb = 1024 * 1024
    for res, v in ((resource.RLIMIT_AS, lim["memory_mb"] * mb), (resource.RLIMIT_CPU, lim["cpu"]),
                   (resource.RLIMIT_NPROC, lim["nproc"]), (resource.RLIMIT_FSIZE, lim["fsize_mb"] * mb),
                   (resource.RLIMIT_NOFILE, lim["nofile"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (v, v))
    if cfg["level"] in ("namespace", "userns"):
        last = int(open("/proc/sys/kernel/cap_last_cap").read())
        for cap in range(last + 1):
            libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
        libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        if libc.prctl(PR_SET_SECUREBITS, SECBIT_LOCKED, 0, 0, 0) != 0:
            raise OSError("could not lock the securebits")
    if cfg["uid"] >= 0:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError("could not set no_new_privs")


def _launch(cfg: dict) -> int:
    log = int(os.environ.pop("DLM_SANDBOX_LOG"))
    try:
        libc = _libc()
        source = open(os.path.join(cfg["run"], "program.py"), "rb").read()
        if cfg["level"] in ("namespace", "userns"):
            _new_root(libc, cfg, source)
            work = "/work"
        else:
            libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
            work = os.path.join(cfg["run"], "work")
            with open(os.path.join(work, "program.py"), "wb") as f:
                f.write(source)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        r, w = os.pipe()  # the marker, passed on to the harness's stdin
        os.write(w, sys.stdin.buffer.readline())
        os.close(w)
        pid = os.fork()
        if pid == 0:
            try:
                os.dup2(r, 0)
                os.chdir(work)
                _drop(libc, cfg)
                os.set_inheritable(log, False)
                os.closerange(3, log)
                os.closerange(log + 1, 1 << 16)
                os.execve(cfg["python"], [cfg["python"], "-I", "-c", HARNESS], env)
            except BaseException as e:  # noqa: BLE001 - reported to the parent through the log
                os.write(log, f"{type(e).__name__}: {e}\n".encode())
            os._exit(127)
        os.close(r)
        os.close(log)
    except OSError as e:
        os.write(log, f"{e}\n".encode())
        return 125
    status = 1
    while True:  # reap everything; leave when the program ends (in a namespace its other processes then die)
        try:
            got, st = os.wait()
        except ChildProcessError:
            break
        if got == pid:
            status = os.waitstatus_to_exitcode(st)
            break
    if cfg["level"] in ("uid", "process"):  # no namespace to end them: kill what is left below us, reap it
        for _ in range(20):
            kids = descendants(os.getpid())
            if not kids:
                break
            _kill(kids)
            try:
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            except ChildProcessError:
                pass
            time.sleep(0.01)
    return status if status >= 0 else 128 - status


ENV = "DLM_ALLOW_CODE_EXECUTION"


def allowed(flag: bool, task: str) -> str:
    """Model-written programs run only when asked (the flag, or DLM_ALLOW_CODE_EXECUTION=1); the isolation they
    get, in one line for stderr. Refused: one DlmError line (this module imports no torch: the refusal is at once)."""
    from dlm.errors import DlmError

    if not (flag or os.environ.get(ENV, "") == "1"):
        raise DlmError(f"--task {task} runs programs the model wrote: pass --allow-code-execution (or set {ENV}=1) "
                       "to run them contained (docs/reliability.md)")
    try:
        return describe()
    except SandboxError as e:
        raise DlmError(str(e)) from None


if __name__ == "__main__":
    sys.exit(_launch(json.loads(sys.argv[1])))
