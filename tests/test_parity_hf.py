"""dlm against transformers on the AR families it imports (Qwen2, Qwen3, Llama, Ministral 3), on configurations
nobody here chose: hypothesis draws a tiny config (layers, heads, KV heads, head dims, RoPE theta and scaling, tied
or untied head), a byte-level BPE tokenizer with its special tokens at any ids and a post-processor that adds
nothing, a <bos>, or a <bos> and an <eos>, EOS id lists of 1-3 ids (one of them a token the model writes, so an
<eos> ends the generation) and a prompt. transformers builds the model (random weights, seeded), saves it as a hub
folder; dlm imports it as `dlm import --hf` does, and holds to transformers' AutoTokenizer and
AutoModelForCausalLM: the prompt's ids, the logits, the greedy tokens of `generate` (the generation_config's EOS
ids) and the text decoded from them; then dlm's export of the import loads in transformers as the same class with the
same tokenizer, EOS ids and logits.

Sampled generation, same seed, draw for draw: tests/test_parity_sampled.py.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, Ministral3Config, Ministral3ForCausalLM,
    Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)
from transformers.models.gemma4 import Gemma4ForCausalLM, Gemma4TextConfig  # noqa: E402

from dlm.checkpoint import load_model  # noqa: E402
from dlm.errors import DlmError  # noqa: E402
from dlm.hf import export_hf, import_hf  # noqa: E402
from dlm.sampling import SampleConfig, encode, generate  # noqa: E402
from hfbuild import POSTS, SPECIALS, assert_same_greedy, bpe_tokenizer, hf_greedy, randomize, save_folder  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
transformers.utils.logging.disable_progress_bar()

FAMILIES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
            "llama": (LlamaConfig, LlamaForCausalLM), "ministral3": (Ministral3Config, Ministral3ForCausalLM),
            "gemma4_text": (Gemma4TextConfig, Gemma4ForCausalLM)}  # (tests/test_parity_gemma4.py draws its configs)
EXAMPLES = 8
PROMPT_CHARS = st.characters(codec="utf-8", exclude_characters="<")  # (special-token strings: see the module doc)


@st.composite
def rope(draw, family: str) -> dict:
    theta = draw(st.sampled_from([100.0, 1e4, 1e6]))
    orig = draw(st.sampled_from([4, 8, 16]))  # shorter than many prompts: the scaled regime is exercised
    kinds = ["default", "yarn", "llama3"] if family != "ministral3" else ["yarn", "default"]
    kind = draw(st.sampled_from(kinds))
    out = {"rope_type": kind, "rope_theta": theta}
    if kind == "yarn":
        out.update(factor=draw(st.sampled_from([2.0, 4.0, 16.0])), original_max_position_embeddings=orig)
        if draw(st.booleans()):
            out.update(beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=draw(st.sampled_from([0.5, 1.0])))
    elif kind == "llama3":
        out.update(factor=draw(st.sampled_from([2.0, 8.0])), low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=orig)
    if family == "ministral3" or draw(st.booleans()):  # the queries' attention temperature: Ministral 3 reads it
        # (transformers' Ministral 3 always), Llama and Qwen ignore it
        out.update(llama_4_scaling_beta=draw(st.sampled_from([0.0, 0.1, 0.5])), original_max_position_embeddings=orig)
    return out


@st.composite
def cases(draw, family: str) -> dict:
    kv = draw(st.integers(1, 3))
    heads = kv * draw(st.integers(1, 3))
    vocab = draw(st.integers(300, 700))
    ids = draw(st.lists(st.integers(0, vocab - 1), min_size=len(SPECIALS), max_size=len(SPECIALS), unique=True))
    return dict(
        # hidden size a multiple of the heads (Llama checks it), head_dim apart from hidden / heads (as Qwen3's)
        config=dict(vocab_size=vocab, hidden_size=heads * draw(st.sampled_from([8, 16])),
                    intermediate_size=draw(st.integers(16, 96)), num_hidden_layers=draw(st.integers(1, 4)),
                    num_key_value_heads=kv, num_attention_heads=heads, head_dim=draw(st.sampled_from([8, 16])),
                    rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])),
                    tie_word_embeddings=draw(st.booleans()), max_position_embeddings=256,
                    rope_parameters=draw(rope(family))),
        specials=dict(zip(SPECIALS, ids)), post=draw(st.sampled_from(POSTS)),
        # EOS ids: the tokenizer's <eos> or not, and 0-2 tokens the model writes (at these steps of its output)
        eos_tok=draw(st.booleans()), eos_at=draw(st.lists(st.integers(0, 11), max_size=2)),
        prompt=draw(st.text(PROMPT_CHARS, min_size=1, max_size=40)),
        new=draw(st.integers(1, 12)), seed=draw(st.integers(0, 2**16)), std=draw(st.sampled_from([0.1, 0.3])),
    )


def build(family: str, case: dict, folder):
    """transformers' model of the case, saved with its tokenizer as a hub folder; (folder, EOS ids)."""
    config_cls, model_cls = FAMILIES[family]
    sp = case["specials"]
    c = config_cls(**case["config"], bos_token_id=sp["<bos>"], eos_token_id=sp["<eos>"], pad_token_id=sp["<pad>"])
    torch.manual_seed(case["seed"])
    m = model_cls(c).eval()
    randomize(m, case["seed"], case["std"])
    tk = bpe_tokenizer(c.vocab_size, sp, case["post"])
    prompt = tk.encode(case["prompt"]).ids
    m.generation_config.eos_token_id = None  # what it writes with no EOS: some of those become EOS ids
    written = hf_greedy_free(m, prompt, 12)
    eos = ([sp["<eos>"]] if case["eos_tok"] else []) + [written[i] for i in case["eos_at"]]
    eos = list(dict.fromkeys(eos)) or [sp["<eos>"]]
    return save_folder(folder, m, tk, eos), eos


