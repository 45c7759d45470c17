"""Several EOS ids (Gemma 4's <eos> and <end_of_turn>): an imported checkpoint keeps the list its
generation_config.json gives, every sampler and the server stop at any of them and emit nothing after it, the export
writes the list back, and a plain dlm checkpoint (one EOS id) behaves as it always did.

How a test reaches the second EOS id with random weights: generate once from a checkpoint that ends text at <eos>
alone, take a token the output reaches partway (with text after it), import the same folder again with that token as
the second EOS id, and generate again with the same seed: the output must be the first one cut right after it."""

import json

import pytest
import torch

pytest.importorskip("transformers")
from conftest import cli  # noqa: E402
from dlm.checkpoint import load_model, open_checkpoint, shipped  # noqa: E402
from dlm.sampling import SampleConfig, generate  # noqa: E402
from dlm.sampling.common import before_eos, eos_index, is_eos, through_eos  # noqa: E402
from test_diffusion_gemma import S, F, hf_diffusion_gemma  # noqa: E402
from test_gemma4 import hf_model  # noqa: E402
from test_hf_gemma import save_tokenizer  # noqa: E402

PROMPT = "a b c d e f g"
AR = SampleConfig(max_new_tokens=12)
USDM = SampleConfig(max_new_tokens=12, seed=5, steps=4, entropy_bound=0.5, t_min=0.4, t_max=0.8)


def import_with(root, which: str, eos) -> str:
    """Import the tiny random model `which` (ar: Gemma 4, usdm: DiffusionGemma, canvas 6) with eos_token_id `eos`."""
    src = root / f"{which}-src"
    if not src.exists():
        c, m = hf_model("moe-kv") if which == "ar" else hf_diffusion_gemma((S, F, S, F), canvas=6)
        m.save_pretrained(src)
        save_tokenizer(src)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "bos_token_id": 2,
                                                            "pad_token_id": 0}))
    out = root / f"{which}-{'-'.join(map(str, eos if isinstance(eos, list) else [eos]))}"
    if not out.exists():
        cli("import", "--hf", str(src), "--out", str(out), check=True)
    return str(out)


def second_eos(tokens: list[int], lo: int, hi: int) -> tuple[int, int]:
    """(k, token): the first position k in [lo, hi) whose token is an ordinary word not seen before it."""
    for k in range(lo, min(hi, len(tokens) - 1)):
        t = tokens[k]
        if t >= 7 and t not in tokens[:k]:
            return k, t
    raise AssertionError(f"no candidate for a second EOS id in {tokens}")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """For ar and usdm: (checkpoint with <eos> only, its output, checkpoint with [<eos>, t], k: where t falls)."""
    root = tmp_path_factory.mktemp("eos")
    out = {}
    for which, cfg, lo, hi in (("ar", AR, 3, 10), ("usdm", USDM, 2, 6)):  # usdm: t inside the first canvas of two
        one = import_with(root, which, 1)
        net, ck = load_model(one)
        ref = generate(net, ck, PROMPT, cfg).tokens[0]
        assert len(ref) == 12 and 1 not in ref, ref  # the probe runs to its length
        k, t = second_eos(ref, lo, hi)
        out[which] = (one, ref, import_with(root, which, [1, t]), k, t)
    return out


def test_the_helpers():
    assert through_eos([5, 6, 1, 7], (1, 6)) == ([5, 6], True)
    assert through_eos([5, 7], 1) == ([5, 7], False) and through_eos([5, 1], None) == ([5, 1], False)
    assert before_eos([5, 9, 1, 6], [6, 1]) == [5, 9] and eos_index([4, 4], 4) == 0
    assert is_eos(torch.tensor([[1, 2], [6, 7]]), (6, 1)).tolist() == [[True, False], [True, False]]
    assert not is_eos(torch.tensor([1, 2]), None).any()


@pytest.mark.parametrize("which", ["ar", "usdm"])
def test_generation_stops_at_the_second_eos_id(pair, which):
    one, ref, two, k, t = pair[which]
    net, ck = load_model(two)
    assert ck.tokenizer.eos_ids == (1, t) and ck.tokenizer.eos_id == 1
    assert json.loads((open_checkpoint(two).path / "config.json").read_text())["tokenizer"]["eos_ids"] == [1, t]
    res = generate(net, ck, PROMPT, AR if which == "ar" else USDM)
    assert res.tokens[0] == ref[:k + 1]  # the same draws, cut right after the second EOS id
    assert res.text == ck.tokenizer.decode(ref[:k]) and res.stats.new_tokens == k + 1
    if which == "usdm":  # the canvas after it is never denoised
        assert res.stats.canvases == 1
    else:
        assert res.stats.forwards == k + 1


