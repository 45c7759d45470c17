"""`dlm serve` against input nobody chose: bodies generated from the server's own /openapi.json (schemathesis:
valid and invalid ones), lone surrogates, deep nesting, a client that stalls or leaves mid-upload. Never a 5xx,
never a traceback in the log, and the server healthy afterwards."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from dlm.serve import app as app_mod
from dlm.serve.app import create_app, running
from dlm.serve.engine import Engine

CK = Path(__file__).resolve().parents[1] / "checkpoints"
pytestmark = pytest.mark.usefixtures("one_thread")


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def tracebacks(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.exc_info or r.levelno >= logging.ERROR]


@pytest.fixture(scope="module")
def served():
    """A real server (uvicorn on a free port) over three paradigms, its log recorded."""
    rec = Records()
    names = ("uvicorn", "uvicorn.error", "dlm.serve")
    for n in names:
        logging.getLogger(n).addHandler(rec)
    eng = Engine([str(CK / "ar-small"), str(CK / "mdlm-small"), str(CK / "usdm-small")])
    try:
        with running(create_app(eng, max_concurrency=4, max_queue=64)) as base:
            yield base, rec
    finally:
        eng.close()
        for n in names:
            logging.getLogger(n).removeHandler(rec)


def healthy(base: str) -> None:
    assert httpx.get(base + "/health", timeout=30).json()["status"] == "ok"
    r = httpx.post(base + "/v1/completions", json={"model": "ar-small", "prompt": "def f(", "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


def test_openapi_declares_the_request_bodies(served):
    base, _ = served
    spec = httpx.get(base + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        body = spec["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert body["properties"]["model"]["enum"] == ["ar-small", "mdlm-small", "usdm-small"]
    assert {"/health", "/v1/models"} <= set(spec["paths"])


@pytest.mark.parametrize("body, needle", [
    (b'{"model": "ar-small", "prompt": "\\ud800x", "max_tokens": 2}', "surrogate"),
    (b'{"model": "ar-small", "messages": [{"role": "user", "content": "\\udfff"}]}', "surrogate"),
    (b'{"model": "ar-small", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "deeper than 64"),
    (b"[" * 100_000 + b"]" * 100_000, "deeper than 64"),
])
def test_unusable_text_and_deep_nesting_are_400(served, body, needle):
    base, rec = served
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    r = httpx.post(base + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert rec.tracebacks() == []


def _partial_upload(base: str, pause: float, leave: bool) -> bytes:
    u = urlparse(base)
    s = socket.create_connection((u.hostname, u.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"model\": ")
    time.sleep(pause)
    if leave:
        s.close()
        return b""
    data = s.recv(4096)
    s.close()
    return data


def test_a_client_that_stalls_or_leaves_mid_upload(served, monkeypatch):
    base, rec = served
    monkeypatch.setattr(app_mod, "BODY_TIMEOUT", 0.5)
    reply = _partial_upload(base, 2.0, leave=False)
    assert reply.startswith(b"HTTP/1.1 408") and b"stalled" in reply, reply[:300]
    _partial_upload(base, 0.3, leave=True)
    time.sleep(0.5)
    assert rec.tracebacks() == []
    healthy(base)


def _cap(body):
    """Keep generated requests cheap: a few new tokens, a few choices (the values stay of the schema's types)."""
    if isinstance(body, dict):
        for key, most in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 2), ("best_of", 2), ("steps", 4),
                          ("canvas_length", 16), ("fill_length", 8), ("logprobs", 2), ("top_logprobs", 2)):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > most:
                body[key] = most
        if "max_completion_tokens" not in body:
            body.setdefault("max_tokens", 4)
        if body.get("model") in ("mdlm-small", "usdm-small"):
            body.setdefault("steps", 4)
        if body.get("stream") is True:
            body["stream"] = False  # (a stream's errors arrive inside its 200; the JSON answer shows the status)
    return body


def test_generated_requests_never_get_a_5xx(served):
    """Every operation of /openapi.json, valid bodies and invalid ones (schemathesis's positive and negative modes),
    sent over HTTP to the running server: 4xx with a message at worst, never a 5xx or a logged traceback."""
    from hypothesis import given, strategies as st

    base, rec = served
    api = schemathesis.openapi.from_url(base + "/openapi.json")
    ops = [r.ok() for r in api.get_all_operations()]
    cases = st.one_of([op.as_strategy(generation_mode=mode) for op in ops
                       for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)])
    seen: dict[int, int] = {}

    @given(cases)
    @settings(max_examples=50, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def one(case):
        case.body = _cap(case.body)
        r = case.call(base_url=base, timeout=60)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (case.method, case.path, repr(case.body)[:300], r.text[:300])
        if r.status_code >= 400:
            assert r.json()["error"]["message"], r.text

    t0 = time.monotonic()
    one()
    assert time.monotonic() - t0 < 60  # (about 15 s on 2 busy cores)
    assert rec.tracebacks() == []
    assert any(200 <= c < 300 for c in seen) and any(400 <= c < 500 for c in seen), seen  # both kinds were sent


def test_healthy_after_the_fuzz(served):
    base, rec = served
    healthy(base)
    assert rec.tracebacks() == []