def hf_greedy_free(m, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        x = torch.tensor([ids])
        for _ in range(n):
            x = torch.cat([x, m(x).logits[:, -1:].argmax(-1)], 1)
    return x[0, len(ids):].tolist()


def check(family: str, case: dict, tmp) -> None:
    src, eos = build(family, case, tmp / "hf")
    import_hf(src, tmp / "ck", overwrite=True)
    net, ck = load_model(str(tmp / "ck"))
    tok, model = AutoTokenizer.from_pretrained(src), AutoModelForCausalLM.from_pretrained(src).eval()
    assert list(ck.tokenizer.eos_ids) == eos == model.generation_config.eos_token_id
    p = case["prompt"]
    ids = tok(p)["input_ids"]
    cfg = SampleConfig(max_new_tokens=case["new"])
    assert ck.tokenizer.encode(p) == ids and encode(ck, p, cfg)[0].ids == ids  # the prompt generate runs on
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = model(x).logits
        torch.testing.assert_close(net(x).logits, ref, atol=2e-5, rtol=1e-5)
    theirs = hf_greedy(model, ids, case["new"])
    res = generate(net, ck, p, cfg)
    assert_same_greedy(model, ids, res.tokens[0], theirs)
    if res.tokens[0] == theirs:
        cut = theirs[:-1] if theirs and theirs[-1] in eos else theirs
        assert res.text == tok.decode(cut, skip_special_tokens=True)
    # and back: the export loads in transformers as the same model, tokenizer and EOS ids
    export_hf(net, ck.tokenizer, tmp / "out", inputs=(tmp / "ck",), overwrite=True)
    back = AutoModelForCausalLM.from_pretrained(tmp / "out").eval()
    assert type(back) is type(model) and back.generation_config.eos_token_id in (eos, eos[0] if len(eos) == 1 else eos)
    assert AutoTokenizer.from_pretrained(tmp / "out")(p)["input_ids"] == ids
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ref, atol=2e-5, rtol=1e-5)


def run(family: str, case: dict, tmp_path_factory) -> None:
    check(family, case, tmp_path_factory.mktemp(family))


SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


@SETTINGS
@given(case=cases("qwen2"))
def test_qwen2(case, tmp_path_factory):
    run("qwen2", case, tmp_path_factory)


@SETTINGS
@given(case=cases("qwen3"))
def test_qwen3(case, tmp_path_factory):
    run("qwen3", case, tmp_path_factory)


@SETTINGS
@given(case=cases("llama"))
def test_llama(case, tmp_path_factory):
    run("llama", case, tmp_path_factory)


# found by the search: plain RoPE with the temperature (rope_type default, llama_4_scaling_beta) lost the temperature
DEFAULT_ROPE_TEMPERATURE = dict(
    config=dict(vocab_size=300, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_key_value_heads=1,
                num_attention_heads=1, head_dim=8, rms_norm_eps=1e-06, tie_word_embeddings=False,
                max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                                                              "llama_4_scaling_beta": 0.1,
                                                              "original_max_position_embeddings": 4}),
    specials={"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}, post="", eos_tok=False, eos_at=[], prompt="0\U00010000",
    new=1, seed=0, std=0.1)


@SETTINGS
@given(case=cases("ministral3"))
@example(case=DEFAULT_ROPE_TEMPERATURE)
def test_ministral3(case, tmp_path_factory):
    run("ministral3", case, tmp_path_factory)


# named cases ---------------------------------------------------------------------------------------------------

