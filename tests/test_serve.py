"""`dlm serve`: a real uvicorn on 127.0.0.1 (a free port, in a thread), driven by the official openai client
and by raw HTTP: completions and chat, streaming and not, every paradigm, 16 concurrent streams, the queue
limit, disconnects, a table of bad requests, the API key, and the playground in headless Chromium."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import start_server

fastapi = pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402

from dlm.errors import DlmError  # noqa: E402
from dlm.sampling import SampleConfig, generate  # noqa: E402
from dlm.serve.app import create_app, running  # noqa: E402
from dlm.serve.engine import Engine  # noqa: E402

CK = Path(__file__).resolve().parent.parent / "checkpoints"
PROMPTS = [
    "def read_config(path):\n    ", "import os\n", "class Stack:\n    def push(self, item):\n        ",
    "for i in range(10):\n    ", "x = ", "def main():\n    args = parse_args()\n    ", "# Copyright\n",
    "    return self.", "try:\n    import json\nexcept ImportError:\n    ", "if __name__ == '__main__':\n    ",
    "def __init__(self, name):\n        self.", "with open(path) as f:\n    ", "raise ValueError(",
    "@property\ndef size(self):\n    ", "from collections import", "while True:\n    line = ",
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine():
    eng = Engine([str(CK / "ar-small"), str(CK / "mdlm-small"), str(CK / "usdm-small")],
                 draft=str(CK / "dflash-small"))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def url(engine):
    with running(create_app(engine, max_concurrency=16, max_queue=16)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def reference(engine, model: str, prompt: str, **kw) -> str:
    s = engine.get(model)
    return generate(s.model, s.ck, prompt, SampleConfig(**kw)).text


def sse(url: str, body: dict, path: str = "/v1/completions") -> list:
    """The data lines of a streamed response, parsed ('[DONE]' kept as a string)."""
    out = []
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


# the API with the openai client ------------------------------------------------------------------

def test_health_and_models(url, client):
    h = httpx.get(url + "/health").json()
    assert h["status"] == "ok" and h["models"] == ["ar-small", "mdlm-small", "usdm-small", "ar-small+dflash-small"]
    ids = {m.id: m.model_extra["dlm"]["paradigm"] for m in client.models.list().data}
    assert ids == {"ar-small": "ar", "mdlm-small": "mdlm", "usdm-small": "usdm", "ar-small+dflash-small": "speculative"}
    assert client.models.retrieve("mdlm-small").model_extra["dlm"]["block_size"] == 32


def test_ar_completion_is_dlm_generate_and_streams_the_same_text(engine, client):
    prompt = PROMPTS[0]
    want = reference(engine, "ar-small", prompt, max_new_tokens=24)
    r = client.completions.create(model="ar-small", prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == want and r.object == "text_completion"
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(engine.get("ar-small").ck.tokenizer.encode(prompt))
    dlm = r.model_extra["dlm"]
    assert dlm["paradigm"] == "ar" and dlm["forwards"] == 24 and dlm["tokens_per_forward"] == 1.0
    chunks = list(client.completions.create(model="ar-small", prompt=prompt, max_tokens=24, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].model_extra["dlm"]["event"] == "stats"


def test_every_paradigm_answers_with_its_counters(engine, client):
    prompt = PROMPTS[2]
    ar_text = reference(engine, "ar-small", prompt, max_new_tokens=20)
    spec = client.completions.create(model="ar-small+dflash-small", prompt=prompt, max_tokens=20, temperature=0)
    assert spec.choices[0].text == ar_text  # lossless: the target's own greedy output
    d = spec.model_extra["dlm"]
    assert d["paradigm"] == "speculative" and 1 <= d["tau"] <= 9 and d["draft_forwards"] > 0
    assert d["forwards"] < 20 + 1 and d["tokens_per_forward"] == pytest.approx(20 / d["forwards"])
    for model, steps in (("mdlm-small", None), ("usdm-small", 12)):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"steps": steps})
        assert r.choices[0].text == reference(engine, model, prompt, max_new_tokens=16, steps=steps)
        d = r.model_extra["dlm"]
        assert d["paradigm"] == model.split("-")[0] and d["steps"] >= 1 and d["canvases"] >= 1 and d["forwards"] >= 1


def test_chat_template_streaming_and_not(client):
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Read a file."}]
    r = client.chat.completions.create(model="ar-small", messages=msgs, max_tokens=16)
    text = r.choices[0].message.content
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert "\n### " not in text and r.usage.prompt_tokens > 5
    chunks = list(client.chat.completions.create(model="ar-small", messages=msgs, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    m = client.chat.completions.create(model="mdlm-small", messages=msgs, max_tokens=12)
    assert m.model_extra["dlm"]["paradigm"] == "mdlm"


def test_infilling_returns_the_middle(engine, client):
    prefix, suffix = "def add(a, b):\n    ", "\n\ndef sub(a, b):\n    return a - b\n"
    for model, steps in (("mdlm-small", None), ("usdm-small", 16)):
        r = client.completions.create(model=model, prompt=prefix, suffix=suffix, max_tokens=12, temperature=0,
                                      extra_body={"steps": steps})
        full = reference(engine, model, prefix, max_new_tokens=12, suffix=suffix, steps=steps)
        assert full == r.choices[0].text + suffix  # the suffix comes back byte-exact after the middle
        assert r.usage.completion_tokens == 12


def test_logprobs_are_the_models_own(engine, client):
    prompt = PROMPTS[1]
    r = client.completions.create(model="ar-small", prompt=prompt, max_tokens=6, logprobs=3, temperature=0)
    lp = r.choices[0].logprobs
    s = engine.get("ar-small")
    tok = s.ck.tokenizer
    ids = tok.encode(prompt)
    new = [tok.encode(t) for t in lp.tokens]
    assert all(len(n) == 1 for n in new) and "".join(lp.tokens) == r.choices[0].text
    seq = ids + [n[0] for n in new]
    with torch.inference_mode():
        logp = torch.log_softmax(s.model(torch.tensor([seq])).logits[0].float(), -1)
    for i, t in enumerate(new):
        assert lp.token_logprobs[i] == pytest.approx(float(logp[len(ids) - 1 + i, t[0]]), abs=1e-4)
        assert len(lp.top_logprobs[i]) == 3 and max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i])
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    # the speculative id answers logprobs too (without speculation: the output is the same)
    spec = client.completions.create(model="ar-small+dflash-small", prompt=prompt, max_tokens=6, logprobs=1,
                                     temperature=0)
    assert spec.choices[0].text == r.choices[0].text
    chat = client.chat.completions.create(model="ar-small", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) >= 1 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 2


def test_stop_sequences_cut_the_text(engine, client):
    prompt = PROMPTS[0]
    full = reference(engine, "ar-small", prompt, max_new_tokens=40)
    assert "\n" in full
    r = client.completions.create(model="ar-small", prompt=prompt, max_tokens=40, stop=["\n"], temperature=0)
    assert r.choices[0].text == full[:full.index("\n")] and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="ar-small", prompt=prompt, max_tokens=40, stop="\n", stream=True,
                                            temperature=0))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_n_choices_seeds_and_prompt_lists(client):
    r = client.completions.create(model="ar-small", prompt=PROMPTS[3], max_tokens=12, n=3, temperature=1.0, seed=7)
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) > 1
    again = client.completions.create(model="ar-small", prompt=PROMPTS[3], max_tokens=12, n=3, temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == texts  # seeds make it reproducible
    one = client.completions.create(model="ar-small", prompt=PROMPTS[3], max_tokens=12, temperature=1.0, seed=8)
    assert one.choices[0].text == texts[1]  # choice j runs with seed + j, batched or not
    two = client.completions.create(model="mdlm-small", prompt=PROMPTS[:2], max_tokens=8)
    assert len(two.choices) == 2 and two.usage.completion_tokens == 16
    echo = client.completions.create(model="ar-small", prompt="import ", max_tokens=3, echo=True)
    assert echo.choices[0].text.startswith("import ")


def test_diffusion_steps_and_drafts_stream_as_extra_fields(engine, url):
    prompt = PROMPTS[0]
    for model in ("mdlm-small", "usdm-small"):
        events = sse(url, {"model": model, "prompt": prompt, "max_tokens": 12, "stream": True, "temperature": 0,
                           "dlm_stream_steps": True})
        assert events[-1] == "[DONE]"
        steps = [e["dlm"] for e in events[:-1] if e.get("dlm", {}).get("event") == "step"]
        assert steps and all(len(s["tokens"]) == len(s["fixed"]) == 12 for s in steps)
        assert sum(steps[-1]["fixed"]) > sum(steps[0]["fixed"]) or model == "usdm-small"
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert text == reference(engine, model, prompt, max_new_tokens=12)
        assert events[-2]["dlm"]["event"] == "stats" and events[-2]["dlm"]["steps"] == len(steps)
    events = sse(url, {"model": "ar-small+dflash-small", "prompt": prompt, "max_tokens": 16, "stream": True,
                       "dlm_stream_steps": True})
    drafts = [e["dlm"] for e in events[:-1] if e.get("dlm", {}).get("event") == "draft"]
    assert drafts and all(0 <= d["accepted"] <= len(d["proposed"]) for d in drafts)
    assert events[-2]["dlm"]["cycles"] == len(drafts)


# load --------------------------------------------------------------------------------------------------

def test_16_concurrent_streams_are_batched_and_uncorrupted(engine, url, client):
    want = [client.completions.create(model="ar-small", prompt=p, max_tokens=24, temperature=0).choices[0].text
            for p in PROMPTS]
    before = httpx.get(url + "/health").json()["batching"]["ar-small"]
    start = threading.Barrier(len(PROMPTS))

    def one(p: str) -> str:
        start.wait()
        stream = client.completions.create(model="ar-small", prompt=p, max_tokens=24, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(one, PROMPTS))
    assert got == want
    after = httpx.get(url + "/health").json()["batching"]["ar-small"]
    steps = after["decode_steps"] - before["decode_steps"]
    rows = after["decode_rows"] - before["decode_rows"]
    assert rows / steps > 2, (rows, steps)  # requests shared forwards
    assert after["max_rows"] >= 4
    # every prompt came before: its K/V from the prefix cache (all but its last token), the same text
    assert after["prefix_hits"] - before["prefix_hits"] == len(PROMPTS)


def test_kv_dtype_bfloat16_keeps_the_rows_kv_in_bfloat16_and_decodes_as_the_model_with_that_cache():
    """`dlm serve --kv-dtype bfloat16`: the AR model's caches are bfloat16 (Transformer.kv_dtype); concurrent greedy
    streams give what `generate` gives with that cache; an unknown dtype is refused."""
    eng = Engine([str(CK / "ar-small")], kv_dtype="bfloat16")
    try:
        served = eng.get("ar-small")
        assert served.model.kv_dtype == torch.bfloat16 and served.model.new_cache(1, 8).k.dtype == torch.bfloat16
        want = [reference(eng, "ar-small", p, max_new_tokens=16) for p in PROMPTS[:6]]
        with running(create_app(eng, max_concurrency=8, max_queue=8)) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
            start = threading.Barrier(6)

            def one(p: str) -> str:
                start.wait()
                stream = client.completions.create(model="ar-small", prompt=p, max_tokens=16, temperature=0,
                                                   stream=True)
                return "".join(c.choices[0].text for c in stream)

            with ThreadPoolExecutor(6) as pool:
                got = list(pool.map(one, PROMPTS[:6]))
        assert got == want
        assert all(t.dtype == torch.bfloat16 for t in served.rows.batch.rows.cache.buffers())
    finally:
        eng.close()
    with pytest.raises(DlmError, match="--kv-dtype"):
        Engine([str(CK / "ar-small")], kv_dtype="fp8")


@pytest.mark.parametrize("model,extra", [("mdlm-small", {}), ("usdm-small", {"steps": 8})])
def test_concurrent_diffusion_streams_are_batched_and_uncorrupted(engine, url, model, extra):
    """mdlm and usdm requests arriving together share forwards (rows of one batch) and each gets what it gets alone;
    a request with a stop string leaves the batch early, the others go on."""
    want = [reference(engine, model, p, max_new_tokens=16, **extra) for p in PROMPTS[:8]]
    dlm = _concurrent_rows(url, model, want, extra)
    assert dlm["batch_rows_mean"] > 1 and dlm["steps"] >= 1 and dlm["canvases"] >= 1


def test_concurrent_speculative_streams_are_batched_and_uncorrupted(engine, url):
    """AR + DFlash requests arriving together share the target's verify forwards and the drafter's draft forwards
    (rows of one batch, each at its own accepted length) and each gets what it gets alone; one that stops early
    leaves."""
    s = engine.get("ar-small+dflash-small")
    cfg = SampleConfig(max_new_tokens=16, draft=str(CK / "dflash-small"))
    want = [generate(s.model, s.ck, p, cfg).text for p in PROMPTS[:8]]
    dlm = _concurrent_rows(url, "ar-small+dflash-small", want)
    assert dlm["batch_rows_mean"] > 1 and dlm["draft_forwards"] >= 1 and dlm["cycles"] >= 1


@pytest.fixture(scope="module")
def joint_url():
    eng = Engine([str(CK / "joint-small")])
    with running(create_app(eng, max_concurrency=16, max_queue=16)) as base:
        yield eng, base
    eng.close()


@pytest.mark.parametrize("sampler", ["auto", "self-spec-quadratic", "threshold", "ar"])
def test_concurrent_joint_streams_are_batched_and_uncorrupted(joint_url, sampler):
    """A joint model's self-speculation (linear, the default, and quadratic), diffusion and AR-mode requests share
    forwards in the same way (the AR mode's rows too: every mode is a row program on the model's one batcher)."""
    eng, url = joint_url
    extra = {} if sampler == "auto" else {"sampler": sampler}
    want = [reference(eng, "joint-small", p, max_new_tokens=16, **extra) for p in PROMPTS[:8]]
    dlm = _concurrent_rows(url, "joint-small", want, extra)
    assert dlm["batch_rows_mean"] > 1


def _concurrent_rows(url: str, model: str, want: list[str], extra: dict | None = None, key: str | None = None) -> dict:
    """8 streamed requests of `model` sent together (the first with a stop string): each text is `want`'s (the first
    cut at its stop), and they shared forwards (the counters of /health's batching[key or model]); the dlm
    statistics of the second."""
    prompts = PROMPTS[:len(want)]
    extra = extra or {}
    _idle(url)
    key = key or model
    before = httpx.get(url + "/health").json()["batching"][key]
    start = threading.Barrier(len(prompts))

    def one(i: int) -> tuple[str, dict]:
        start.wait()
        body = {"model": model, "prompt": prompts[i], "max_tokens": 16, "stream": True, "temperature": 0,
                "stream_options": {"include_usage": True}, **extra}
        if i == 0:
            body["stop"] = [want[0][2:5]]  # this one stops early
        chunks = sse(url, body)
        return "".join(c["choices"][0]["text"] for c in chunks[:-1] if c != "[DONE]" and c["choices"]), chunks

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, range(len(prompts))))
    assert [g[0] for g in got[1:]] == want[1:]
    assert got[0][0] == want[0][:want[0].index(want[0][2:5])]
    after = _idle(url)["batching"][key]
    steps = after["decode_steps"] - before["decode_steps"]
    rows = after["decode_rows"] - before["decode_rows"]
    assert rows / steps > 2, (rows, steps)  # requests shared forwards
    assert after["max_rows"] >= 4
    return [c for c in got[1][1] if c != "[DONE]" and c.get("dlm")][-1]["dlm"]


def test_queue_limit_answers_429_with_retry_after(engine):
    with running(create_app(engine, max_concurrency=1, max_queue=1)) as base:
        start = threading.Barrier(8)

        def one(i: int) -> httpx.Response:
            start.wait()
            return httpx.post(base + "/v1/completions", json={"model": "usdm-small", "prompt": PROMPTS[i],
                                                               "max_tokens": 16}, timeout=120)

        with ThreadPoolExecutor(8) as pool:
            rs = list(pool.map(one, range(8)))
        codes = sorted(r.status_code for r in rs)
        assert set(codes) <= {200, 429} and codes.count(200) >= 2 and codes.count(429) >= 1, codes
        busy = next(r for r in rs if r.status_code == 429)
        assert int(busy.headers["retry-after"]) >= 1
        assert busy.json()["error"]["type"] == "rate_limit_error"
        assert all(r.json()["choices"][0]["text"] for r in rs if r.status_code == 200)
        assert httpx.get(base + "/health").json()["rejected"] == codes.count(429)


def _idle(url: str, timeout: float = 10) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        h = httpx.get(url + "/health").json()
        if h["running"] == 0 and all(b["active_rows"] == 0 for b in h["batching"].values()):
            return h
        time.sleep(0.05)
    raise AssertionError(f"still busy: {h}")


def test_a_client_that_disconnects_stops_its_generation(url):
    _idle(url)
    before = httpx.get(url + "/health").json()["batching"]["ar-small"]["decode_rows"]
    body = {"model": "ar-small", "prompt": "x = ", "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(g.startswith("data: ") for g in got)
    h = _idle(url)
    assert h["batching"]["ar-small"]["decode_rows"] - before < 900  # it stopped long before 1000 tokens
    # not streaming: the client gives up waiting
    before = h["batching"]["ar-small"]["decode_rows"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
    h = _idle(url)
    assert h["batching"]["ar-small"]["decode_rows"] - before < 900
    # a diffusion stream left early stops too (between denoising steps)
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "model": "usdm-small", "prompt": "x = ", "max_tokens": 512, "stream": True, "dlm_stream_steps": True}) as r:
        lines = r.iter_lines()
        [next(lines) for _ in range(4)]
    _idle(url)


def test_health_answers_while_a_model_works(url):
    body = {"model": "usdm-small", "prompt": "x", "max_tokens": 512, "stream": True, "dlm_stream_steps": True,
            "adaptive": False}  # a 256-token canvas denoised for all 48 steps: long enough on any CPU
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if '"event":"step"' in line)  # the model is working
        slowest = 0.0
        for _ in range(5):
            t = time.perf_counter()
            h = httpx.get(url + "/health", timeout=10).json()
            slowest = max(slowest, time.perf_counter() - t)
            assert h["running"] >= 1
        assert slowest < 2.0
    _idle(url)  # and leaving stops it


# bad input ----------------------------------------------------------------------------------------------

OK = {"model": "ar-small", "prompt": "x", "max_tokens": 4}
BAD = [  # (path, body (dict, or raw bytes), status, param)
    ("/v1/completions", b'{"model": "ar-small", "prompt": ', 400, None),
    ("/v1/completions", b"[1, 2, 3]", 400, None),
    ("/v1/completions", b"\xff\xfe not utf-8", 400, None),
    ("/v1/completions", {"prompt": "x"}, 400, "model"),
    ("/v1/completions", {**OK, "model": "gpt-9"}, 404, "model"),
    ("/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**OK, "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {**OK, "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {**OK, "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/completions", {**OK, "max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/completions", {**OK, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**OK, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**OK, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {**OK, "prompt": "x " * 3000, "max_tokens": 16}, 400, "prompt"),
    ("/v1/completions", {**OK, "prompt": 123}, 400, "prompt"),
    ("/v1/completions", {**OK, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {**OK, "prompt": [[1, 2], [99999]]}, 400, "prompt"),
    ("/v1/completions", {**OK, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {**OK, "n": 0}, 400, "n"),
    ("/v1/completions", {**OK, "n": 100}, 400, "n"),
    ("/v1/completions", {**OK, "seed": -1}, 400, "seed"),
    ("/v1/completions", {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {**OK, "stop": [""]}, 400, "stop"),
    ("/v1/completions", {**OK, "logprobs": 10}, 400, "logprobs"),
    ("/v1/completions", {**OK, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {**OK, "presence_penalty": 1.0}, 400, "presence_penalty"),
    ("/v1/completions", {**OK, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {**OK, "suffix": "pass"}, 400, "suffix"),  # AR cannot infill
    ("/v1/completions", {**OK, "steps": 4}, 400, "steps"),  # not an AR option
    ("/v1/completions", {**OK, "model": "mdlm-small", "logprobs": 1}, 400, "logprobs"),
    ("/v1/completions", {**OK, "model": "mdlm-small", "sampler": "nope"}, 400, "sampler"),
    ("/v1/completions", {**OK, "model": "mdlm-small", "entropy_bound": -1.0}, 400, "entropy_bound"),
    ("/v1/completions", {**OK, "model": "mdlm-small", "steps": 0}, 400, "steps"),
    ("/v1/completions", {**OK, "model": "mdlm-small", "canvas_length": 8}, 400, "canvas_length"),
    ("/v1/completions", {**OK, "model": "mdlm-small", "prompt": "a <fill:99999999999> b"}, 400, "prompt"),
    ("/v1/completions", {**OK, "model": "mdlm-small", "fill_length": 10**9, "prompt": "a <fill> b"}, 400,
     "fill_length"),
    ("/v1/completions", {**OK, "model": "usdm-small", "temperature": 1e-5}, 400, "temperature"),  # scales t_min
    ("/v1/completions", {**OK, "model": "usdm-small", "canvas_length": 0}, 400, "canvas_length"),
    ("/v1/completions", {**OK, "model": "usdm-small", "t_min": 2.0}, 400, "t_min"),
    ("/v1/completions", {**OK, "model": "usdm-small", "t_min": 1e-300, "t_max": 1e-300}, 400, "t_min"),
    ("/v1/completions", {**OK, "model": "mdlm-small", "temperature": 1e300}, 400, "temperature"),
    ("/v1/completions", {**OK, "model": "ar-small+dflash-small", "block_size": 99}, 400, "block_size"),
    ("/v1/completions", {**OK, "model": "ar-small+dflash-small", "gamma": 4, "block_size": 5}, 400, "gamma"),
    ("/v1/completions", {**OK, "model": "ar-small+dflash-small", "draft_passes": 7}, 400, "draft_passes"),
    ("/v1/completions", {**OK, "model": "ar-small+dflash-small", "lookup_ngram": 2}, 400, "lookup_ngram"),
    ("/v1/chat/completions", {"model": "ar-small", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "ar-small", "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role"),
    ("/v1/chat/completions", {"model": "ar-small", "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "ar-small", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": "usdm-small", "messages": [{"role": "user", "content": "x"}],
                              "logprobs": True}, 400, "logprobs"),
]


def test_bad_requests_get_their_4xx(url):
    http = httpx.Client(base_url=url)
    for path, body, status, param in BAD:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(path, json=body)
        err = r.json().get("error")
        assert r.status_code == status, (body, r.status_code, r.text)
        assert err is not None and set(err) == {"message", "type", "param", "code"}, r.text
        assert err["message"] and err["param"] == param, (body, err)
        assert "--" not in err["message"], err  # the request's field names, not the CLI's options
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_transport_level_mistakes(url):
    r = httpx.post(url + "/v1/completions", content=b"{" + b" " * (2 << 20) + b"}")
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = httpx.post(url + "/v1/completions", content=(b" " * (2 << 20) for _ in range(1)))  # chunked, no length
    assert r.status_code == 413
    assert httpx.get(url + "/v1/completions").status_code == 405
    r = httpx.get(url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    for value in (b"NaN", b"Infinity", b"1e999"):
        r = httpx.post(url + "/v1/completions", content=b'{"model": "ar-small", "prompt": "x", "temperature": %s}' % value)
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    # a top_p below float32's range used to leave no token to sample from (a 500): it keeps the most likely one
    r = httpx.post(url + "/v1/completions", json={"model": "ar-small", "prompt": "x", "max_tokens": 4, "temperature": 1.0,
                                                   "top_p": 1e-300})
    greedy = httpx.post(url + "/v1/completions", json={"model": "ar-small", "prompt": "x", "max_tokens": 4,
                                                        "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_openai_client_sees_errors_as_its_exceptions(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="mdlm-small", prompt="x", max_tokens=4, extra_body={"sampler": "fast"})
    assert "sampler" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=4)
    r = client.completions.create(model="mdlm-small", prompt="x", max_tokens=8,
                                  extra_body={"sampler": "entropy_bound", "entropy_bound": 2.0, "steps": 4})
    assert r.model_extra["dlm"]["steps"] <= 4  # 8 tokens in one block, at most 4 steps


def test_api_key(engine):
    with running(create_app(engine, api_key="s3cret")) as base:
        assert httpx.get(base + "/health").status_code == 200  # liveness stays open
        r = httpx.get(base + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="ar-small", prompt="x", max_tokens=2).choices[0].text


# the command ---------------------------------------------------------------------------------------------

def test_dlm_serve_command_starts_and_stops(capsys):
    from dlm.cli import main

    assert main(["serve", "--model", str(CK / "dflash-small")]) == 2
    err = capsys.readouterr().err
    assert "drafter" in err and "--draft" in err
    assert main(["serve", "--model", str(CK / "ar-small"), "--max-queue", "-1"]) == 2
    assert main(["serve", "--model", str(CK / "ar-small"), "--prefix-cache-mb", "-1"]) == 2
    assert "--prefix-cache-mb must be >= 0" in capsys.readouterr().err
    proc, base = start_server(["--model", str(CK / "ar-small"), "--model", str(CK / "mdlm-small")])
    try:
        assert base.startswith("http://127.0.0.1:")
        h = httpx.get(base + "/health").json()
        assert h["models"] == ["ar-small", "mdlm-small"]
        assert "dlm playground" in httpx.get(base + "/").text
        assert httpx.get(base + "/static/app.js").headers["content-type"].startswith("text/javascript")
    finally:
        proc.send_signal(2)
        assert proc.wait(timeout=30) in (0, 130, -2)


# the playground in a real browser ------------------------------------------------------------------------

def test_playground_races_every_paradigm_in_chromium(url):
    from chromium import Browser, find_chromium

    if find_chromium() is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium): the playground's browser test is skipped")
    with Browser(1280, 800) as b:
        b.goto(url + "/?race=1&max_tokens=16")
        b.wait_for("document.body.dataset.state === 'done'", timeout=90)
        panels = b.eval("[...document.querySelectorAll('.panel')].map(p => ({title: p.querySelector('h2 span')"
                        ".textContent, text: p.querySelector('.text').textContent, error: p.classList.contains"
                        "('error'), meta: p.querySelector('.meta').textContent}))")
        assert [p["title"] for p in panels] == ["ar-small", "mdlm-small", "usdm-small", "ar-small+dflash-small"]
        for p in panels:
            assert not p["error"] and p["text"].strip(), p
            assert "tok/s" in p["meta"] and "tok/fwd" in p["meta"], p
        assert "tau" in panels[3]["meta"] and "steps" in panels[1]["meta"]
        # a temperature goes to every chosen model: usdm's panel scales its schedule by it, as the others sample
        b.goto(url + "/?race=1&max_tokens=8&temperature=0.7&models=usdm-small,ar-small,mdlm-small")
        b.wait_for("document.body.dataset.state === 'done'", timeout=90)
        warm = b.eval("[...document.querySelectorAll('.panel')].map(p => [p.querySelector('h2 span').textContent, "
                      "p.classList.contains('error'), p.querySelector('.text').textContent])")
        assert [w[0] for w in warm] == ["ar-small", "mdlm-small", "usdm-small"], warm
        assert all(not err and text.strip() for _, err, text in warm), warm
        # an infilling race: the diffusion panels fill the middle; the AR panels say why they cannot
        b.goto(url + "/?race=1&max_tokens=8&models=mdlm-small,ar-small&suffix=%0Areturn%20x%0A")
        b.wait_for("document.body.dataset.state === 'done'", timeout=60)
        errors = b.eval("[...document.querySelectorAll('.panel')].map(p => p.classList.contains('error'))")
        assert errors == [True, False]  # (panels in the order of /v1/models: ar-small, mdlm-small)


# load numbers (slow: `pytest -m slow`; the figures in docs/BENCHMARKS.md come from `python -m dlm.serve.loadtest`)

def test_percentiles_and_table():
    from dlm.serve.loadtest import percentile, table

    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 50) == 50.0 and percentile(xs, 99) == 99.0 and percentile([3.0], 99) == 3.0
    row = {"model": "m", "concurrency": 4, "requests": 8, "tokens_per_second": 10.0, "latency_p50": 1.0,
           "latency_p99": 2.0, "ttft_p50": None, "errors": 0}
    assert table([row]).splitlines()[2] == "| m | 4 | 8 | 10.0 | 1.00 | 2.00 | – | – | 0 |"



def test_a_paused_process_is_stopped_for_the_timed_part_and_one_that_ended_is_left_alone():
    """loadtest.paused (the scripts' --pause): the background process is stopped inside, running again after; a
    process that has ended (a training run that finished mid-way) is no error."""
    import subprocess

    from dlm.serve.loadtest import paused

    def state(pid: int, want: str) -> str:  # (a signal lands a moment after it is sent)
        for _ in range(200):
            s = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if s in want:
                break
            time.sleep(0.01)
        return s

    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert state(proc.pid, "S") == "S"
        with paused(proc.pid):
            assert state(proc.pid, "T") == "T"
        assert state(proc.pid, "RS") in "RS"
    finally:
        proc.kill()
        proc.wait()
    with paused(proc.pid):  # (ended and reaped: no such process)
        pass
    with paused(None):
        pass

@pytest.mark.slow
def test_batching_raises_ar_throughput_at_16_over_1(url):
    from dlm.serve.loadtest import default_prompts, measure

    prompts = default_prompts(16)
    one = measure(url, "ar-small", 1, 8, 48, prompts)
    many = measure(url, "ar-small", 16, 48, 48, prompts)
    assert one["errors"] == many["errors"] == 0
    # (the warm-up's steps, one row each, not counted: 14.9 of 16 here)
    assert one["rows_per_step"] == 1.0 and many["rows_per_step"] > 12.5, many
    assert many["tokens_per_second"] > 1.5 * one["tokens_per_second"], (one, many)
