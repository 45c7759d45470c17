"""An imported model's generation_config.json sets its sampling defaults, as transformers' `generate` reads them.

The differential test: a tiny transformers model drawn as in tests/test_parity_sampled.py (Qwen2, Qwen3, Llama,
Ministral 3; random configs and tokenizers), saved with a generation_config.json that samples (do_sample true with
drawn temperature / top_k / top_p, each possibly left out: transformers' 1.0 / 50 / 1.0) or does not (do_sample
false: greedy), imported with `dlm import --hf`; `dlm generate` with no sampling option but `--seed S` writes the
tokens of transformers' `model.generate(**inputs)` after `torch.manual_seed(S)`. An option given on the command line
(`--temperature 0`) or in a request wins, `--generation-config none` ignores the file, and the server's request
without a temperature follows the file too (a real HTTP client against a real uvicorn)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
hypothesis = pytest.importorskip("hypothesis")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from hypothesis import Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import test_parity_hf as parity  # noqa: E402
import test_parity_sampled as sampled  # noqa: E402
from conftest import cli  # noqa: E402
from dlm.checkpoint import load_model  # noqa: E402
from dlm.config import SampleConfig  # noqa: E402
from dlm.sampling import generate, stream, with_model_defaults  # noqa: E402
from dlm.sampling.common import Commit  # noqa: E402
from dlm.sampling.common import before_eos  # noqa: E402
from hfbuild import assert_same_greedy, hf_greedy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["qwen2", "qwen3", "llama", "ministral3"]


def hf_default(model, ids: list[int], n: int, seed: int) -> list[int]:
    """`model.generate(**inputs)`: no sampling option, the generation_config's own, torch's generator seeded first."""
    x = torch.tensor([ids])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()


def folder(family: str, case: dict, gen: dict | None, seed: int, tmp):
    """The case's hub folder (sampling generation_config with gen's keys; None: do_sample false), imported."""
    if gen is None:
        src, _ = parity.build(family, case, tmp / "hf")
    else:
        src, _ = sampled.build(family, case, gen, seed, tmp / "hf")
    cli("import", "--hf", str(src), "--out", str(tmp / "ck"), check=True)
    return src, tmp / "ck"


def dlm_text(ck, prompt: str, n: int, *flags: str) -> str:
    ran = cli("generate", "--model", str(ck), "--prompt", prompt, "--max-new-tokens", str(n), "--json", *flags,
              check=True)
    return json.loads(ran.stdout)["text"]


@st.composite
def drawn(draw):
    family = draw(st.sampled_from(FAMILIES))
    case = draw(parity.cases(family))
    gen = draw(st.none() | sampled.sampling().map(lambda g: {k: v for k, v in g.items() if v is not None}))
    return family, case, gen, draw(st.integers(0, 2**31 - 1))


@settings(parity.SETTINGS, max_examples=6, phases=[Phase.explicit, Phase.generate])
@given(d=drawn())
def test_generate_samples_at_the_generation_config_defaults(d, tmp_path_factory):
    family, case, gen, seed = d
    tmp = tmp_path_factory.mktemp(family)
    src, ckp = folder(family, case, gen, seed, tmp)
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    assert model.generation_config.do_sample is (gen is not None)
    ids = AutoTokenizer.from_pretrained(src)(case["prompt"])["input_ids"]
    theirs = hf_default(model, ids, case["new"], seed)
    net, ck = load_model(str(ckp))
    cfg = with_model_defaults(ck, SampleConfig(max_new_tokens=case["new"], seed=seed))
    res = generate(net, ck, case["prompt"], cfg)
    if gen is None:  # greedy: equal, or up to an fp32 tie transformers' own logits show
        assert cfg.temperature == 0
        assert_same_greedy(model, ids, res.tokens[0], theirs)
    else:
        assert res.tokens[0] == theirs
    # `dlm generate` with no sampling option: the same text
    assert dlm_text(ckp, case["prompt"], case["new"], "--seed", str(seed)) == res.text


# one fixed model for the rest: Qwen3's shipped shape of defaults (do_sample, temperature 0.6, top_k 20, top_p 0.95)
CASE = dict(config=dict(vocab_size=400, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_key_value_heads=1, num_attention_heads=2, head_dim=16, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, max_position_embeddings=256,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
            specials={"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}, post="", eos_tok=True, eos_at=[],
            prompt="def main(argv):", new=12, seed=5, std=0.3)
GEN = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
SEEDS = [3, 11]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(transformers' model, its prompt ids, the dlm checkpoint folder, its tokenizer) of CASE with GEN."""
    tmp = tmp_path_factory.mktemp("qwen3")
    src, ckp = folder("qwen3", CASE, GEN, 0, tmp)
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    _, ck = load_model(str(ckp))
    return model, AutoTokenizer.from_pretrained(src)(CASE["prompt"])["input_ids"], ckp, ck.tokenizer


