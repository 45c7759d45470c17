"""Fine-tuning an imported DiffusionGemma on sudoku, end to end, as Google's developer guide does, at tiny scale: a
random DiffusionGemma that transformers builds (Gemma's special-token layout, one token per character) ->
`dlm import --hf` -> `dlm eval --task sudoku` -> `dlm train --objective usdm` on puzzles from `dlm task sudoku` (the
canvas is the solution after '=') -> `dlm eval` again -> `dlm export --format hf` -> transformers' model computes
dlm's logits. A tiny random model learns little sudoku in a few dozen steps: what must hold is that the held-out loss
falls and the cell accuracy rises over the untrained import (docs/gemma.md, "Fine-tune on sudoku", has the figures
of a longer run)."""

import json

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import decoders, models  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.diffusion_gemma import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion  # noqa: E402

from conftest import cli  # noqa: E402
from dlm.checkpoint import load_model  # noqa: E402
from dlm.model import canvas_embeds  # noqa: E402
from test_diffusion_gemma import F, S, TINY_VISION  # noqa: E402

CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
V = 64


def save_sudoku_diffusion_gemma(folder) -> None:
    """A tiny random DiffusionGemma (4 layers, sliding and full, MoE; canvas 81) and a real tokenizer in Gemma's
    layout (pad 0, eos 1, bos 2, control tokens, two EOS ids) with one token per digit, as Gemma's splits digits."""
    chars = list("0123456789=") + [chr(ord("a") + i) for i in range(26)] + [" ", "\n"]
    words = CONTROL + chars + [f"<unused{i}>" for i in range(V - len(CONTROL) - len(chars))]
    tk = HFTokenizer(models.BPE({w: i for i, w in enumerate(words)}, merges=[], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(CONTROL + words[len(CONTROL) + len(chars):])
    tc = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=32,
              layer_types=[S, F, S, F], num_experts=4, top_k_experts=2, moe_intermediate_size=24,
              max_position_embeddings=256)
    torch.manual_seed(0)
    m = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=tc, vision_config=TINY_VISION,
                                                             canvas_length=81))
    with torch.no_grad():  # matrices at N(0, 0.1), not 0.02: a frozen tied head of 0.02 caps the logits near 0, so
        for t in m.parameters():  # LoRA (which leaves it frozen) could not move the loss in a few steps
            if t.dim() >= 2:
                t.normal_(0, 0.1)
    m.save_pretrained(folder)
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "bos_token": "<bos>",
                                                              "pad_token": "<pad>"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 6], "bos_token_id": 2,
                                                               "pad_token_id": 0}))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma-sudoku")
    (root / "src").mkdir()
    save_sudoku_diffusion_gemma(root / "src")
    cli("task", "sudoku", "--n", "300", "--clues", "40-50", "--seed", "0", "--out", str(root / "train.csv"), check=True)
    cli("task", "sudoku", "--n", "40", "--clues", "40-50", "--seed", "1", "--out", str(root / "test.csv"), check=True)
    cli("import", "--hf", str(root / "src"), "--out", str(root / "ck"), check=True)
    return root


def scores(root, model: str) -> tuple[float, float]:
    """(held-out loss: the usdm likelihood bound in nats per token on 16 puzzles of test.csv, cell accuracy on 12).
    test.csv is held out as a whole (another seed than train.csv): its split 'train' is most of it."""
    loss = cli("eval", "--model", model, "--data", str(root / "test.csv"), "--split", "train", "--seq-len", "164",
               "--max-batches", "2", "--samples", "1", "--json", check=True).stdout
    loss = json.loads(loss.strip().splitlines()[-1])
    task = json.loads(cli("eval", "--model", model, "--task", "sudoku", "--data", str(root / "test.csv"), "--n", "12",
                          "--steps", "8", "--json", check=True).stdout.strip().splitlines()[-1])
    return loss["bound_nats"], task["cell_accuracy"]


VARIANTS = {"full-router-frozen": ["--freeze-router", "--lr", "1e-2"], "full": ["--lr", "1e-2"],
            "lora": ["--lora-rank", "8", "--lora-alpha", "16", "--lr", "2e-2"]}
STEPS = 40


def fine_tune_and_export(root, variant: str, steps: int) -> None:
    ck, ft, hf = str(root / "ck"), root / f"ft-{variant}", root / f"hf-{variant}"
    loss0, cells0 = scores(root, ck)
    cli("train", "--objective", "usdm", "--init-from", ck, "--data", str(root / "train.csv"), "--answer-sep", "=",
        "--seq-len", "164", "--canvas-length", "81", "--batch-size", "8", "--max-steps", str(steps), "--eval-every",
        str(steps), "--eval-batches", "1", "--log-every", "10", "--quiet", "--out", str(ft), *VARIANTS[variant],
        check=True)
    loss1, cells1 = scores(root, str(ft))
    assert loss1 < loss0 - 0.5, (loss0, loss1)  # the held-out loss falls ...
    assert cells1 > cells0 + 0.03, (cells0, cells1)  # ... and more cells are right than the untrained import gets
    a, b = load_file(root / "ck" / "model.safetensors"), load_file(ft / "model.safetensors")
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert changed and any(".router." in k for k in changed) == (variant == "full"), sorted(changed)[:8]
    assert json.loads((ft / "config.json").read_text())["tokenizer"]["eos_ids"] == [1, 6]

    cli("export", "--model", str(ft), "--out", str(hf), "--format", "hf", check=True)
    exported, source = (json.loads((p / "config.json").read_text()) for p in (hf, root / "src"))
    assert exported["vision_config"] == source["vision_config"] and exported["canvas_length"] == 81  # kept, not reset
    back = DiffusionGemmaForBlockDiffusion.from_pretrained(hf).eval()
    net, fck = load_model(str(ft))
    tok = fck.tokenizer
    quiz = (root / "test.csv").read_text().splitlines()[1].split(",")[0]
    prompt = torch.tensor([tok.encode(quiz + "=")])  # 82 tokens: longer than the sliding window (32)
    canvas = torch.randint(0, V, (1, 81), generator=torch.Generator().manual_seed(0))
    sc = torch.randn(1, 81, V, generator=torch.Generator().manual_seed(1)) * 3
    with torch.no_grad():
        cache_hf = DynamicCache(config=back.config.text_config)
        enc = back.model.encoder(input_ids=prompt, cache=cache_hf)
        cache = net.new_cache(1, 200)
        torch.testing.assert_close(net(prompt, cache=cache).logits,
                                   torch.tanh(back.lm_head(enc.last_hidden_state) / 30) * 30, atol=1e-5, rtol=1e-5)
        for logits in (None, sc):  # the decoder over the encoder's cache, without and with self-conditioning
            ref = back(cache=cache_hf, decoder_input_ids=canvas, self_conditioning_logits=logits).logits
            probs = None if logits is None else torch.softmax(logits, -1)
            got = net(embeds=canvas_embeds(net, canvas, probs), pos=torch.arange(82, 163), cache=cache, mask="full",
                      write=False).logits
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_fine_tune_an_imported_diffusion_gemma_on_sudoku(setup):
    """Full fine-tuning with the routers frozen (the fast variant)."""
    fine_tune_and_export(setup, "full-router-frozen", STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["full", "lora"])
def test_fine_tune_on_sudoku_routers_trained_and_lora(setup, variant):
    """The routers trained with the rest; LoRA adapters through peft (the routers untouched)."""
    if variant == "lora":
        pytest.importorskip("peft")
    fine_tune_and_export(setup, variant, STEPS)
