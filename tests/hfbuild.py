"""Tiny transformers models and real tokenizers for the parity tests, built here (random weights, seeded), saved as
a hub folder and imported through `dlm import --hf`'s library call (dlm.hf.import_hf).

The tokenizer is a byte-level BPE (Qwen's and Llama 3's kind) whose merges are learned from a fixed text, with its
special tokens at the ids a test chooses and a post-processor that adds nothing, a <bos>, or a <bos> and an <eos>
(TemplateProcessing, as Llama's, Mistral's and Gemma's tokenizer.json carry)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

TEXT = ("the quick brown fox jumps over the lazy dog; def main(argv): return sum(x * x for x in range(10))\n"
        "import os, sys\nclass Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
        "Ein Hund lief über die Straße. 数字 123 456 789 — done.\n") * 4
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
POSTS = ("", "bos", "bos+eos")  # what the post-processor puts around a text


def bpe_tokenizer(n_vocab: int, special_ids: dict[str, int], post: str = "") -> HFTokenizer:
    """A byte-level BPE of n_vocab tokens (>= 256 + the specials): SPECIALS at special_ids (token -> id, any ids
    below n_vocab), the 256 bytes and merges of TEXT at the others."""
    assert sorted(special_ids) == sorted(SPECIALS) and len(set(special_ids.values())) == len(SPECIALS)
    trainer = trainers.BpeTrainer(vocab_size=n_vocab - len(SPECIALS), min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    base = HFTokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    base.train_from_iterator([TEXT], trainer=trainer)
    learned = json.loads(base.to_str())["model"]
    ordinary = sorted(learned["vocab"], key=learned["vocab"].get)
    assert len(ordinary) + len(SPECIALS) <= n_vocab
    ordinary += [f"<extra_{i}>" for i in range(n_vocab - len(SPECIALS) - len(ordinary))]  # never produced by text
    free = iter(i for i in range(n_vocab) if i not in special_ids.values())
    vocab = {**{t: next(free) for t in ordinary}, **special_ids}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(SPECIALS))
    bos, eos = ("<bos>", special_ids["<bos>"]), ("<eos>", special_ids["<eos>"])
    if post == "bos":
        tk.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                          special_tokens=[bos])
    elif post == "bos+eos":
        tk.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>", pair="<bos> $A <eos> $B <eos>",
                                                          special_tokens=[bos, eos])
    else:
        assert post == ""
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    return tk


def save_folder(folder: Path, model, tk: HFTokenizer, eos_ids: list[int], sampling: dict | None = None) -> Path:
    """The hub folder: the model (fp32 safetensors), tokenizer.json, tokenizer_config.json and a
    generation_config.json whose eos_token_id is the list eos_ids (greedy, as the model's defaults; sampling: do_sample
    with these keys, e.g. temperature, top_k, top_p)."""
    folder.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = list(eos_ids)
    model.generation_config.do_sample = sampling is not None
    for k, v in (sampling or {}).items():
        setattr(model.generation_config, k, v)
    model.save_pretrained(folder)
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>"}))
    return folder


def randomize(model, seed: int, std: float) -> None:
    """Weights away from their init: matrices N(0, std), vectors (norms, biases) near 1 or 0, so a missed term
    shows and the distributions are peaked enough for greedy decoding to mean something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if t.dim() >= 2:
                t.copy_(torch.randn(t.shape, generator=g) * std)
            elif name.endswith("bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            else:
                t.copy_(1 + 0.3 * torch.randn(t.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's (1 at init)
                b.fill_(0.7)


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate (greedy, its generation_config's EOS ids): the new tokens, an ending EOS included."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=model.generation_config.eos_token_id[0])
    return out[0, len(ids):].tolist()


def assert_same_greedy(model, prompt: list[int], ours: list[int], theirs: list[int], tie: float = 1e-4) -> None:
    """dlm's greedy tokens are transformers': equal, or equal up to a step where transformers' own two best logits
    lie within `tie` of each other (fp32 rounding may then pick either; nothing after it is compared)."""
    if ours == theirs:
        return
    i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    assert i < len(ours) and i < len(theirs), f"lengths differ: dlm {ours}, transformers {theirs}"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + theirs[:i]])).logits[0, -1].double()
    top = torch.topk(logits, 2)
    assert {ours[i], theirs[i]} == set(top.indices.tolist()) and float(top.values[0] - top.values[1]) < tie, \
        f"greedy tokens differ at {i}: dlm {ours}, transformers {theirs}"


def llada2_tensors(ref) -> dict[str, torch.Tensor]:
    """A transformers Glm4MoeForCausalLM's weights under LLaDA 2's names (modeling_llada2_moe.py): model.word_embeddings,
    model.layers.N.attention.{query_key_value (rows q, k, v), query_layernorm, key_layernorm, dense},
    mlp.{gate_proj, up_proj, down_proj} (the first first_k_dense_replace layers) or mlp.gate.{weight, expert_bias},
    mlp.experts.E.{gate,up,down}_proj, mlp.shared_experts.* (with n_shared_experts)."""
    c, sd = ref.config, ref.state_dict()
    I = c.moe_intermediate_size
    out = {"model.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "model.norm.weight": sd["model.norm.weight"], "lm_head.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        a, p = f"model.layers.{i}.self_attn.", f"model.layers.{i}."
        out[p + "attention.query_key_value.weight"] = torch.cat([sd[a + f"{n}_proj.weight"] for n in "qkv"])
        out[p + "attention.query_layernorm.weight"] = sd[a + "q_norm.weight"]
        out[p + "attention.key_layernorm.weight"] = sd[a + "k_norm.weight"]
        out[p + "attention.dense.weight"] = sd[a + "o_proj.weight"]
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[p + n + ".weight"] = sd[p + n + ".weight"]
        if i < c.first_k_dense_replace:
            out.update({p + f"mlp.{n}_proj.weight": sd[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")})
            continue
        out[p + "mlp.gate.weight"] = sd[p + "mlp.gate.weight"]
        out[p + "mlp.gate.expert_bias"] = sd[p + "mlp.gate.e_score_correction_bias"]
        gu, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]  # (E, 2I, D): gate, then up
        for e in range(c.n_routed_experts):
            out[p + f"mlp.experts.{e}.gate_proj.weight"] = gu[e, :I]
            out[p + f"mlp.experts.{e}.up_proj.weight"] = gu[e, I:]
            out[p + f"mlp.experts.{e}.down_proj.weight"] = down[e]
        if c.n_shared_experts:
            out.update({p + f"mlp.shared_experts.{n}_proj.weight": sd[p + f"mlp.shared_experts.{n}_proj.weight"]
                        for n in ("gate", "up", "down")})
    return {k: v.contiguous() for k, v in out.items()}
