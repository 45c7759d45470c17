"""Drive headless Chromium over the DevTools protocol on a pipe (no websocket library, no driver download).

`--remote-debugging-pipe` makes Chromium read DevTools commands from fd 3 and write replies and
events to fd 4, each a JSON message ended by a NUL byte. That is enough to open a page, wait in
real time for a condition (a streaming page: virtual time would run ahead of the network), read
values out of it and take a screenshot.

    python tests/chromium.py URL OUT.png [--wait JS] [--width 1280 --height 800]
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
         "--disable-default-apps", "--mute-audio", "--hide-scrollbars"]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    def __init__(self, width: int = 1280, height: int = 800, binary: str | None = None):
        binary = binary or find_chromium()
        if binary is None:
            raise FileNotFoundError("no chromium on PATH")
        self.profile = tempfile.mkdtemp(prefix="dlm-chromium-")
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()
        to_chrome_r, from_chrome_w = _high(to_chrome_r), _high(from_chrome_w)  # never 3 or 4 themselves
        # Chromium reads fd 3 and writes fd 4
        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self.profile}", f"--window-size={width},{height}",
             "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(3, 4), preexec_fn=_dup_to(to_chrome_r, from_chrome_w))
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._id = 0
        self.width, self.height = width, height
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session=True)

    def _send(self, msg: dict) -> None:
        os.write(self._w, json.dumps(msg).encode() + b"\0")

    def _recv(self, timeout: float) -> dict:
        import select

        deadline = time.time() + timeout
        while b"\0" not in self._buf:
            left = deadline - time.time()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError("chromium did not answer")
            part = os.read(self._r, 1 << 20)
            if not part:
                raise ConnectionError("chromium closed the pipe")
            self._buf += part
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, params: dict | None = None, session: bool = False, timeout: float = 30) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        self._send(msg)
        while True:
            reply = self._recv(timeout)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def goto(self, url: str) -> None:
        self.call("Page.navigate", {"url": url}, session=True)

    def eval(self, expr: str):
        res = self.call("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True},
                        session=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expr}: {res['exceptionDetails'].get('text')}")
        return res["result"].get("value")

    def wait_for(self, expr: str, timeout: float = 60, every: float = 0.2):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                value = self.eval(expr)
            except RuntimeError:
                value = None
            if value:
                return value
            time.sleep(every)
        raise TimeoutError(f"waited {timeout} s for {expr}")

    def screenshot(self, path: str | os.PathLike) -> Path:
        data = self.call("Page.captureScreenshot", {"format": "png"}, session=True)["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _high(fd: int) -> int:
    import fcntl

    new = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return new


def _dup_to(read_end: int, write_end: int):
    def setup() -> None:  # in the child: its fd 3 reads our commands, its fd 4 writes its answers
        os.dup2(read_end, 3)
        os.dup2(write_end, 4)
    return setup


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("out")
    ap.add_argument("--wait", default="document.body.dataset.state === 'done'")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=800)
    ap.add_argument("--timeout", type=float, default=120)
    a = ap.parse_args()
    with Browser(a.width, a.height) as b:
        b.goto(a.url)
        b.wait_for(a.wait, a.timeout)
        print(b.screenshot(a.out))
