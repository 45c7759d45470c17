"""`dlm import --hf` of Gemma 4 and DiffusionGemma folders that transformers saved, `dlm export --format hf`
back, and transformers loading the export: logits held to transformers', the round trip bit-identical."""

import json

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import models, pre_tokenizers  # noqa: E402
from transformers.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion  # noqa: E402
from transformers.models.gemma4 import Gemma4ForCausalLM  # noqa: E402

from conftest import cli  # noqa: E402
from dlm.checkpoint import load_model  # noqa: E402
from test_diffusion_gemma import S, F, hf_diffusion_gemma  # noqa: E402
from test_gemma4 import hf_model  # noqa: E402

CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
CHAT = "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"


def save_tokenizer(folder, vocab=97):
    """A small real tokenizer in Gemma's layout: pad 0, eos 1, bos 2, control tokens, a chat template, two EOS ids."""
    words = CONTROL + [chr(ord("a") + i) for i in range(26)] + [f"w{i}" for i in range(vocab - 26 - len(CONTROL))]
    tk = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(CONTROL)
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT, "eos_token": "<eos>",
                                                              "bos_token": "<bos>", "pad_token": "<pad>"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 6], "bos_token_id": 2,
                                                               "pad_token_id": 0}))


@pytest.mark.parametrize("which", ["ar", "usdm"])
def test_import_export_round_trip(tmp_path, which):
    if which == "ar":
        c, m = hf_model("moe-kv")
    else:
        c, m = hf_diffusion_gemma((S, F, S, F))
    src = tmp_path / "src"
    m.save_pretrained(src)
    save_tokenizer(src)
    err = cli("import", "--hf", str(src), "--out", str(tmp_path / "ck"), check=True).stderr
    assert (err.count("vision_tower") == 1) == (which == "usdm")  # the vision tower is left out, said once
    net, ck = load_model(str(tmp_path / "ck"))
    assert ck.objective == which
    assert json.loads((tmp_path / "ck" / "tokenizer_config.json").read_text())["chat_template"] == CHAT
    assert json.loads((tmp_path / "ck" / "generation_config.json").read_text())["eos_token_id"] == [1, 6]
    assert ck.tokenizer.encode("<start_of_turn>") != [5]  # control tokens typed in text stay text
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if which == "ar":
            torch.testing.assert_close(net(ids).logits, m(ids).logits, atol=1e-5, rtol=1e-5)
        else:
            enc = m.model.encoder(input_ids=ids)
            torch.testing.assert_close(net(ids).logits, torch.tanh(m.lm_head(enc.last_hidden_state) / 30) * 30,
                                       atol=1e-5, rtol=1e-5)
    cli("export", "--model", str(tmp_path / "ck"), "--out", str(tmp_path / "hf"), "--format", "hf", check=True)
    cls = Gemma4ForCausalLM if which == "ar" else DiffusionGemmaForBlockDiffusion
    back = cls.from_pretrained(tmp_path / "hf").eval()
    ref = {k: v for k, v in m.state_dict().items() if "vision" not in k}
    got = back.state_dict()
    for k, v in ref.items():  # every text tensor of the source, bit for bit
        assert torch.equal(got[k], v), k
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"] == CHAT
    cli("import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck2"), check=True)
    a, b = load_file(tmp_path / "ck" / "model.safetensors"), load_file(tmp_path / "ck2" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("seed,steps,bound", [(0, 6, 0.1), (7, 4, 3.0)])
def test_generate_matches_transformers_generate(tmp_path, seed, steps, bound):
    """One seed, one output: dlm's usdm sampler on the imported model draws the canvas noise, the samples and the
    re-noise in transformers' order (randint canvas; per step multinomial, then randint), so the tokens are equal."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    from dlm.sampling import SampleConfig, stream
    from dlm.sampling.common import Commit

    c, m = hf_diffusion_gemma((S, F, S, F), canvas=6)
    src = tmp_path / "src"
    m.save_pretrained(src)
    save_tokenizer(src)
    cli("import", "--hf", str(src), "--out", str(tmp_path / "ck"), check=True)
    net, ck = load_model(str(tmp_path / "ck"))
    prompt = [2, 10, 11, 12, 13, 14, 15, 16]  # longer than the sliding window (5)
    torch.manual_seed(seed)
    with torch.no_grad():
        ref = m.generate(torch.tensor([prompt]), max_new_tokens=12, max_denoising_steps=steps, t_min=0.4, t_max=0.8,
                         sampler_config=EntropyBoundSamplerConfig(entropy_bound=bound), stability_threshold=1,
                         confidence_threshold=0.005, eos_token_id=1, pad_token_id=0, disable_compile=True)
    ref = (ref.sequences if hasattr(ref, "sequences") else ref)[0, len(prompt):].tolist()
    if 1 in ref:
        ref = ref[:ref.index(1) + 1]
    cfg = SampleConfig(max_new_tokens=12, steps=steps, seed=seed, entropy_bound=bound, t_min=0.4, t_max=0.8,
                       stability_threshold=1, confidence_threshold=0.005)
    got = [t for e in stream(net, ck, [prompt], cfg) if isinstance(e, Commit) for t in e.tokens]
    assert len(got) >= 6 and len(set(got)) > 2 and got == ref


@pytest.mark.parametrize("lora", [False, True])
def test_fine_tune_an_imported_diffusion_gemma_and_export_it(tmp_path, lora):
    """Import -> `dlm train --objective usdm --init-from` (full, with the routers frozen; or LoRA adapters through peft)
    -> the checkpoint learns (held-out loss falls), changes only what it may, keeps the chat template and EOS ids ->
    `dlm export --format hf` -> transformers' DiffusionGemma loads it and computes dlm's logits."""
    import random

    c, m = hf_diffusion_gemma((S, F, S, F), canvas=4)
    src = tmp_path / "src"
    m.save_pretrained(src)
    save_tokenizer(src)
    cli("import", "--hf", str(src), "--out", str(tmp_path / "ck"), check=True)
    rng = random.Random(0)  # a task with structure: runs of consecutive letters
    lines = []
    for _ in range(300):
        a = rng.randrange(0, 14)
        lines.append(" ".join(chr(ord("a") + a + i) for i in range(12)))
    (tmp_path / "abc.txt").write_text("\n".join(lines))
    extra = ["--lora-rank", "8", "--lr", "3e-2"] if lora else ["--freeze-router", "--lr", "1e-2"]
    cli("train", "--objective", "usdm", "--init-from", str(tmp_path / "ck"), "--data", str(tmp_path / "abc.txt"),
        "--seq-len", "32", "--canvas-length", "4", "--batch-size", "8", "--max-steps", "30",
        "--eval-every", "30", "--eval-batches", "2", "--log-every", "10", "--quiet", "--out", str(tmp_path / "ft"),
        *extra, check=True)
    rows = [json.loads(x) for x in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < 0.9 * losses[0], losses  # it learns the task
    a, b = load_file(tmp_path / "ck" / "model.safetensors"), load_file(tmp_path / "ft" / "model.safetensors")
    assert a.keys() == b.keys()
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert changed and not any(".router." in k for k in changed)
    if lora:  # the adapters' layers only, merged into their weights
        assert all(k.rsplit(".", 2)[-2].endswith("_proj") and ".experts." not in k for k in changed), \
            [k for k in changed if not k.rsplit(".", 2)[-2].endswith("_proj") or ".experts." in k]
        assert json.loads((tmp_path / "ft" / "config.json").read_text())["lora"]["rank"] == 8
    assert json.loads((tmp_path / "ft" / "generation_config.json").read_text())["eos_token_id"] == [1, 6]
    cli("export", "--model", str(tmp_path / "ft"), "--out", str(tmp_path / "hf"), "--format", "hf", check=True)
    back = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "hf").eval()
    net, _ = load_model(str(tmp_path / "ft"))
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        enc = back.model.encoder(input_ids=ids)
        torch.testing.assert_close(net(ids).logits, torch.tanh(back.lm_head(enc.last_hidden_state) / 30) * 30,
                                   atol=1e-5, rtol=1e-5)


def test_an_imported_diffusion_gemma_is_served_beside_its_ar_sibling(tmp_path):
    """`dlm serve` of an imported DiffusionGemma and an imported Gemma 4 (one tokenizer): a real HTTP client gets the
    tokens the library's sampler gives for the same seed and DiffusionGemma's options; an option of another
    paradigm is refused with a 400 that names it. DiffusionGemma's requests are rows of the row batcher: two sent
    together, and two prompts of one request, each get the text they get alone."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from dlm.sampling import SampleConfig, generate
    from dlm.serve.app import create_app, running
    from dlm.serve.engine import Engine, RowsBatcher

    for name, (c, m) in (("dg", hf_diffusion_gemma((S, F, S, F), canvas=6)), ("g4", hf_model("moe-kv"))):
        m.save_pretrained(tmp_path / f"{name}-src")
        save_tokenizer(tmp_path / f"{name}-src")
        cli("import", "--hf", str(tmp_path / f"{name}-src"), "--out", str(tmp_path / name), check=True)
    engine = Engine([str(tmp_path / "dg"), str(tmp_path / "g4")])
    try:
        s = engine.get("dg")
        assert s.paradigm == "usdm" and engine.get("g4").paradigm == "ar" and isinstance(s.rows, RowsBatcher)
        opts = {"steps": 4, "entropy_bound": 0.5, "t_min": 0.4, "t_max": 0.8}
        want = generate(s.model, s.ck, "a b c d e f g", SampleConfig(max_new_tokens=12, seed=5, **opts)).text
        prompts = ["a b c d e f g", "h i"]  # longer and shorter than the sliding window (5)
        alone = [generate(s.model, s.ck, p, SampleConfig(max_new_tokens=18, seed=3, **opts)).text for p in prompts]
        with running(create_app(engine, max_concurrency=2, max_queue=2)) as url:
            r = httpx.post(url + "/v1/completions", json={"model": "dg", "prompt": "a b c d e f g", "max_tokens": 12,
                                                         "seed": 5, **opts}, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
            go = threading.Barrier(2)

            def one(p: str) -> str:
                go.wait()
                r = httpx.post(url + "/v1/completions", json={"model": "dg", "prompt": p, "max_tokens": 18, "seed": 3,
                                                             **opts}, timeout=120)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            with ThreadPoolExecutor(2) as pool:
                assert list(pool.map(one, prompts)) == alone
            r = httpx.post(url + "/v1/completions", json={"model": "dg", "prompt": prompts, "max_tokens": 18, "seed": 3,
                                                         **opts}, timeout=120)
            assert [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] == alone
            assert httpx.get(url + "/health").json()["batching"]["dg"]["max_rows"] == 2  # (rows of one batch)
            r = httpx.post(url + "/v1/completions", json={"model": "dg", "prompt": "a b", "max_tokens": 4,
                                                         "draft_passes": 2}, timeout=120)
            assert r.status_code == 400 and r.json()["error"]["param"] == "draft_passes"
            r = httpx.post(url + "/v1/completions", json={"model": "g4", "prompt": "a b c", "max_tokens": 4},
                           timeout=120)
            assert r.status_code == 200, r.text
    finally:
        engine.close()


def test_a_dflash_drafter_on_an_imported_gemma4_target(tmp_path):
    """`dlm train --objective dflash --target` an imported Gemma 4: plain draft layers at its width that read its
    taps, its embedding scale (sqrt(D)) and its logit soft-cap, as public Gemma 4 drafters do; speculative decoding
    with it gives the target's own greedy tokens."""
    from dlm.sampling import SampleConfig, generate

    c, m = hf_model("moe-kv")
    m.save_pretrained(tmp_path / "src")
    save_tokenizer(tmp_path / "src")
    cli("import", "--hf", str(tmp_path / "src"), "--out", str(tmp_path / "g4"), check=True)
    (tmp_path / "t").mkdir()
    for f in range(20):
        (tmp_path / "t" / f"{f}.txt").write_text(
            "\n".join(" ".join("abcdefgh"[(i + j) % 8] for j in range(10)) for i in range(f, f + 10)))
    cli("train", "--objective", "dflash", "--target", str(tmp_path / "g4"), "--data", str(tmp_path / "t"),
        "--seq-len", "32", "--batch-size", "4", "--block-size", "4", "--max-steps", "4", "--quiet",
        "--distill-logits", "--out", str(tmp_path / "df"), check=True)
    d = json.loads((tmp_path / "df" / "config.json").read_text())
    assert not d["model"]["layer_types"] and not d["model"]["sandwich_norm"] and d["model"]["moe"] is None
    assert d["dflash"]["input_embedding_scale"] == pytest.approx(c.hidden_size ** 0.5)
    assert d["dflash"]["final_logit_softcapping"] == c.final_logit_softcapping
    net, ck = load_model(str(tmp_path / "g4"))
    for prompt in ("a b c d", "e f g h a b"):
        ar = generate(net, ck, prompt, SampleConfig(max_new_tokens=16)).text
        spec = generate(net, ck, prompt, SampleConfig(max_new_tokens=16, draft=str(tmp_path / "df"),
                                                      check_lossless=True))
        assert spec.text == ar and spec.stats.draft_forwards >= 1, spec.stats


def test_concurrent_requests_to_an_imported_gemma4_share_forwards(tmp_path):
    """The row batcher holds a gemma4 backbone's cache (one buffer per layer: sliding layers of head dim 8 and 2 KV
    heads, full ones of 16 and 1; each row's sliding layers a band of its own positions): concurrent streams to an
    imported Gemma 4 share forwards, and each gets the text it gets alone, with prompts shorter and longer than the
    sliding window (5), some arriving while others decode. The library's batch of prompts likewise."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from dlm.sampling import SampleConfig, generate
    from dlm.serve.app import create_app, running
    from dlm.serve.engine import Engine, RowsBatcher

    c, m = hf_model("moe-kv")
    m.save_pretrained(tmp_path / "src")
    save_tokenizer(tmp_path / "src")
    cli("import", "--hf", str(tmp_path / "src"), "--out", str(tmp_path / "g4"), check=True)
    first = ["a b", "c d e f g h i", "j k l"]
    later = ["m n o p q r s t u v w x y z a b c d e", "f", "g h i j k l m n o p"]
    budget = {p: 10 + 3 * i for i, p in enumerate(first + later)}  # rows end at different steps
    net, ck = load_model(str(tmp_path / "g4"))
    want = {p: generate(net, ck, p, SampleConfig(max_new_tokens=budget[p])).text for p in first + later}
    batch = generate(net, ck, first + later, SampleConfig(max_new_tokens=12))  # the library's batch
    assert batch.texts == [generate(net, ck, p, SampleConfig(max_new_tokens=12)).text for p in first + later]
    engine = Engine([str(tmp_path / "g4")])
    try:
        assert isinstance(engine.get("g4").rows, RowsBatcher)
        with running(create_app(engine, max_concurrency=8, max_queue=8)) as url:
            started = threading.Event()
            go = threading.Barrier(len(first))

            def one(p: str, wait: bool) -> str:
                if wait:
                    started.wait(60)
                else:
                    go.wait()
                text = ""
                body = {"model": "g4", "prompt": p, "max_tokens": budget[p], "stream": True, "temperature": 0}
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                    assert r.status_code == 200, r.read()
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            text += json.loads(line[6:])["choices"][0]["text"]
                            started.set()
                return text

            with ThreadPoolExecutor(len(first) + len(later)) as pool:
                futures = {p: pool.submit(one, p, p in later) for p in first + later}
                got = {p: f.result() for p, f in futures.items()}
            stats = httpx.get(url + "/health").json()["batching"]["g4"]
    finally:
        engine.close()
    assert got == want
    assert stats["max_rows"] >= 3 and stats["decode_rows"] > 1.5 * stats["decode_steps"], stats