def named(post: str, **over) -> dict:
    """A fixed case: 2 layers, GQA, specials away from the front of the vocabulary, the <eos> and a token the
    model writes at its 6th step as EOS ids."""
    config = dict(vocab_size=400, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_key_value_heads=2,
                  num_attention_heads=4, head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return dict(config={**config, **over}, specials={"<pad>": 7, "<bos>": 0, "<eos>": 399, "<unk>": 100}, post=post,
                eos_tok=True, eos_at=[5], prompt="def main(argv): the quick brown fox", new=12, seed=0, std=0.3)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("post", ["bos", "bos+eos"])
def test_the_tokenizers_post_processor_is_kept(family, post, tmp_path):
    """A tokenizer whose post-processor adds <bos> (Llama, Mistral, Gemma): the prompt starts with it in dlm as in
    transformers, so the greedy tokens are transformers' from the first (they were not while dlm dropped it)."""
    case = named(post)
    check(family, case, tmp_path)
    ck = load_model(str(tmp_path / "ck"))[1]
    ids = ck.tokenizer.encode(case["prompt"])
    assert ids[0] == 0 and (ids[-1] == 399) == (post == "bos+eos")
    assert ck.tokenizer.lead_ids == [0] and ck.tokenizer.encode(case["prompt"], specials=False) == ids[1:len(ids) - (
        post == "bos+eos")]


def test_ministral3_imports_as_ar_and_exports_as_ministral3(tmp_path):
    """Ministral 3 (YaRN, the queries' temperature by position) as a plain AR model: logits within fp32 rounding past
    the original context, transformers' greedy tokens, and the export loads as Ministral3ForCausalLM again."""
    rp = dict(rope_type="yarn", rope_theta=1e6, factor=16.0, original_max_position_embeddings=8, beta_fast=32.0,
              beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)
    case = {**named("bos", rope_parameters=rp), "prompt": "the quick brown fox jumps over the lazy dog " * 2}
    check("ministral3", case, tmp_path)
    net, ck = load_model(str(tmp_path / "ck"))  # (check exported it too: Ministral3ForCausalLM, the same logits)
    assert ck.objective == "ar" and net.cfg.rope_scaling["llama_4_scaling_beta"] == 0.1
    ids = ck.tokenizer.encode(case["prompt"])
    assert len(ids) > 8 and type(AutoModelForCausalLM.from_pretrained(tmp_path / "out")).__name__ == \
        "Ministral3ForCausalLM"
    x = torch.tensor([ids])
    with torch.no_grad():
        src = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
        assert (net(x).logits - src(x).logits).abs().max() < 1e-5


def test_a_qwen2_sliding_window_is_refused_in_one_line(tmp_path):
    case = named("")
    src, _ = build("qwen2", {**case, "config": {**case["config"], "use_sliding_window": True, "sliding_window": 4}},
                   tmp_path / "hf")
    with pytest.raises(DlmError, match="sliding-window attention is not supported"):
        import_hf(src, tmp_path / "ck")


def test_the_lm_eval_adapter_scores_after_the_bos(tmp_path):
    """lm-eval's loglikelihood of a continuation: the context encoded as transformers' tokenizer encodes it (its
    <bos> first), the continuation's own tokens after it; the sum of transformers' next-token log-probs."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from dlm.lmeval import DlmLM

    check("llama", named("bos"), tmp_path)
    lm = DlmLM(path=str(tmp_path / "ck"))
    tok, model = AutoTokenizer.from_pretrained(tmp_path / "hf"), AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ctx, cont = "def main(argv):", " return sum"
    (ll, _), = lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=(ctx, cont), idx=0)])
    c = tok(ctx)["input_ids"]
    w = c + tok(ctx + cont, add_special_tokens=False)["input_ids"][len(c) - 1:]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([w])).logits[0].double(), -1)
    want = sum(float(logp[k - 1, w[k]]) for k in range(len(c), len(w)))
    assert c[0] == 0 and ll == pytest.approx(want, abs=1e-4)


def test_the_server_answers_what_transformers_generates(tmp_path):
    """`dlm serve` (a real uvicorn, the openai client) on an imported Llama whose tokenizer adds <bos>: the prompt's
    token count and the completion are transformers' (greedy, its EOS ids, special tokens left out of the text)."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from dlm.serve.app import create_app, running
    from dlm.serve.engine import Engine

    case = named("bos")
    check("llama", case, tmp_path)
    tok, model = AutoTokenizer.from_pretrained(tmp_path / "hf"), AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = tok(case["prompt"])["input_ids"]
    theirs = hf_greedy(model, ids, case["new"])
    eos = model.generation_config.eos_token_id
    want = tok.decode(theirs[:-1] if theirs[-1] in eos else theirs, skip_special_tokens=True)
    engine = Engine([str(tmp_path / "ck")])
    try:
        with running(create_app(engine)) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
            r = client.completions.create(model="ck", prompt=case["prompt"], max_tokens=case["new"], temperature=0)
    finally:
        engine.close()
    assert r.usage.prompt_tokens == len(ids) and ids[0] == 0
    assert r.choices[0].text == want and r.usage.completion_tokens == len(theirs)
