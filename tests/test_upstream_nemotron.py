"""Nemotron-Labs-Diffusion against the authors' own code, through outputs recorded from it
(tests/fixtures/upstream/nemotron/, scripts/record_upstream.py nemotron, docs/testing.md).

A tiny random fp32 model in the released layout (model_type nemotron_labs_diffusion), and what its remote code's three
decoding modes produced on it: `generate` (block diffusion seeded by the AR mode; confidence and threshold, greedy
and sampled; the earlier folders' generate_diffusion through chat_utils, with its steps), `linear_spec_generate` (of
both generations of the remote code; its draft threshold) and the quadratic `self_spec_generate`, `<eos>` live and
suppressed. Besides the generated ids, the recorder kept the input ids of every
forward the upstream function ran: the block before each denoising pass, and the drafts each verify pass checked.
dlm imports the folder (`dlm import --hf`'s import) and must reproduce all of it: the ids up to the first `<eos>`, the
block after every denoising pass, and the draft of every verify cycle.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dlm.checkpoint import load_model
from dlm.hf import export_hf, import_hf
from dlm.sampling import SampleConfig, stream
from dlm.sampling.common import Commit, Done, Prompt, Step, Verified
from test_upstream_fixtures import eos_row, until_eos

pytestmark = pytest.mark.usefixtures("one_thread")
FOLDER = Path(__file__).parent / "fixtures" / "upstream" / "nemotron"
REC = json.loads((FOLDER / "recordings.json").read_text())
CASES = REC["cases"]
TOKENS = {i: t for t, i in json.loads((FOLDER / "tokenizer.json").read_text())["model"]["vocab"].items()}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return load_model(import_hf(FOLDER, tmp_path_factory.mktemp("nemotron") / "ck"))


def options(a: dict, **over) -> SampleConfig:
    """The upstream call -> dlm's options: generate(max_new_tokens, block_length, threshold, temperature) is the
    diffusion mode (an imported Nemotron-Labs-Diffusion seeds its blocks by the AR mode: --ar-seed), threshold None
    its confidence rule; the earlier folders' generate_diffusion (chat_utils' generate_with_prefix_cache_block_diff)
    the same with its steps; linear_spec_generate(block_length, threshold) is self-spec-linear with --draft-threshold;
    self_spec_generate(block_length) is self-spec-quadratic; causal_context=False is --bidirectional-context,
    shift_logits --shift-logits, ar_mix_weight --ar-mix-weight, max_thinking_tokens with end_think_token_id
    --max-thinking-tokens with --end-think (the token's text)."""
    o = {"max_new_tokens": a["max_new_tokens"], "block_size": a["block_length"]}
    if a["mode"] in ("generate", "generate_diffusion"):
        o |= {"temperature": a.get("temperature", 0.0), "seed": a.get("seed", 0), "threshold": a["threshold"] or 0.9,
              "sampler": "threshold" if a["threshold"] is not None else "confidence",
              "bidirectional_context": not a.get("causal_context", True), "shift_logits": a.get("shift_logits", False)}
        if "max_thinking_tokens" in a:
            o |= {"max_thinking_tokens": a["max_thinking_tokens"], "end_think": TOKENS[a["end_think_token_id"]]}
        if "steps" in a:  # (generate_diffusion's steps are for the whole generation, dlm's --steps per block)
            o["steps"] = a["steps"] // (a["max_new_tokens"] // a["block_length"])
    elif a["mode"] == "linear_spec_generate":
        o |= {"sampler": "self-spec-linear", "draft_threshold": a["threshold"]}
    else:
        o |= {"sampler": "self-spec-quadratic", "ar_mix_weight": a.get("ar_mix_weight")}
    return SampleConfig(**(o | over))


def run(model, ck, case: dict, **over) -> tuple[list[int], list[Step], list[Verified], Done]:
    ids, steps, cycles, done = [], [], [], None
    with eos_row(model, REC["eos_id"], case["eos"] == "live"):
        for ev in stream(model, ck, [Prompt(REC["prompts"][case["prompt"]])], options(case["args"], **over),
                         step_events=True):
            if isinstance(ev, Commit):
                ids += ev.tokens
            elif isinstance(ev, Step):
                steps.append(ev)
            elif isinstance(ev, Verified):
                cycles.append(ev)
            elif isinstance(ev, Done):
                done = ev
    return ids, steps, cycles, done


def test_import_reads_the_folder(imported):
    model, ck = imported
    assert ck.objective == "joint" and ck.config["family"] == "nemotron-labs-diffusion"
    assert ck.mask_id == REC["mask_id"] and ck.tokenizer.eos_ids == (REC["eos_id"],) and ck.block_size == 8
    ids = torch.tensor(REC["prompts"][1])
    with torch.no_grad():  # the AR mode: causal
        got = model(ids[None], pos=torch.arange(len(ids)), mask="causal").logits[0]
    assert (got - torch.tensor(REC["logits"]["values"])).abs().max() < 1e-4


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[f"{c['args']['mode']}-{c['args'].get('code', 'nld')}-{i}" for i, c in enumerate(CASES)])
def test_every_recording_is_reproduced(index, imported):
    model, ck = imported
    case = CASES[index]
    a, L, mask = case["args"], case["args"]["block_length"], REC["mask_id"]
    ids, steps, cycles, _ = run(model, ck, case)
    assert ids == until_eos(case["ids"][:a["max_new_tokens"]], [REC["eos_id"]])
    calls = case["calls"]
    if a["mode"] in ("generate", "generate_diffusion"):  # every forward after the prompt's: each block before each pass, then its write
        want, made = [], []
        for i, st in enumerate(steps):
            if st.step == 1:  # (the AR seed first, or, without causal_context, no seed; the thinking budget's token)
                first = [st.canvas[0] if a.get("causal_context", True) else mask] + [mask] * (L - 1)
                N, end = a.get("max_thinking_tokens"), a.get("end_think_token_id")
                if N is not None and len(made) + L > N and end not in made:
                    first[max(0, N - len(made))] = end
                want.append(first)
            want.append(st.canvas)
            if i + 1 == len(steps) or steps[i + 1].step == 1:
                made += st.canvas
        assert calls[1:] == want
    elif a["mode"] == "linear_spec_generate":  # the verify passes (no <mask> left): the token before + the draft
        drafts = [c[1:] for c in calls[1:] if mask not in c]
        full = [(j, v.proposed) for j, v in enumerate(cycles) if len(v.proposed) == L - 1]
        assert full and all(p == drafts[j] for j, p in full)
    else:  # quadratic: after the first pass, each pass's row-first tokens are the token before + the draft
        drafts = [c[::L + 1][1:] for c in calls[1:]]
        full = [(j, v.proposed) for j, v in enumerate(cycles) if len(v.proposed) == L - 1]
        assert full and all(p == drafts[j - 1] for j, p in full)


