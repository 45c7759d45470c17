"""The public masked-diffusion families (LLaDA, Dream, SDAR, Fast-dLLM v2) imported into dlm's mdlm paradigm.

Each test builds a tiny random checkpoint in the family's public layout from transformers' own classes (Llama for
LLaDA, Qwen2 for Dream and Fast-dLLM v2, Qwen3 for SDAR) and holds dlm against that model, never against dlm's
code: the causal path (transformers' own mask), the bidirectional and block-causal paths (transformers' model
given the public models' attention pattern as an explicit 4D mask, written here from their modeling code), the
shifted prediction (the reference formula applied to transformers' logits), and the decoding recipes (reference
loops written here from the public generate functions).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlm.checkpoint import load_model
from dlm.errors import DlmError
from dlm.hf import export_hf, import_hf
from dlm.sampling import SampleConfig, generate
from dlm.sampling.common import Prompt
from dlm.sampling.mdlm import Denoising, PRESETS, apply_preset, make_job
from dlm.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-4  # fp32 rounding of a 2-layer model
FAMILIES = ("llada", "dream", "sdar", "fast-dllm-v2")

# LLaDA's tensor names (its modeling_llada.py: LLaDAModelLM.model = LLaDAModel, transformer.{wte, blocks, ln_f,
# ff_out}; a llama block holds attn_norm, q/k/v_proj, attn_out, ff_norm, ff_proj (gated by SiLU), up_proj, ff_out),
# from transformers' Llama names
LLADA_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj",
               "self_attn.v_proj": "v_proj", "self_attn.o_proj": "attn_out", "post_attention_layernorm": "ff_norm",
               "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj", "mlp.down_proj": "ff_out"}


def llada_name(name: str) -> str:
    if name == "lm_head.weight":
        return "model.transformer.ff_out.weight"
    if name == "model.embed_tokens.weight":
        return "model.transformer.wte.weight"
    if name == "model.norm.weight":
        return "model.transformer.ln_f.weight"
    _, _, i, rest = name.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    return f"model.transformer.blocks.{i}.{LLADA_LAYER[module]}.{leaf}"


@pytest.fixture(scope="module")
def tok(tokenizer_path):
    return Tokenizer.from_file(tokenizer_path)


def reference_model(family: str, tok: Tokenizer):
    """transformers' own class for the family's backbone, random, with peaked distributions (so that the decoding
    tests' choices are far from ties) and <eos> / <mask> never the most likely token."""
    common = dict(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                  attn_implementation="sdpa")
    if family == "llada":
        cfg = transformers.LlamaConfig(**common, rms_norm_eps=1e-5, rope_theta=500000.0)
        cls = transformers.LlamaForCausalLM
    elif family == "sdar":
        cfg = transformers.Qwen3Config(**common, head_dim=16, rms_norm_eps=1e-6, rope_theta=1000000.0)
        cls = transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.Qwen2Config(**common, rms_norm_eps=1e-6, rope_theta=10000.0)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    m = cls(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.normal_(0, 0.3)
            else:  # a large head: confident predictions, so the threshold rules commit several tokens a pass
                p.normal_(0, 1.5 if n == "lm_head.weight" else 0.25)
        for t in (tok.eos_id, tok.mask_id):
            m.lm_head.weight[t] = 0.0  # logit 0: below the maximum of the other (random) logits
    return m


def public_folder(family: str, tok: Tokenizer, tmp, ref) -> tuple:
    """The reference model written in the family's public layout: (folder, its config.json as a dict)."""
    folder = tmp / f"{family}-hf"
    ref.save_pretrained(folder, safe_serialization=True)
    shutil.copyfile(tok.source, folder / "tokenizer.json")
    qcfg = json.loads((folder / "config.json").read_text())
    for f in folder.glob("*.json"):
        if f.name not in ("config.json", "tokenizer.json"):
            f.unlink()
    if family == "llada":  # configuration_llada.py's keys (LLaDA-8B's config.json has these), its own tensor names
        hf = {"architectures": ["LLaDAModelLM"], "model_type": "llada", "activation_type": "silu",
              "alibi": False, "attention_layer_norm": False, "block_group_size": 1, "block_type": "llama",
              "d_model": 64, "embedding_size": tok.vocab_size, "vocab_size": tok.vocab_size, "include_bias": False,
              "include_qkv_bias": False, "input_emb_norm": False, "layer_norm_type": "rms",
              "layer_norm_with_affine": True, "bias_for_layer_norm": False, "mask_token_id": tok.mask_id,
              "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id, "max_sequence_length": 256,
              "mlp_hidden_size": 96, "mlp_ratio": 4, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2,
              "rms_norm_eps": 1e-5, "rope": True, "rope_full_precision": True, "rope_theta": 500000.0,
              "scale_logits": False, "weight_tying": False, "use_cache": False, "torch_dtype": "float32",
              "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                           "AutoModel": "modeling_llada.LLaDAModelLM"}}
        tensors = load_file(folder / "model.safetensors")
        save_file({llada_name(k): v for k, v in tensors.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        (folder / "configuration_llada.py").write_text("# remote code of the folder (kept as it is)\n")
        (folder / "modeling_llada.py").write_text("# remote code of the folder (kept as it is)\n")
    else:
        hf = dict(qcfg)
        hf["mask_token_id"] = tok.mask_id
        if family == "dream":
            hf.update(model_type="Dream", architectures=["DreamModel"])
        elif family == "sdar":
            hf.update(model_type="sdar", architectures=["SDARForCausalLM"], block_size=4, attention_bias=False)
        else:  # Fast-dLLM v2: bd_size 32
            hf.update(model_type="Fast_dLLM_Qwen", architectures=["Fast_dLLM_QwenForCausalLM"], bd_size=32)
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    (folder / "tokenizer_config.json").write_text(json.dumps(tok.hf_config()))
    return folder, hf


@pytest.fixture(scope="module")
def imported(tok, tmp_path_factory):
    """family -> (transformers reference in float64, public folder, its config, dlm model in float64, Checkpoint)."""
    out = {}
    for family in FAMILIES:
        tmp = tmp_path_factory.mktemp(family)
        ref = reference_model(family, tok)
        folder, hf = public_folder(family, tok, tmp, ref)
        import_hf(folder, tmp / "dlm")
        model, ck = load_model(tmp / "dlm", dtype=torch.float64)
        out[family] = (ref.double(), folder, hf, model, ck)
    return out


def tokens(n: int, seed: int, vocab: int, avoid: tuple[int, ...] = ()) -> torch.Tensor:
    x = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))
    for a in avoid:
        x[x == a] = (a + 7) % vocab
    return x


def block_causal(T: int, block: int) -> torch.Tensor:
    """Fast-dLLM v2 / SDAR at inference (eval_block_diff_mask): query i sees key j iff block(i) >= block(j)."""
    b = torch.arange(T) // block
    return (b[:, None] >= b[None, :])[None, None]


# what each import records ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,block,shift,context,preset", [
    ("llada", 0, False, "full", "llada"), ("dream", 0, True, "full", "dream"),
    ("sdar", 4, False, "block", "sdar"), ("fast-dllm-v2", 32, True, "block", "fast-dllm-v2")])
def test_import_records_the_conventions(imported, tok, family, block, shift, context, preset):
    """The public facts: LLaDA and Dream attend fully (no blocks), SDAR trains blocks of 4 (config block_size),
    Fast-dLLM v2 blocks of 32 (bd_size); Dream and Fast-dLLM v2 shift (their generate: logits[:, :-1] predict the
    next position); the <mask> id is the config's mask_token_id."""
    _, _, _, model, ck = imported[family]
    c = ck.config
    assert (c["objective"], c["family"], c["block_size"], c["shift"], c["context"], c["preset"]) == \
        ("mdlm", family, block, shift, context, preset)
    assert c["mask_id"] == tok.mask_id and ck.block_size == block
    assert model.cfg.attn_bias == (family in ("dream", "fast-dllm-v2"))  # Qwen2's q/k/v biases
    assert model.cfg.qk_norm == (family == "sdar")  # Qwen3's q/k-norm
    assert model.num_params() == model.cfg.num_params()  # (the count of the config knows the biases)


# the backbone against transformers ----------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_causal_path_matches_transformers(imported, tok, family):
    """The weights and config keys land where transformers' Llama / Qwen2 / Qwen3 put them: dlm's causal logits are
    transformers' on the same weights (q/k/v biases, q/k-norm, GQA, RoPE theta, norm eps)."""
    ref, _, _, model, _ = imported[family]
    x = tokens(40, 1, tok.vocab_size)
    with torch.no_grad():
        assert (model(x).logits - ref(x).logits).abs().max() <= TOL


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_bidirectional_path_matches_transformers_full_mask(imported, tok, family):
    """LLaDA (attn_mask None, is_causal False in modeling_llada.py) and Dream (attention_mask "full" in its
    generate): every position attends to every other; transformers' class with an all-true 4D mask is that model."""
    ref, _, _, model, _ = imported[family]
    x = tokens(33, 2, tok.vocab_size)
    full = torch.ones(1, 1, 33, 33, dtype=torch.bool)
    with torch.no_grad():
        theirs = ref(x, attention_mask=full).logits
        assert (model(x, mask="full").logits - theirs).abs().max() <= TOL
        assert (ref(x).logits - theirs).abs().max() > 1e-3  # (the mask matters)


# the sampler's view: alignment (shift) and context, against the reference formulas ----------------------------

def sampler_logits(model, ck, prompt: list[int], n_new: int, block: int | None, s: int, e: int, naive: bool,
                   prefix_cache: bool = False, fill: dict[int, int] | None = None):
    """The logits dlm's mdlm sampler reads for block [s, e) on its first pass (prompt + n_new holes; fill: holes
    already committed)."""
    cfg = SampleConfig(max_new_tokens=n_new, block_size=block, preset="none")
    full, shift = ck.config["context"] == "full", ck.config["shift"]
    job = make_job(Prompt(prompt), cfg, ck.block_size, model.cfg.max_seq_len, False, full, shift)
    for i, t in (fill or {}).items():
        job.known[i] = t
    state = Denoising(model, job, ck.config["mask_id"], naive, prefix_cache)
    for bs, be in job.blocks:  # earlier blocks' passes, as the sampler runs them (the cache fills)
        if be <= s and state.hole[bs:be].any():
            state.logits(bs, be)
    return state.logits(s, e)


def test_dream_shift_matches_reference_formula(imported, tok):
    """Dream's generate: logits = cat([logits[:, :1], logits[:, :-1]]) over the whole sequence (position i is
    predicted by the output at i - 1, position 0 by its own), full attention, masks after the prompt."""
    ref, _, _, model, ck = imported["dream"]
    P, N = 7, 12
    prompt = tokens(P, 3, tok.vocab_size, (tok.mask_id,))[0].tolist()
    x = torch.tensor([prompt + [tok.mask_id] * N])
    with torch.no_grad():
        logits = ref(x, attention_mask=torch.ones(1, 1, P + N, P + N, dtype=torch.bool)).logits
        want = torch.cat([logits[:, :1], logits[:, :-1]], 1)[0]
        for naive in (True, False):
            got = sampler_logits(model, ck, prompt, N, None, 0, P + N, naive)
            assert (got - want).abs().max() <= TOL


def test_llada_blocks_start_after_the_prompt_and_see_every_hole(imported, tok):
    """LLaDA's semi-autoregressive remasking: blocks of block_length laid from the end of the prompt, each step a
    full pass over prompt + every hole (the later blocks' masks included); no shift (logits at the position)."""
    ref, _, _, model, ck = imported["llada"]
    P, N = 5, 16
    prompt = tokens(P, 4, tok.vocab_size, (tok.mask_id,))[0].tolist()
    job = make_job(Prompt(prompt), SampleConfig(max_new_tokens=N, block_size=8), 0, 256, False, True, False)
    assert job.blocks == [(0, 5), (5, 13), (13, 21)]
    fill = {5 + i: t for i, t in enumerate(tokens(8, 5, tok.vocab_size, (tok.mask_id,))[0].tolist())}
    x = torch.tensor([prompt + [fill[i] for i in range(5, 13)] + [tok.mask_id] * 8])
    with torch.no_grad():
        want = ref(x, attention_mask=torch.ones(1, 1, 21, 21, dtype=torch.bool)).logits[0, 13:21]
        got = sampler_logits(model, ck, prompt, N, 8, 13, 21, True, fill=fill)
        assert (got - want).abs().max() <= TOL
        # Fast-dLLM's prefix cache: the first pass of a block is the same full pass
        got = sampler_logits(model, ck, prompt, N, 8, 13, 21, False, prefix_cache=True, fill=fill)
        assert (got - want).abs().max() <= TOL


@pytest.mark.parametrize("family", ["sdar", "fast-dllm-v2"])
def test_block_causal_context_and_shift_match_reference(imported, tok, family):
    """SDAR and Fast-dLLM v2 at inference (block_diffusion_generate / eval_mask): query i sees key j iff
    block(i) >= block(j), blocks on a grid from position 0 (the prompt's last partial block is denoised with the
    first new tokens). Fast-dLLM v2 shifts inside the block (cat([logits[:, :1], logits[:, :-1]])), its block's
    first token predicted by the finished block's last position (the token its generate appends after a block)."""
    ref, _, _, model, ck = imported[family]
    B = 4 if family == "sdar" else 8
    P, N = 6, 3 * B
    prompt = tokens(P, 6, tok.vocab_size, (tok.mask_id,))[0].tolist()
    fill = {i: t for i, t in zip(range(P, 2 * B), tokens(2 * B - P, 7, tok.vocab_size, (tok.mask_id,))[0].tolist())}
    s, e = 2 * B, 3 * B  # the third block: two finished blocks before it
    seq = prompt + [fill[i] for i in range(P, 2 * B)] + [tok.mask_id] * B
    x = torch.tensor([seq])
    with torch.no_grad():
        logits = ref(x, attention_mask=block_causal(3 * B, B)).logits[0]
        want = logits[s - 1:e - 1] if ck.config["shift"] else logits[s:e]
        for naive in (True, False):
            got = sampler_logits(model, ck, prompt, N, B, s, e, naive, fill=fill)
            assert (got - want).abs().max() <= TOL


# the decoding recipes against reference loops -------------------------------------------------------------------

def llada_reference(ref, prompt: list[int], gen_length: int, block_length: int, steps: int, mask_id: int):
    """LLaDA's generate (greedy, low_confidence remasking), the <mask> logit excluded as dlm does."""
    x = torch.tensor([prompt + [mask_id] * gen_length])
    P, T = len(prompt), len(prompt) + gen_length
    full = torch.ones(1, 1, T, T, dtype=torch.bool)
    per_block = steps // (gen_length // block_length)
    for b in range(gen_length // block_length):
        lo, hi = P + b * block_length, P + (b + 1) * block_length
        n = int((x[0, lo:hi] == mask_id).sum())
        counts = [n // per_block + (i < n % per_block) for i in range(per_block)]
        for k in counts:
            logits = ref(x, attention_mask=full).logits[0]
            logits[:, mask_id] = float("-inf")
            x0 = logits.argmax(-1)
            p = torch.softmax(logits, -1).gather(-1, x0[:, None])[:, 0]
            p[hi:] = float("-inf")
            conf = torch.where(x[0] == mask_id, p, float("-inf"))
            idx = conf.topk(k).indices
            x[0, idx] = x0[idx]
    return x[0, P:].tolist()


def dream_reference(ref, prompt: list[int], n: int, steps: int, mask_id: int, eps: float = 1e-3):
    """Dream's generate with alg="entropy" (greedy): shifted logits, full attention, at step i the
    int(masked * (1 - t[i+1] / t[i])) masked positions of lowest entropy committed on t = linspace(1, eps, steps + 1),
    every remaining one at the last step."""
    x = torch.tensor([prompt + [mask_id] * n])
    T = x.shape[1]
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        logits = ref(x, attention_mask=torch.ones(1, 1, T, T, dtype=torch.bool)).logits
        logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)[0]
        logits[:, mask_id] = float("-inf")
        probs = torch.softmax(logits, -1)
        ent = -(probs * torch.log(probs.clamp_min(1e-300))).sum(-1)
        masked = x[0] == mask_id
        conf = torch.where(masked, -ent, float("-inf"))
        num = masked.sum() / 1
        k = int(num * (1 - timesteps[i + 1] / timesteps[i])) if i < steps - 1 else int(num)
        if k > 0:
            idx = conf.topk(k).indices
            x[0, idx] = logits[idx].argmax(-1)
    return x[0, len(prompt):].tolist()


def sdar_reference(ref, prompt: list[int], n: int, block: int, steps: int, threshold: float, mask_id: int):
    """SDAR's block_diffusion_generate (greedy, low_confidence_dynamic), recomputing the sequence instead of its
    KV cache (the same values: a finished block never sees what follows it)."""
    P = len(prompt)
    total = -(-(P + n) // block) * block
    x = torch.tensor([prompt + [mask_id] * (total - P)])
    for b in range(P // block, total // block):
        lo, hi = b * block, (b + 1) * block
        counts = [block // steps + (i < block % steps) for i in range(steps)]
        for k in counts:
            masked = x[0, lo:hi] == mask_id
            if not masked.any():
                break
            logits = ref(x[:, :hi], attention_mask=block_causal(hi, block)).logits[0, lo:hi]
            logits[:, mask_id] = float("-inf")
            p, x0 = torch.softmax(logits, -1).max(-1)
            conf = torch.where(masked, p, float("-inf"))
            high = conf > threshold
            pick = high if int(high.sum()) >= k else torch.zeros_like(high).index_fill_(0, conf.topk(k).indices, True)
            x[0, lo:hi] = torch.where(pick, x0, x[0, lo:hi])
    return x[0, P:P + n].tolist()


def fast_dllm_v2_reference(ref, prompt: list[int], n: int, block: int, small: int, threshold: float, mask_id: int):
    """Fast-dLLM v2's generate (greedy, no block cache), recomputing the sequence with its block-causal mask instead
    of its KV cache: the partial prompt block filled with masks; each block denoised sub-block by sub-block (logits
    shifted inside the block, every masked position above the threshold and the most confident one committed);
    a finished block's last position gives the next block's first token (argmax), appended before it."""
    x = list(prompt)
    if len(x) % block == 0:  # (its generate: the prefill's last logits give the first token)
        x.append(int(ref(torch.tensor([x]), attention_mask=block_causal(len(x), block)).logits[0, -1].argmax()))
    while len(x) - len(prompt) < n:
        lo = len(x) // block * block
        hi = lo + block
        x = x + [mask_id] * (hi - len(x))
        t = torch.tensor([x])
        for sub in range(lo, hi, small):
            while (t[0, sub:sub + small] == mask_id).any():
                logits = ref(t, attention_mask=block_causal(hi, block)).logits[0, lo:hi]
                logits = torch.cat([logits[:1], logits[:-1]])[sub - lo:sub - lo + small]
                logits[:, mask_id] = float("-inf")
                p, x1 = torch.softmax(logits, -1).max(-1)
                masked = t[0, sub:sub + small] == mask_id
                p = torch.where(masked, p, float("-inf"))
                pick = (p > threshold) | (torch.arange(small) == p.argmax())
                pick &= masked
                t[0, sub:sub + small] = torch.where(pick, x1, t[0, sub:sub + small])
        x = t[0].tolist()
        logits = ref(t, attention_mask=block_causal(hi, block)).logits[0, -1]
        x.append(int(logits.argmax()))
    return x[len(prompt):len(prompt) + n]


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_follows_the_family_recipe(imported, tok, family):
    """`dlm generate` on an imported checkpoint runs its family's preset; LLaDA, Dream and SDAR give the tokens of
    their reference decoding loops (written above from the public generate functions) on the same weights."""
    ref, _, _, model, ck = imported[family]
    prompt = tokens(6, 8, tok.vocab_size, (tok.mask_id, tok.eos_id))[0].tolist()
    # SDAR and Fast-dLLM v2 decode whole blocks (the last padded with masks, cut after: --whole-blocks in their
    # presets): generations that end off the grid
    n = {"fast-dllm-v2": 22, "sdar": 17}.get(family, 16)
    cfg = SampleConfig(max_new_tokens=n)
    if family == "llada":
        cfg = cfg.replace(block_size=8, steps=8)
    if family == "dream":  # fewer steps than tokens: Dream's grid commits 0, 1 or 2 a step (even would commit 2)
        cfg = cfg.replace(steps=10)
    if family == "fast-dllm-v2":  # blocks of 8 in sub-blocks of 4 (the preset's 32 / 8, smaller)
        cfg = cfg.replace(block_size=8, sub_block=4)
    out = generate(model, ck, [tok.decode(prompt)], cfg.replace(max_new_tokens=n))
    assert out.stats.forwards > 0
    stats = {}
    ids = generate_ids(model, ck, prompt, cfg, stats)
    if family in ("sdar", "fast-dllm-v2"):  # (the threshold rule commits several tokens in some passes)
        assert stats["forwards"] < stats["new_tokens"] == n
    with torch.no_grad():
        if family == "llada":
            want = llada_reference(ref, prompt, n, 8, n, tok.mask_id)
        elif family == "dream":
            want = dream_reference(ref, prompt, n, 10, tok.mask_id)
        elif family == "sdar":
            want = sdar_reference(ref, prompt, n, 4, 4, 0.9, tok.mask_id)
        else:
            want = fast_dllm_v2_reference(ref, prompt, n, 8, 4, 0.9, tok.mask_id)
    cut = want.index(tok.eos_id) + 1 if tok.eos_id in want else len(want)
    assert ids == want[:cut]


def generate_ids(model, ck, prompt: list[int], cfg: SampleConfig, stats: dict | None = None) -> list[int]:
    from dlm.sampling import stream
    from dlm.sampling.common import Commit, Done

    out = []
    for ev in stream(model, ck, [Prompt(prompt)], cfg):
        if isinstance(ev, Commit):
            out += ev.tokens
        if isinstance(ev, Done) and stats is not None:
            stats.update(ev.stats.as_dict())
    return out

def assert_rows_equal_each_row_alone(model, ck, tok, lengths: tuple[int, ...]):
    """Prompts of these lengths as rows of one batch (dlm.sampling.stream_rows: what the server's row batcher and
    `eval --batch` run) give each row the tokens it gets alone; returns the batch's Done."""
    from dlm.sampling import stream_rows
    from dlm.sampling.common import Commit, Done

    prompts = [tokens(n, 20 + n, tok.vocab_size, (tok.mask_id, tok.eos_id))[0].tolist() for n in lengths]
    cfg = SampleConfig(max_new_tokens=12)
    alone = [generate_ids(model, ck, p, cfg) for p in prompts]
    got, done = {r: [] for r in range(len(prompts))}, None
    for ev in stream_rows(model, ck, [Prompt(p) for p in prompts], [cfg] * len(prompts)):
        if isinstance(ev, Commit):
            got[ev.row] += ev.tokens
        if isinstance(ev, Done):
            done = ev
    assert [got[r] for r in range(len(prompts))] == alone
    return done

def assert_import_refuses(folder, hf: dict, change: dict, msg: str, tmp_path) -> None:
    """The public folder with its config.json changed by `change` is refused in one line naming `msg`, and nothing
    is written."""
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / "config.json").write_text(json.dumps({**hf, **change}))
    with pytest.raises(DlmError, match=msg) as e:
        import_hf(bad, tmp_path / "out")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()




def fast_dllm_prefix_reference(ref, prompt: list[int], gen_length: int, block_length: int, threshold: float,
                               mask_id: int, shift: bool = False):
    """Fast-dLLM (v1)'s generate_with_prefix_cache on LLaDA (greedy, threshold): per block one full pass whose K/V
    before the block are kept (transformers' DynamicCache, cropped), then passes over the block and everything
    after it reading them; commits in the block only: the most confident, and the others at >= threshold.
    shift (its Dream version, generation_utils_block.py): logits shifted, and the full pass commits only the
    block's first token (argmax)."""
    x = torch.tensor([prompt + [mask_id] * gen_length])
    P, T = len(prompt), len(prompt) + gen_length

    def commit(logits, lo, hi):
        logits[:, mask_id] = float("-inf")
        p, x0 = torch.softmax(logits, -1).max(-1)
        masked = x[0, lo:hi] == mask_id
        conf = torch.where(masked, p, float("-inf"))
        pick = ((conf >= threshold) | (torch.arange(hi - lo) == conf.argmax())) & masked
        x[0, lo:hi] = torch.where(pick, x0, x[0, lo:hi])

    for b in range(gen_length // block_length):
        lo, hi = P + b * block_length, P + (b + 1) * block_length
        out = ref(x, attention_mask=torch.ones(1, 1, T, T, dtype=torch.bool), use_cache=True)
        cache = out.past_key_values

        def keep(n):  # the prefix's K/V only (transformers' crop takes how many to drop)
            if cache.get_seq_length() > n:
                cache.crop(n - cache.get_seq_length())

        keep(lo)
        if shift:
            first = out.logits[0, lo - 1]
            first[mask_id] = float("-inf")
            x[0, lo] = int(first.argmax())
        else:
            commit(out.logits[0, lo:hi], lo, hi)
        while (x[0, lo:hi] == mask_id).any():
            logits = ref(x[:, lo:], past_key_values=cache, use_cache=True, position_ids=torch.arange(lo, T)[None],
                         attention_mask=torch.ones(1, 1, T - lo, T, dtype=torch.bool)).logits[0]
            if shift:
                logits = torch.cat([logits[:1], logits[:-1]])
            keep(lo)
            commit(logits[:hi - lo], lo, hi)
    return x[0, P:].tolist()


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_fast_dllm_prefix_cache_matches_reference(imported, tok, family):
    """Fast-dLLM's prefix-cache decoding of LLaDA and of Dream (shifted: each block's first token from the full
    pass), token for token (several tokens a pass at threshold 0.9)."""
    ref, _, _, model, ck = imported[family]
    prompt = tokens(6, 12, tok.vocab_size, (tok.mask_id, tok.eos_id))[0].tolist()
    stats = {}
    ids = generate_ids(model, ck, prompt, SampleConfig(max_new_tokens=32, preset="fast-dllm", block_size=8), stats)
    with torch.no_grad():
        want = fast_dllm_prefix_reference(ref, prompt, 32, 8, 0.9, tok.mask_id, shift=family == "dream")
    cut = want.index(tok.eos_id) + 1 if tok.eos_id in want else len(want)
    assert ids == want[:cut] and stats["forwards"] < stats["new_tokens"]


def steps_of(model, ck, prompt: list[int], cfg: SampleConfig) -> list:
    from dlm.sampling import stream
    from dlm.sampling.common import Step

    return [ev for ev in stream(model, ck, [Prompt(prompt)], cfg, step_events=True) if isinstance(ev, Step)]


def test_prefix_cache_first_pass_is_exact(imported, tok):
    """Fast-dLLM's prefix cache is an approximation of LLaDA's full passes: a block's first pass is the exact full
    pass (so the first step's commits agree), the later passes read the prefix's K/V from it."""
    _, _, _, model, ck = imported["llada"]
    prompt = tokens(6, 9, tok.vocab_size, (tok.mask_id, tok.eos_id))[0].tolist()
    cfg = SampleConfig(max_new_tokens=16, preset="fast-dllm")
    cached, exact = steps_of(model, ck, prompt, cfg), steps_of(model, ck, prompt, cfg.replace(prefix_cache=False))
    assert cached[0].canvas == exact[0].canvas
    assert [e.canvas for e in cached] == [e.canvas for e in steps_of(model, ck, prompt, cfg)]  # reproducible


# presets ---------------------------------------------------------------------------------------------------------

def test_presets_fill_only_what_was_not_given():
    base = SampleConfig()
    assert apply_preset(base, "llada").block_size == 32 and apply_preset(base, "llada").steps == 32
    assert apply_preset(base.replace(steps=4), "llada").steps == 4  # an explicit option wins
    assert apply_preset(base.replace(preset="none"), "llada") == base.replace(preset="none")
    assert apply_preset(base.replace(preset="sdar"), "llada").block_size == 4  # --preset beats the recorded one
    v2 = apply_preset(base, "fast-dllm-v2")
    assert (v2.sampler, v2.threshold, v2.block_size, v2.sub_block, v2.whole_blocks) == ("threshold", 0.9, 32, 8, True)
    assert apply_preset(base, "sdar").whole_blocks and not apply_preset(base, "llada").whole_blocks
    assert apply_preset(base, "fast-dllm").prefix_cache
    assert (apply_preset(base, "dream").sampler, apply_preset(base, "dream").schedule) == ("entropy", "dream")
    assert set(PRESETS) == {"llada", "fast-dllm", "dream", "sdar", "fast-dllm-v2", "llada2", "llada2.1"}
    l2 = apply_preset(base, "llada2")
    assert (l2.sampler, l2.threshold, l2.block_size, l2.steps, l2.whole_blocks) == ("threshold", 0.95, 32, 32, True)
    assert (l2.schedule, l2.mask_proposals, l2.confidence, l2.editing_threshold) == ("block", True, "sampled", None)
    l21 = apply_preset(base, "llada2.1")
    assert (l21.threshold, l21.editing_threshold, l21.max_post_steps, l21.schedule) == (0.7, 0.5, 16, "block")
    with pytest.raises(DlmError, match="--preset must be one of"):
        apply_preset(base.replace(preset="nope"))


def test_fast_dllm_preset_on_a_block_causal_model_keeps_its_exact_cache(imported, tok):
    """--preset fast-dllm on SDAR: the threshold and blocks apply, the prefix cache is moot (its KV cache is exact);
    asking for --prefix-cache by name is refused."""
    _, _, _, model, ck = imported["sdar"]
    prompt = tokens(6, 13, tok.vocab_size, (tok.mask_id, tok.eos_id))[0].tolist()
    assert len(generate_ids(model, ck, prompt, SampleConfig(max_new_tokens=8, preset="fast-dllm"))) == 8
    with pytest.raises(DlmError, match="--prefix-cache applies to a full-attention"):
        generate_ids(model, ck, prompt, SampleConfig(max_new_tokens=8, prefix_cache=True))


def test_sub_block_commits_in_order(imported, tok):
    """Fast-dLLM v2's sub-blocks: a step commits only inside the first sub-block (of the block, counted from its
    start) that still has holes."""
    _, _, _, model, ck = imported["fast-dllm-v2"]
    prompt = tokens(8, 10, tok.vocab_size, (tok.mask_id, tok.eos_id))[0].tolist()
    cfg = SampleConfig(max_new_tokens=24, sub_block=8, block_size=32, sampler="confidence")
    evs = steps_of(model, ck, prompt, cfg)
    assert len(evs) == 24
    for ev in evs:  # canvas position i is sequence position 8 + i: sub-block (8 + i) // 8
        done = [(8 + i) // 8 for i, f in enumerate(ev.fixed) if f]
        holes = [(8 + i) // 8 for i, f in enumerate(ev.fixed) if not f]
        assert not holes or max(done) <= min(holes)


# round trip ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip_is_exact(imported, family, tmp_path):
    """import -> export gives back the public folder: the same config.json, the same tensors under the same names,
    the side files (tokenizer settings, LLaDA's remote code); reimported, the same checkpoint."""
    _, folder, hf, _, ck = imported[family]
    model, ck = load_model(ck.path, dtype=None)
    export_hf(model, ck.tokenizer, tmp_path / "out", dtype=torch.float32, inputs=(ck.path,))
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == hf
    a, b = load_file(folder / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    if family == "llada":
        assert (tmp_path / "out" / "modeling_llada.py").is_file()
    import_hf(tmp_path / "out", tmp_path / "again")
    again, ck2 = load_model(tmp_path / "again", dtype=None)
    for k in ("block_size", "shift", "context", "mask_id", "preset", "family", "hf_config"):
        assert ck2.config[k] == ck.config[k]
    sa, sb = model.state_dict(), again.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_cli_import_generate_export(imported, tok, tmp_path, capsys):
    """The commands of docs/public-models.md on a tiny SDAR folder: import, generate with its preset, export."""
    from dlm.cli import main

    _, folder, hf, _, _ = imported["sdar"]
    assert main(["import", "--hf", str(folder), "--out", str(tmp_path / "ck")]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "ck"), "--prompt", "def f(x):", "--max-new-tokens", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["new_tokens"] == 8 and out["forwards"] < 8  # SDAR's preset: threshold 0.9 over blocks of 4
    assert main(["export", "--model", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == hf


def test_the_recorded_mask_id_is_the_one_used(imported, tok, tmp_path):
    """A config's mask_token_id wins over the tokenizer's guess (LLaDA's <|mdm_mask|> is not a name dlm's tokenizer
    looks for): the sampler's holes hold it."""
    _, folder, hf, _, _ = imported["llada"]
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    (other / "config.json").write_text(json.dumps({**hf, "mask_token_id": 7}))
    import_hf(other, tmp_path / "ck")
    model, ck = load_model(tmp_path / "ck")
    assert ck.mask_id == 7 != tok.mask_id
    first = steps_of(model, ck, [11, 12, 13], SampleConfig(max_new_tokens=8, steps=8))[0]
    assert [t for t, f in zip(first.canvas, first.fixed) if not f] == [7] * 7


# the published configs (their config.json keys as released; no weights): the sizes they describe
SDAR_4B = {  # JetAstra/SDAR training/model/SDAR-4B-Chat/config.json (its index: total_size 8822848512, bf16)
    "architectures": ["SDARForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_implementation": "flex_attention", "bos_token_id": 151643, "eos_token_id": 151643, "block_size": 4,
    "mask_token_id": 151669, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 9728,
    "max_position_embeddings": 32768, "max_window_layers": 36, "model_type": "sdar", "num_attention_heads": 32,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": False, "use_sliding_window": False, "vocab_size": 151936}
LLADA_8B = {  # GSAI-ML/LLaDA-8B-Base config.json (configuration_llada.py's keys)
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 4096,
    "embedding_dropout": 0.0, "embedding_size": 126464, "eos_token_id": 126081, "flash_attention": False,
    "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
    "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms",
    "layer_norm_with_affine": True, "mask_token_id": 126336, "max_sequence_length": 4096, "mlp_hidden_size": 12288,
    "mlp_ratio": 4, "model_type": "llada", "multi_query_attention": None, "n_heads": 32, "n_kv_heads": 32,
    "n_layers": 32, "pad_token_id": 126081, "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05,
    "rope": True, "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False, "use_cache": False,
    "vocab_size": 126464, "weight_tying": False}
QWEN25_7B = {"hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 131072,
             "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
             "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
             "use_sliding_window": False, "vocab_size": 152064, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("hf,params,conv", [
    (SDAR_4B, 8822848512 // 2, ("sdar", 4, 151669, False, "block")),
    # LLaDA-8B: 32 layers of q/k/v/o 4096 x 4096, SwiGLU 3 x 4096 x 12288, two norms; untied 126464-row wte and
    # ff_out; ln_f
    (LLADA_8B, 32 * (4 * 4096 ** 2 + 3 * 4096 * 12288 + 2 * 4096) + 2 * 126464 * 4096 + 4096,
     ("llada", 0, 126336, False, "full")),
    ({**QWEN25_7B, "model_type": "Dream", "architectures": ["DreamModel"], "mask_token_id": 151666},
     7_615_616_512, ("dream", 0, 151666, True, "full")),
    ({**QWEN25_7B, "model_type": "Fast_dLLM_Qwen", "architectures": ["Fast_dLLM_QwenForCausalLM"], "bd_size": 32},
     7_615_616_512, ("fast-dllm-v2", 32, 151665, True, "block")),
])
def test_published_configs_map_to_their_sizes(hf, params, conv, tmp_path):
    """The released config.json of each family maps to the model it describes (SDAR-4B: its index's byte count;
    Qwen2.5-7B: its parameter count; LLaDA-8B: its tensors' shapes) and to the family's conventions (Fast-dLLM v2's
    config names no mask_token_id: its generate's default 151665)."""
    from dlm.hf_mdlm import conventions, model_config

    cfg = model_config(hf, tmp_path / "config.json")
    assert cfg.num_params() == params
    c = conventions(hf, cfg, tmp_path / "config.json")
    assert (c["family"], c["block_size"], c["mask_id"], c["shift"], c["context"]) == conv


# refusals -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,change,msg", [
    ("llada", {"block_type": "sequential"}, "block_type"),
    ("llada", {"activation_type": "swiglu"}, "activation_type"),
    ("llada", {"rope": False}, "rope"),
    ("llada", {"scale_logits": True}, "scale_logits"),
    ("llada", {"d_model": 63}, "d_model"),
    ("llada", {"mask_token_id": 10 ** 7}, "mask_token_id"),
    ("dream", {"use_sliding_window": True}, "sliding-window"),
    ("dream", {"attention_bias": False}, "biases"),
    ("sdar", {"attention_bias": True}, "attention_bias"),
    ("fast-dllm-v2", {"bd_size": -1}, "bd_size"),
    ("fast-dllm-v2", {"hidden_act": "gelu"}, "hidden_act"),
])
def test_import_refuses_folders_that_do_not_fit(imported, family, change, msg, tmp_path):
    _, folder, hf, _, _ = imported[family]
    assert_import_refuses(folder, hf, change, msg, tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_likelihood_bound_reads_the_family_convention(imported, family):
    """The ELBO with one free position is exactly that token's cross-entropy given the rest with it masked: the
    reference computes it with transformers' class and the family's attention (LLaDA, Dream: full; SDAR: the block
    view), reading the output at the position (LLaDA, SDAR) or one earlier (Dream's eval: shifted logits). A
    shifted block model (Fast-dLLM v2) is refused in one line."""
    from dlm.objectives.mdlm import check_bound, elbo_nll

    ref, _, _, model, ck = imported[family]
    if ck.config["shift"] and ck.block_size:
        with pytest.raises(DlmError, match="shifted block model"):
            check_bound(ck)
        return
    check_bound(ck)
    T = 8  # one window (SDAR: two blocks of 4; the free position is in the second)
    x = tokens(T, 11, model.cfg.vocab_size, (ck.mask_id,))
    fixed = torch.ones(1, T, dtype=torch.bool)
    fixed[0, 6] = False
    nll = elbo_nll(model, x, ck.block_size, ck.mask_id, 2, torch.Generator().manual_seed(0), fixed=fixed,
                   shift=ck.config["shift"])
    xt = x.clone()
    xt[0, 6] = ck.mask_id
    with torch.no_grad():
        if ck.block_size:  # the noisy block sees the clean blocks before it and itself: the same rows here
            logits = ref(xt, attention_mask=block_causal(T, ck.block_size)).logits[0]
        else:
            logits = ref(xt, attention_mask=torch.ones(1, 1, T, T, dtype=torch.bool)).logits[0]
        row = logits[5 if ck.config["shift"] else 6].clone()
        row[ck.mask_id] = float("-inf")
        want = -torch.log_softmax(row, -1)[x[0, 6]]
    assert torch.allclose(nll, torch.full_like(nll, float(want)), atol=1e-5)


def test_import_needs_the_fast_tokenizer_file(imported, tmp_path):
    _, folder, _, _, _ = imported["dream"]
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / "tokenizer.json").unlink()
    with pytest.raises(DlmError, match="no tokenizer.json"):
        import_hf(bad, tmp_path / "out")


@pytest.mark.parametrize("family", ["llada", "dream", "fast-dllm-v2"])
def test_drafting_with_a_full_attention_or_shifted_model_is_refused(imported, family):
    """dlm's diffusion drafter reads its own block-causal, unshifted outputs: LLaDA, Dream and Fast-dLLM v2 are
    refused as drafters in one line (SDAR, block-causal and unshifted, drafts)."""
    from dlm.drafters import load_drafter

    _, _, _, _, ck = imported[family]
    target, tck = imported["sdar"][3], imported["sdar"][4]
    with pytest.raises(DlmError, match="does not draft yet"):
        load_drafter(str(ck.path), target, tck)
    assert load_drafter(str(tck.path), target, tck) is not None


def test_cli_refusal_is_exit_code_2(imported, tmp_path, capsys):
    from dlm.cli import main

    _, folder, hf, _, _ = imported["llada"]
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / "config.json").write_text(json.dumps({**hf, "block_type": "parallel"}))
    assert main(["import", "--hf", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "block_type" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["sdar", "dream"])
def test_rows_of_an_imported_model_equal_each_row_alone(imported, tok, family):
    """dlm.sampling.stream_rows (what the server's row batcher and `eval --batch` run): an imported block-causal model
    (SDAR) shares one forward per step across rows with its preset and its own <mask> id; a shifted full-attention
    one (Dream) runs its rows in turn. Either way each row's tokens are the row's alone."""
    _, _, _, model, ck = imported[family]
    done = assert_rows_equal_each_row_alone(model, ck, tok, (6, 9, 4))
    if family == "sdar":  # rows really shared forwards
        assert done.stats.extra.get("rows_per_forward", 1) > 1


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_eval_of_each_family(imported, family, tmp_path, capsys):
    """`dlm eval` on each imported family: the likelihood bound read with the family's convention (LLaDA, Dream,
    SDAR; Fast-dLLM v2's shifted blocks are refused in one line, exit 2), and the execution-based code task through
    the family's own decoding preset (every family)."""
    from dlm.cli import main
    from test_code_task import HUMANEVAL

    _, _, _, _, ck = imported[family]
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(8):
        (docs / f"{i}.txt").write_text("def f(x):\n    return x + %d\n" % i * 4)
    rc = main(["eval", "--model", str(ck.path), "--data", str(docs), "--split", "test", "--seq-len", "32",
               "--samples", "2", "--json"])
    out, err = capsys.readouterr()
    if family == "fast-dllm-v2":
        assert rc == 2 and "shifted block model" in err and err.strip().count("\n") == 0
    else:
        res = json.loads(out)
        assert rc == 0 and res["tokens"] > 0 and res["loss_bound"] > 0 and res["samples"] == 2
    he = tmp_path / "he.jsonl"
    he.write_text("".join(json.dumps(p) + "\n" for p in HUMANEVAL))
    assert main(["eval", "--model", str(ck.path), "--task", "code", "--data", str(he), "--max-new-tokens", "8",
                 "--json", "--allow-code-execution"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["problems"] == 2 and 0.0 <= res["pass_at_1"] <= 1.0 and res["forwards"] > 0
