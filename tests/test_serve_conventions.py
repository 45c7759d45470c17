"""What OpenAI clients bring, against a real `dlm serve` process: the official `openai` client with its own
defaults (no temperature: OpenAI's 1), temperature 1 and 0.7 as client libraries send them, and a field the API
does not know (ignored and named, not refused), on every served paradigm: ar, mdlm, usdm, speculative, joint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import start_server

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parent.parent
CK = ROOT / "checkpoints"
PARADIGMS = {"ar-small": "ar", "mdlm-small": "mdlm", "usdm-small": "usdm", "joint-small": "joint",
             "ar-small+dflash-small": "speculative"}


@pytest.fixture(scope="module")
def base():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc, url = start_server(["--model", str(CK / "ar-small"), str(CK / "mdlm-small"), str(CK / "usdm-small"),
                              str(CK / "joint-small"), "--draft", str(CK / "dflash-small"), "--threads", "1"], env=env)
    try:
        yield url, proc
    finally:
        proc.send_signal(2)
        proc.wait(timeout=30)


def test_the_openai_client_with_its_defaults_gets_200_from_every_paradigm(base):
    url, _ = base
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    served = {m.id: m.model_extra["dlm"]["paradigm"] for m in client.models.list().data}
    assert served == PARADIGMS
    for model, paradigm in PARADIGMS.items():
        # the client's defaults: model and prompt (or messages) and nothing else but a short budget
        r = client.completions.create(model=model, prompt="def main(", max_tokens=8)
        assert r.choices[0].finish_reason in ("length", "stop") and r.model_extra["dlm"]["paradigm"] == paradigm
        c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Sort a list."}],
                                           max_tokens=8)
        assert c.choices[0].message.role == "assistant"
        for t in (1.0, 0.7, 0.0):  # what client libraries send; usdm scales its schedule by it
            r = client.completions.create(model=model, prompt="import ", max_tokens=6, temperature=t, seed=3)
            assert r.usage.completion_tokens >= 1, (model, t)


def test_the_default_temperature_is_openais_and_0_is_greedy(base):
    url, _ = base
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model="ar-small", prompt="def read_config(path):\n    ", max_tokens=12)
    greedy = {client.completions.create(**kw, temperature=0, seed=s).choices[0].text for s in range(3)}
    assert len(greedy) == 1  # greedy: the seed does not matter
    sampled = {client.completions.create(**kw, seed=s).choices[0].text for s in range(3)}
    assert sampled == {client.completions.create(**kw, temperature=1.0, seed=s).choices[0].text for s in range(3)}
    assert len(sampled) > 1  # no temperature = 1.0: three seeds, three samples


def test_usdm_temperature_scales_its_schedule(base):
    url, _ = base
    body = {"model": "usdm-small", "prompt": "def f(x):\n    ", "max_tokens": 8, "seed": 1, "steps": 8}
    same = [httpx.post(url + "/v1/completions", json={**body, **t}, timeout=120).json()["choices"][0]["text"]
            for t in ({}, {"temperature": 1.0}, {"temperature": 0}, {"t_max": 0.8, "t_min": 0.4})]
    assert len(set(same)) == 1  # 1 and 0 leave the schedule (default 0.8 -> 0.4) as it is
    half = httpx.post(url + "/v1/completions", json={**body, "temperature": 0.5}, timeout=120).json()
    explicit = httpx.post(url + "/v1/completions", json={**body, "t_max": 0.4, "t_min": 0.2}, timeout=120).json()
    assert half["choices"][0]["text"] == explicit["choices"][0]["text"]  # 0.5 x (0.8 -> 0.4)
    r = httpx.post(url + "/v1/completions", json={**body, "temperature": 1e-5}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


def test_unknown_fields_are_ignored_and_named(base):
    url, proc = base
    body = {"model": "mdlm-small", "prompt": "x = ", "max_tokens": 4, "temperature": 0, "reasoning_effort": "low",
            "metadata": {"a": 1}}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.headers["x-dlm-ignored-fields"] == "metadata, reasoning_effort", r.text
    plain = httpx.post(url + "/v1/completions", json={k: body[k] for k in ("model", "prompt", "max_tokens",
                                                                              "temperature")}, timeout=120)
    assert plain.json()["choices"] == r.json()["choices"] and "x-dlm-ignored-fields" not in plain.headers
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "model": "ar-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
            "service_tier": "auto"}) as s:
        assert s.status_code == 200 and s.headers["x-dlm-ignored-fields"] == "service_tier"
        s.read()
    odd = httpx.post(url + "/v1/completions", json={"model": "ar-small", "prompt": "x", "max_tokens": 1, "é\nx": 1},
                     timeout=120)
    assert odd.status_code == 200 and odd.headers["x-dlm-ignored-fields"] == "\\xe9\\nx", odd.headers  # printable ASCII
    many = httpx.post(url + "/v1/completions", json={"model": "ar-small", "prompt": "x", "max_tokens": 1,
                                                    **{f"f{i:02d}": i for i in range(20)}}, timeout=120)
    assert many.headers["x-dlm-ignored-fields"] == ", ".join(f"f{i:02d}" for i in range(16)) + ", ... 4 more"
    # a field of the API that dlm does not support is still refused with its reason, and a wrong type too
    assert httpx.post(url + "/v1/completions", json={**body, "logit_bias": {"1": 2}}, timeout=60).status_code == 400
    assert httpx.post(url + "/v1/completions", json={**body, "max_tokens": "4"}, timeout=60).status_code == 400