def test_speculative_decoding_stops_at_the_second_eos_id(pair):
    """The target drafting for itself (an AR drafter): every proposal is accepted, so the EOS falls inside a block."""
    one, ref, two, k, t = pair["ar"]
    net, ck = load_model(two)
    res = generate(net, ck, PROMPT, AR.replace(draft=two, check_lossless=True))
    assert res.tokens[0] == ref[:k + 1] and res.text == ck.tokenizer.decode(ref[:k])
    assert res.stats.extra["lossless"] and res.stats.draft_forwards >= 1


def test_the_server_stream_stops_at_the_second_eos_id(pair):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from dlm.serve.app import create_app, running
    from dlm.serve.engine import Engine

    ar_two, dg_two = pair["ar"][2], pair["usdm"][2]
    engine = Engine([ar_two, dg_two])
    try:
        with running(create_app(engine, max_concurrency=2, max_queue=2)) as url:
            for path, which, opts in ((ar_two, "ar", {"temperature": 0}),
                                      (dg_two, "usdm", {"seed": 5, "steps": 4, "entropy_bound": 0.5, "t_min": 0.4,
                                                        "t_max": 0.8})):
                one, ref, two, k, t = pair[which]
                net, ck = load_model(two)
                body = {"model": path.rsplit("/", 1)[-1], "prompt": PROMPT, "max_tokens": 12,
                        "stream": True, "stream_options": {"include_usage": True}, **opts}
                chunks = []
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                    assert r.status_code == 200, r.read()
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunks.append(json.loads(line[6:]))
                text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
                assert text == ck.tokenizer.decode(ref[:k]), which
                reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
                assert reasons[-1] == "stop", which
                assert chunks[-1]["usage"]["completion_tokens"] == k + 1, which
    finally:
        engine.close()


@pytest.mark.parametrize("which", ["ar", "usdm"])
def test_export_writes_the_list_back(pair, tmp_path, which):
    one, ref, two, k, t = pair[which]
    cli("export", "--model", two, "--out", str(tmp_path / "hf"), "--format", "hf", check=True)
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == [1, t]
    cli("import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back"), check=True)
    assert open_checkpoint(tmp_path / "back").tokenizer.eos_ids == (1, t)
    # without the generation_config.json kept beside the weights, the export writes the list itself
    (open_checkpoint(two).path / "generation_config.json").rename(tmp_path / "kept.json")
    try:
        assert open_checkpoint(two).tokenizer.eos_ids == (1, t)  # config.json records it
        cli("export", "--model", two, "--out", str(tmp_path / "hf2"), "--format", "hf", check=True)
    finally:
        (tmp_path / "kept.json").rename(open_checkpoint(two).path / "generation_config.json")
    assert json.loads((tmp_path / "hf2" / "generation_config.json").read_text())["eos_token_id"] == [1, t]
    cli("import", "--hf", str(tmp_path / "hf2"), "--out", str(tmp_path / "back2"), check=True)
    assert open_checkpoint(tmp_path / "back2").tokenizer.eos_ids == (1, t)


def test_a_bad_eos_id_is_a_one_line_error(tmp_path):
    src = tmp_path / "ar-src"
    c, m = hf_model("moe-kv")
    m.save_pretrained(src)
    save_tokenizer(src)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 500]}))
    code, _, err = cli("import", "--hf", str(src), "--out", str(tmp_path / "ck"))
    assert code == 2
    err = err.strip()
    assert "eos_token_id" in err and "500" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "ck").exists()


def test_a_plain_checkpoint_keeps_its_one_eos_id(tmp_path):
    """A dlm checkpoint records no list: one EOS id, as before; generation is the one-id decoder's; export writes it
    as an id."""
    from dlm.sampling import ar

    path = shipped("ar-small")
    if path is None:
        pytest.skip("the shipped ar-small checkpoint is not present")
    net, ck = load_model(path)
    tok = ck.tokenizer
    assert tok.eos_ids == (tok.eos_id,) and tok.eos_record is None
    assert "eos_ids" not in json.loads((path / "config.json").read_text())["tokenizer"]
    ids = tok.encode("def main(")
    want = [t for e in ar.decode(net, [ids], 24, eos_id=tok.eos_id, pad_id=tok.pad_id) if hasattr(e, "tokens")
            for t in e.tokens]
    assert generate(net, ck, "def main(", SampleConfig(max_new_tokens=24)).tokens[0] == want
    cli("export", "--model", str(path), "--out", str(tmp_path / "hf"), "--format", "hf", check=True)
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == tok.eos_id
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == tok.eos_id
    cli("import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back"), check=True)
    back = open_checkpoint(tmp_path / "back")
    assert back.tokenizer.eos_ids == (tok.eos_id,) and "eos_ids" not in back.config["tokenizer"]
