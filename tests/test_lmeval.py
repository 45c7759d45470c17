"""The lm-evaluation-harness adapter (`--model dlm`): its scores held against direct computations, and a local
task file run through lm_eval itself (nothing is downloaded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from dlm.errors import DlmError  # noqa: E402
from dlm.lmeval import DlmLM, main  # noqa: E402
from dlm.sampling import SampleConfig, generate  # noqa: E402

CK = Path(__file__).resolve().parents[1] / "checkpoints"


def req(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@pytest.fixture(scope="module")
def ar():
    return DlmLM(path=str(CK / "ar-small"))


def test_ar_loglikelihood_is_the_sum_of_next_token_log_probs(ar):
    ctx, cont = "def add(a, b):\n    return", " a + b"
    (ll, greedy), = ar.loglikelihood([req("loglikelihood", ctx, cont)])
    tok, model = ar.tok, ar.model
    c, w = tok.encode(ctx), tok.encode(ctx + cont)
    assert w[:len(c)] == c
    want, all_argmax = 0.0, True
    with torch.inference_mode():
        for k in range(len(c), len(w)):  # one prefix at a time: no slicing shared with the adapter
            logits = model(torch.tensor([w[:k]])).logits[0, -1].float()
            want += float(torch.log_softmax(logits, -1)[w[k]])
            all_argmax &= int(logits.argmax()) == w[k]
    assert ll == pytest.approx(want, abs=1e-4) and greedy == all_argmax
    (ll2, _), = ar.loglikelihood([req("loglikelihood", ctx, " )))(((")])
    assert ll2 < ll  # a worse continuation scores lower
    # rolling: a text that fits one window is its loglikelihood after the document boundary
    (roll,) = ar.loglikelihood_rolling([req("loglikelihood_rolling", ctx + cont)])
    (whole, _), = ar.loglikelihood([req("loglikelihood", "", ctx + cont)])
    assert roll == pytest.approx(whole, abs=1e-4)


def test_mdlm_loglikelihood_is_the_conditional_elbo():
    lm = DlmLM(path=str(CK / "mdlm-small"), samples=4)
    tok, model = lm.tok, lm.model
    ctx = "import os\nimport sys\n\ndef main():\n    x ="
    cont_ids = tok.encode(ctx + " 1")[len(tok.encode(ctx)):]
    assert len(cont_ids) == 1
    # one token: every sample masks exactly it, so the bound is exact: log p(token | context, <mask>)
    (ll, greedy), = lm.loglikelihood([req("loglikelihood", ctx, tok.decode(cont_ids))])
    ids = tok.encode(ctx) + cont_ids
    x = torch.tensor([ids[:-1] + [tok.mask_id]])
    from dlm.masks import block_causal_mask
    from dlm.objectives.mdlm import masked_logits

    L = lm.ck.block_size
    with torch.inference_mode():
        h = model(x, mask=block_causal_mask(len(ids), L) if 0 < L < len(ids) else "full", head=False).last
        logp = torch.log_softmax(masked_logits(model, h[0, -1:], tok.mask_id).float(), -1)[0]
    assert ll == pytest.approx(float(logp[cont_ids[0]]), abs=1e-4)
    assert greedy == (int(logp.argmax()) == cont_ids[0])
    # longer continuations: a seeded Monte-Carlo estimate, the same for the same seed
    a = lm.loglikelihood([req("loglikelihood", ctx, " os.path.join(a, b)")])[0][0]
    b = DlmLM(path=str(CK / "mdlm-small"), samples=4).loglikelihood([req("loglikelihood", ctx, " os.path.join(a, b)")])
    assert a == b[0][0] and a < 0


def test_generate_until_is_the_sampler_cut_at_the_stop(ar):
    ctx = "def read_config(path):\n    "
    full = generate(ar.model, ar.ck, ctx, SampleConfig(max_new_tokens=24)).text
    stop = full[3:6]
    (out,) = ar.generate_until([req("generate_until", ctx, {"until": [stop], "max_gen_toks": 24})])
    assert out == full[:full.find(stop)]


def test_a_local_task_in_lm_eval(monkeypatch):
    """scripts/lmeval/dlm_mc.yaml (BENCHMARKS section 10's local task) through lm_eval's simple_evaluate with the dlm
    model as lm_eval registers it (its tasks indexed from that folder alone); ar-small's exact log-likelihoods get 5
    of its 6 items."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(CK.parent)
    tasks = TaskManager(include_path="scripts/lmeval", include_defaults=False)
    res = simple_evaluate(model="dlm", model_args=f"path={CK / 'ar-small'}", tasks=["dlm_mc"], device="cpu",
                          task_manager=tasks)
    assert res["results"]["dlm_mc"]["acc,none"] == pytest.approx(5 / 6)
    with pytest.raises(DlmError, match="cannot be evaluated on its own"):  # (a drafter: python -m dlm.lmeval exits 2)
        simple_evaluate(model="dlm", model_args=f"path={CK / 'dflash-small'}", tasks=["dlm_mc"], device="cpu",
                        task_manager=tasks)


@pytest.mark.slow
def test_a_local_task_through_lm_eval(tmp_path, monkeypatch, capsys):
    """The same task through lm_eval's command line (`python -m dlm.lmeval`, every lm_eval task indexed: ~20 s), its
    results file; a drafter refused in one line, exit 2."""
    root = CK.parent
    out = tmp_path / "out"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "dlm.lmeval", "--model", "dlm", "--model_args",
                        f"path={CK / 'ar-small'}", "--tasks", "dlm_mc", "--include_path", "scripts/lmeval",
                        "--device", "cpu", "--output_path", str(out)], capture_output=True, text=True, env=env,
                       timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    (res,) = list(out.rglob("results_*.json"))
    acc = json.loads(res.read_text())["results"]["dlm_mc"]["acc,none"]
    assert acc == pytest.approx(5 / 6)
    # (the same command line in this process: lm_eval is imported once)
    monkeypatch.chdir(root)
    monkeypatch.setattr(sys, "argv", ["x", "--model", "dlm", "--model_args", f"path={CK / 'dflash-small'}", "--tasks",
                                      "dlm_mc", "--include_path", "scripts/lmeval", "--device", "cpu"])
    with pytest.raises(SystemExit) as bad:
        main()
    assert bad.value.code == 2 and "cannot be evaluated on its own" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["joint-small", "usdm-small"])
def test_causal_paradigms_score_exactly_and_generate(name):
    """The other shipped references: joint-small (its AR mode) and usdm-small (its causal encoder) score a
    continuation as the sum of their next-token log-probabilities, and generate_until runs their own sampler."""
    lm = DlmLM(path=str(CK / name))
    ctx, cont = "def add(a, b):\n    return", " a + b"
    (ll, _), = lm.loglikelihood([req("loglikelihood", ctx, cont)])
    c, w = lm.tok.encode(ctx), lm.tok.encode(ctx + cont)
    with torch.inference_mode():
        logp = torch.log_softmax(lm.model(torch.tensor([w])).logits[0].float(), -1)
    assert ll == pytest.approx(sum(float(logp[k - 1, w[k]]) for k in range(len(c), len(w))), abs=1e-4)
    (out,) = lm.generate_until([req("generate_until", ctx, {"until": ["\n\n"], "max_gen_toks": 8})])
    assert isinstance(out, str) and "\n\n" not in out

