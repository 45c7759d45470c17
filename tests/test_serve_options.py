"""Every shipped checkpoint served, every option it reads accepted, one it does not read refused.

A real uvicorn on 127.0.0.1 serves every checkpoint in checkpoints/ (each paradigm, and an AR target with each kind
of drafter); each model id gets one request with every dlm option its paradigm reads (dlm.sampling.OPTIONS, the
one table): 200; and one request with an option it does not read: 400 naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from dlm.sampling import OPTIONS  # noqa: E402
from dlm.serve.app import create_app, running  # noqa: E402
from dlm.serve.engine import Engine  # noqa: E402
from dlm.serve.protocol import served_options  # noqa: E402
from dlm.sampling.speculative import DRAFTER_OPTIONS, kind_reads  # noqa: E402

CK = Path(__file__).resolve().parents[1] / "checkpoints"
SHIPPED = sorted(p.name for p in CK.iterdir() if (p / "config.json").exists())
DRAFTERS = ["dflash-small", "dflash2-small", "ar-draft", "lookup", "dflash2-small+lookup"]
OWN_TARGET = {"dflash2-mid": "ar-mid"}  # drafters of another target than ar-small

# a valid value of each option, per paradigm where it differs (small sizes: each request is fast)
VALUES = {"top_k": 5, "steps": 4, "threshold": 0.8, "entropy_bound": 0.2, "block_size": 4, "remasking": "random",
          "canvas_length": 8, "t_max": 0.9, "t_min": 0.3, "stability_threshold": 2, "confidence_threshold": 0.01,
          "adaptive": False, "fill_length": 4, "draft_passes": 2, "draft_top_k": 32, "draft_branches": 2, "lookup_ngram": 2,
          "preset": "none", "prefix_cache": False, "dual_cache": False, "sub_block": 2, "schedule": "even", "whole_blocks": True,
          "generation_config": "none", "entropy_form": "eb"}
SAMPLER = {"ar": "ar", "mdlm": "confidence", "usdm": "entropy_bound", "joint": "self-spec-linear"}


pytestmark = pytest.mark.usefixtures("one_thread")


def served_ids() -> list[tuple[str, list[str], str | None]]:
    """(model id, the engine's models, its --draft) for every shipped checkpoint and drafter kind."""
    out = []
    for name in SHIPPED:
        if name in DRAFTERS or name in OWN_TARGET:
            continue
        out.append((name, [name], None))
    for d in DRAFTERS + ["mdlm-small"]:  # mdlm-small: a model served on its own and a diffusion drafter
        out.append((f"ar-small+{d}", ["ar-small"], d))
    for d, target in OWN_TARGET.items():
        out.append((f"{target}+{d}", [target], d))
    return out


def test_every_shipped_checkpoint_is_covered():
    from dlm.checkpoint import open_checkpoint

    paradigms = {open_checkpoint(CK / n).objective for n in SHIPPED}
    assert {"ar", "mdlm", "usdm", "joint", "dflash"} <= paradigms
    assert {n for n in SHIPPED if open_checkpoint(CK / n).objective == "dflash"} <= set(DRAFTERS) | set(OWN_TARGET)
    assert set(OPTIONS) == {"ar", "mdlm", "usdm", "joint", "speculative"}


def _body(model: str, paradigm: str, **extra) -> dict:
    prompt = "def f(x):\n    return" if not model.startswith("sudoku") else "1234"
    return {"model": model, "prompt": prompt, "max_tokens": 8, **extra}


@pytest.mark.parametrize("model,models,draft", served_ids(), ids=[s[0] for s in served_ids()])
def test_every_option_a_paradigm_reads_is_accepted_and_others_refused(model, models, draft):
    engine = Engine([str(CK / m) for m in models], draft=None if draft is None else
                    ("lookup" if draft == "lookup" else str(CK / draft)))
    try:
        served = engine.get(model)
        assert served is not None, sorted(engine.models)
        allowed = set(served_options(served.paradigm))
        kind = served.drafter.kind if served.drafter is not None else None
        own = allowed - {o for o, (k, _) in DRAFTER_OPTIONS.items() if not kind_reads(kind, k)}  # less another's options
        with running(create_app(engine, max_concurrency=4, max_queue=4)) as url:
            opts = {o: VALUES.get(o) for o in own if o != "sampler"}
            if draft in ("dflash2-small", "dflash2-mid", "dflash2-small+lookup"):  # a DFlash 2 selector drafts in one pass (2 is refused, with a 400)
                opts["draft_passes"] = 1
            if draft == "dflash-small":  # a DFlash 1 drafter has no candidates to widen: a 400 naming the field
                body = _body(model, "speculative", draft_top_k=opts.pop("draft_top_k"))
                r = httpx.post(url + "/v1/completions", json=body, timeout=120)
                assert r.status_code == 400 and "draft_top_k" in r.json()["error"]["message"], r.text
            if "sampler" in own:
                opts["sampler"] = SAMPLER[served.paradigm]
            body = _body(model, served.paradigm, **opts)
            if "fill_length" in opts:
                body["prompt"] += "<fill>\n"  # fill_length sizes a <fill> marker
            if served.paradigm == "joint":  # the diffusion-mode options with a diffusion sampler
                body["sampler"] = "confidence"
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, (sorted(opts), r.text)
            assert r.json()["choices"][0]["text"] is not None
            if served.paradigm == "joint":  # and self-speculation with its own
                body = _body(model, "joint", sampler="self-spec-linear", block_size=4, top_k=5)
                r = httpx.post(url + "/v1/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
            # an option this id does not read: 400 naming it
            foreign = sorted(set(VALUES) - own)
            assert foreign, model
            for name in foreign[:2]:
                r = httpx.post(url + "/v1/completions", json=_body(model, served.paradigm, **{name: VALUES[name]}),
                               timeout=120)
                assert r.status_code == 400, (name, r.text)
                err = r.json()["error"]
                assert err["param"] == name and name in err["message"]
    finally:
        engine.close()


def test_a_fim_trained_ar_checkpoint_infills_through_the_server():
    from dlm.sampling import SampleConfig, generate

    engine = Engine([str(CK / "ar-small-fim"), str(CK / "ar-small")])
    try:
        s = engine.get("ar-small-fim")
        prefix, suffix = "def add(a, b):\n    return", "\n\nprint(add(1, 2))\n"
        full = generate(s.model, s.ck, prefix, SampleConfig(max_new_tokens=12, suffix=suffix)).text
        with running(create_app(engine, max_concurrency=4, max_queue=4)) as url:
            r = httpx.post(url + "/v1/completions", json={"model": "ar-small-fim", "prompt": prefix, "suffix": suffix,
                                                          "max_tokens": 12, "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] + suffix == full  # the middle alone, as OpenAI's suffix returns
            r = httpx.post(url + "/v1/completions", json={"model": "ar-small", "prompt": prefix, "suffix": suffix,
                                                          "max_tokens": 12}, timeout=120)
            assert r.status_code == 400 and "cannot infill" in r.json()["error"]["message"]
    finally:
        engine.close()


def test_alg_temp_is_served_and_a_bad_one_refused():
    """Dream's alg_temp through a real request: the positions drawn with the request's seed (the same text twice, the
    library's text); a negative one, or one with a sampler that takes no top k: 400 naming it."""
    from dlm.sampling import SampleConfig, generate

    engine = Engine([str(CK / "mdlm-small")])
    try:
        s = engine.get("mdlm-small")
        cfg = SampleConfig(max_new_tokens=8, alg_temp=0.5, seed=3, temperature=0.7, steps=8)
        want = generate(s.model, s.ck, "def f(x):\n    return", cfg).text
        with running(create_app(engine, max_concurrency=2, max_queue=2)) as url:
            body = _body("mdlm-small", "mdlm", alg_temp=0.5, seed=3, temperature=0.7, steps=8)
            texts = [httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
                     for _ in range(2)]
            assert texts == [want, want]
            for bad in ({"alg_temp": -1.0}, {"alg_temp": 0.5, "sampler": "threshold"}):
                r = httpx.post(url + "/v1/completions", json=_body("mdlm-small", "mdlm", **bad), timeout=120)
                assert r.status_code == 400 and "alg-temp" in r.json()["error"]["message"].replace("_", "-"), r.text
    finally:
        engine.close()