def test_the_recordings_exercise_eos_and_the_options():
    """<eos> lands inside some live generations (in a later block too), never in the suppressed ones; the draft
    threshold takes more than one draft pass a cycle."""
    eos = REC["eos_id"]
    inside = [c["ids"].index(eos) for c in CASES if c["eos"] == "live" and eos in c["ids"][:-1] + c["ids"][-1:]
              and c["ids"].index(eos) < c["args"]["max_new_tokens"] - 1]
    assert len(inside) >= 10 and max(inside) >= 8
    assert not any(eos in c["ids"] for c in CASES if c["eos"] == "suppressed")
    multi = [c for c in CASES if c["args"]["mode"] == "linear_spec_generate" and c["args"]["threshold"] > 0]
    assert all(sum(REC["mask_id"] in x for x in c["calls"]) > sum(REC["mask_id"] not in x for x in c["calls"][1:])
               for c in multi)


def test_the_options_are_what_makes_them_equal(imported):
    """Without --ar-seed (dlm's own joint layout: blocks on the training grid) the block-diffusion recordings mostly
    differ; without --draft-threshold the threshold recordings' drafts do."""
    model, ck = imported
    gen = [c for c in CASES if c["args"]["mode"] in ("generate", "generate_diffusion") and c["args"].get(
        "causal_context", True) and not c["args"].get("shift_logits") and "max_thinking_tokens" not in c["args"]]
    differ = sum(run(model, ck, c, ar_seed=False)[0] != until_eos(c["ids"][:c["args"]["max_new_tokens"]],
                                                                   [REC["eos_id"]]) for c in gen[::3])
    assert differ >= len(gen[::3]) // 2
    case = next(c for c in CASES if c["args"]["mode"] == "linear_spec_generate" and c["args"]["threshold"] == 0.9
                and c["eos"] == "suppressed")
    _, _, one_pass, d1 = run(model, ck, case, draft_threshold=0.0)
    _, _, passes, d2 = run(model, ck, case)
    assert [v.proposed for v in one_pass] != [v.proposed for v in passes]
    assert d2.stats.draft_forwards > d1.stats.draft_forwards


@pytest.mark.parametrize("option,off,least", [("causal_context", {"bidirectional_context": False}, 48),
                                              ("shift_logits", {"shift_logits": False}, 32),
                                              ("ar_mix_weight", {"ar_mix_weight": None}, 12),
                                              ("max_thinking_tokens", {"max_thinking_tokens": None}, 15)])