def text_of(tok, tokens: list[int]) -> str:
    return tok.text(before_eos(tokens, tok.eos_set))


def test_an_option_given_wins_and_none_ignores_the_file(qwen3, tmp_path):
    model, ids, ckp, tok = qwen3
    (tmp_path / "greedy.json").write_text('{"temperature": 0}')  # a --config key is given too
    n = CASE["new"]
    greedy = text_of(tok, hf_greedy(model, ids, n))
    sampled_texts = {text_of(tok, hf_default(model, ids, n, s)) for s in SEEDS}
    assert sampled_texts != {greedy}  # (the case samples something else than greedy: the checks below can fail)
    for s in SEEDS:
        assert dlm_text(ckp, CASE["prompt"], n, "--seed", str(s)) == text_of(tok, hf_default(model, ids, n, s))
        assert dlm_text(ckp, CASE["prompt"], n, "--seed", str(s), "--temperature", "0") == greedy
        assert dlm_text(ckp, CASE["prompt"], n, "--seed", str(s), "--generation-config", "none") == greedy
        assert dlm_text(ckp, CASE["prompt"], n, "--seed", str(s), "--config", str(tmp_path / "greedy.json")) == greedy
    bad = cli("generate", "--model", str(ckp), "--prompt", "x", "--generation-config", "vllm")
    assert bad.returncode == 2 and "--generation-config must be auto or none" in bad.stderr


def test_the_server_follows_the_file_when_a_request_leaves_temperature_out(qwen3):
    from dlm.serve.app import create_app, running
    from dlm.serve.engine import Engine

    model, ids, ckp, tok = qwen3
    n = CASE["new"]
    engine = Engine([str(ckp)])
    try:
        with running(create_app(engine, max_concurrency=2, max_queue=2)) as url:
            def complete(**extra) -> str:
                r = httpx.post(url + "/v1/completions", json={"model": ckp.name, "prompt": CASE["prompt"],
                                                               "max_tokens": n, **extra}, timeout=120)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            greedy = text_of(tok, hf_greedy(model, ids, n))
            for s in SEEDS:
                assert complete(seed=s) == text_of(tok, hf_default(model, ids, n, s))
                assert complete(seed=s, temperature=0) == greedy
            r = httpx.post(url + "/v1/completions", json={"model": ckp.name, "prompt": "x",
                                                           "generation_config": "vllm"}, timeout=120)
            assert r.status_code == 400 and "generation_config" in r.text
    finally:
        engine.close()


def test_diffusion_gemma_samples_at_its_generation_config(tmp_path):
    """A DiffusionGemma folder whose generation_config.json sets its schedule (steps, t_max -> t_min, entropy bound,
    stopping thresholds): dlm's defaults are those, and its tokens transformers' `generate()` with no option."""
    import test_diffusion_gemma_generate as dg
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    m = dg.build([dg.S, dg.F], window=4, experts=2, top_k=1, canvas=8, scale=0.3, seed=1)
    eos = [1, 5]
    src = tmp_path / "src"
    m.save_pretrained(src)
    dg.save_tokenizer(src)
    own = {"max_denoising_steps": 6, "t_min": 0.3, "t_max": 1.2, "stability_threshold": 2, "confidence_threshold": 0.05,
           "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.4}}
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "bos_token_id": 2, "pad_token_id": 0,
                                                            **own}))
    m.generation_config = DiffusionGemmaGenerationConfig.from_pretrained(src)  # what from_pretrained(src) reads
    cli("import", "--hf", str(src), "--out", str(tmp_path / "ck"), check=True)
    net, ck = load_model(str(tmp_path / "ck"))
    with torch.no_grad():  # (aligned as m's: see tests/test_diffusion_gemma_generate.py)
        for p in net.parameters():
            p.data = p.data.clone()
    cfg = with_model_defaults(ck, SampleConfig(max_new_tokens=20, seed=0))
    assert (cfg.steps, cfg.t_min, cfg.t_max, cfg.entropy_bound, cfg.stability_threshold, cfg.confidence_threshold) \
        == (6, 0.3, 1.2, 0.4, 2, 0.05)
    prompt = [2, 9, 30, 41, 17, 66, 8]
    for seed in (0, 7):
        theirs = dg.reference(m, prompt, 20, eos, seed)  # generate() with no sampling option, cut as dlm commits
        got = [t for e in stream(net, ck, [prompt], cfg.replace(seed=seed)) if isinstance(e, Commit) for t in e.tokens]
        assert got == theirs
    plain = SampleConfig(max_new_tokens=20, generation_config="none")
    assert with_model_defaults(ck, plain) == plain  # (dlm's own: transformers' global defaults)