def test_each_option_is_needed(imported, option, off, least):
    """Without --bidirectional-context (causal_context=False), --shift-logits or --ar-mix-weight, every recording made
    with the upstream option differs from what dlm then generates; without --max-thinking-tokens, 15 of the 28 made
    with a thinking budget (in the rest the answer ends, or holds the token, before the budget runs out)."""
    model, ck = imported
    cases = [c for c in CASES if option in c["args"] and c["args"][option] not in (True, None)
             or option == "shift_logits" and c["args"].get("shift_logits")]
    assert len(cases) >= least
    want = [until_eos(c["ids"][:c["args"]["max_new_tokens"]], [REC["eos_id"]]) for c in cases]
    assert all(run(model, ck, c)[0] == w for c, w in zip(cases[::4], want[::4]))
    differ = sum(run(model, ck, c, **off)[0] != w for c, w in zip(cases, want))
    assert differ >= least, (option, differ, len(cases))


def test_export_is_the_folder_again(tmp_path, imported):
    """Import then export: the same config.json (model_type nemotron_labs_diffusion, paradigm bidirectional, its
    architecture) and every tensor bit-identical."""
    from safetensors.torch import load_file

    ck_dir = import_hf(FOLDER, tmp_path / "ck")
    model, ck = load_model(ck_dir, dtype=None)
    out = export_hf(model, ck.tokenizer, tmp_path / "out", inputs=(ck_dir,))
    assert json.loads((out / "config.json").read_text()) == json.loads((FOLDER / "config.json").read_text())
    want, got = load_file(FOLDER / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_rows_in_one_batch_reproduce_the_recordings(imported):
    """The server's path: the block-diffusion and quadratic recordings as rows of one batch (dlm.sampling.row_program,
    rows.Programs: one forward per step for all of them), each row's ids equal to its recording."""
    from dlm.sampling import row_program
    from dlm.sampling.rows import Programs

    model, ck = imported
    picked = [i for i, c in enumerate(CASES) if c["eos"] == "suppressed"
              and c["args"]["mode"] in ("generate", "generate_diffusion", "self_spec_generate")][::4]
    with eos_row(model, REC["eos_id"], False):
        progs = Programs(model, 256)
        got: dict[int, list[int]] = {i: [] for i in picked}
        events = []
        for r, i in enumerate(picked):
            c = CASES[i]
            events += progs.add_row(row_program(model, ck, Prompt(REC["prompts"][c["prompt"]]), options(c["args"]), r),
                                    tag=i)
        while len(progs):
            events += progs.step()
        for tag, ev in events:
            if isinstance(ev, Commit):
                got[tag] += ev.tokens
    assert len(picked) >= 5
    for i in picked:
        assert got[i] == CASES[i]["ids"][:CASES[i]["args"]["max_new_tokens"]], CASES[i]["args"]


def test_bad_options_are_refused(imported, tmp_path):
    """--draft-threshold or --ar-mix-weight outside [0, 1], or with a mode it does not belong to; --ar-seed with a rule
    its generate does not have; --shift-logits, --bidirectional-context or --max-thinking-tokens outside --ar-seed's
    layout; an --end-think that is not one token: one line, exit code 2."""
    from conftest import cli

    ck_dir = import_hf(FOLDER, tmp_path / "ck")
    for extra, needle in ((["--draft-threshold", "1.5"], "must be in [0, 1]"),
                          (["--draft-threshold", "0.5", "--sampler", "self-spec-quadratic"], "self-spec-linear"),
                          (["--draft-threshold", "0.5", "--temperature", "0.7"], "greedy draft"),
                          (["--sampler", "entropy"], "--sampler confidence"),
                          (["--sampler", "threshold", "--top-k", "5", "--temperature", "0.5"], "--top-k"),
                          (["--sampler", "confidence", "--no-ar-seed", "--shift-logits"], "--shift-logits applies"),
                          (["--sampler", "self-spec-linear", "--bidirectional-context"], "--bidirectional-context"),
                          (["--sampler", "self-spec-quadratic", "--ar-mix-weight", "1.5"], "must be in [0, 1]"),
                          (["--ar-mix-weight", "0.5"], "self-spec-quadratic"),
                          (["--sampler", "self-spec-quadratic", "--ar-mix-weight", "0.5", "--temperature", "0.5"],
                           "greedy"),
                          (["--sampler", "self-spec-linear", "--max-thinking-tokens", "4"], "--max-thinking-tokens"),
                          (["--sampler", "confidence", "--max-thinking-tokens", "4"], "--end-think '</think>'"),
                          (["--sampler", "confidence", "--max-thinking-tokens", "-1", "--end-think", "w3"], ">= 0")):
        code, _, err = cli("generate", "--model", str(ck_dir), "--prompt", "w1 w2", "--max-new-tokens", "4", *extra)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
