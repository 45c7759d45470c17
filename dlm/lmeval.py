"""An lm-evaluation-harness model adapter: any dlm checkpoint as `--model dlm`.

    python -m dlm.lmeval --model dlm --model_args path=checkpoints/ar-small --tasks TASKS [lm_eval options]
    python -m dlm.lmeval --model dlm --model_args path=checkpoints/mdlm-small,samples=128 --tasks ...

`python -m dlm.lmeval` is lm_eval's own command line with the `dlm` model registered (lm_eval finds models
in its own table only); from Python, pass `DlmLM(path=...)` to `lm_eval.simple_evaluate(model=...)`.

What each request type is, per paradigm:
- loglikelihood(context, continuation):
    ar, joint (its AR mode), usdm (its causal encoder, which DiffusionGemma trains with a next-token loss):
      the exact log-probability of the continuation's tokens; is_greedy = each is the argmax.
    mdlm: minus the Monte-Carlo ELBO of the continuation given the context (LLaDA's estimator: per sample,
      l ~ U{1..n} of the continuation's n tokens masked, their cross-entropy weighted n / l; `samples` per
      request, default 32; LLaDA uses 128), a lower bound on the log-likelihood, seeded (`seed`);
      is_greedy = one pass with the whole continuation masked predicts every token (argmax).
- loglikelihood_rolling(text): the same over lm_eval's disjoint windows of the model's context.
- generate_until(context, {until, max_gen_toks, temperature, do_sample}): the checkpoint's own sampler
  (`dlm generate`'s), cut at the first `until` string; usdm samples on its t_max -> t_min schedule.
The context is tokenized alone and the continuation as what `context + continuation` adds to it; a context
too long for the model keeps its end.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from dlm.checkpoint import load_model
from dlm.errors import DlmError
from dlm.sampling import SampleConfig, generate


@register_model("dlm")
class DlmLM(LM):
    def __init__(self, path: str, device: str = "cpu", samples: int | str = 32, seed: int | str = 0,
                 batch_size: Any = 1, max_batch_size: Any = None, **_: Any):
        super().__init__()
        if str(device).startswith("cuda") and not torch.cuda.is_available():  # lm_eval's default is cuda
            print(f"dlm.lmeval: device {device} is not available here; running on cpu", file=sys.stderr)
            device = "cpu"
        self.model, self.ck = load_model(path, device=device)
        self.model.eval()
        self.tok = self.ck.tokenizer
        self.paradigm = self.ck.objective
        if self.paradigm not in ("ar", "mdlm", "usdm", "joint"):
            raise DlmError(f"path={path}: a {self.paradigm} checkpoint cannot be evaluated on its own "
                           "(a drafter: evaluate its target)")
        self.samples, self.seed = int(samples), int(seed)
        if self.samples < 1:
            raise DlmError(f"samples must be >= 1, got {self.samples}")
        self.max_length = self.model.cfg.max_seq_len

    # tokens -------------------------------------------------------------------------------------------

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        ctx = self.tok.encode(context, specials=False)
        whole = self.tok.encode(context + continuation, specials=False)
        cont = whole[len(ctx):] if whole[:len(ctx)] == ctx else self.tok.encode(continuation, specials=False)
        keep = self.max_length - len(cont)
        if keep < 1:
            raise DlmError(f"a continuation of {len(cont)} tokens does not fit the model's context of "
                           f"{self.max_length}")
        lead = self.tok.lead_ids[:keep - 1]  # the context begins as a prompt does: after the tokenizer's <bos>
        ctx = lead + ctx[max(len(ctx) - (keep - len(lead)), 0):]  # (kept when a long context is cut)
        return ctx or [self.tok.eos_id], cont  # nothing before: the document boundary the models are trained after

    # scores -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def _score(self, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
        ids = torch.tensor([ctx + cont], device=self.model.device)
        n = len(ctx)
        if self.paradigm != "mdlm":  # causal: exact
            logits = self.model(ids).logits[0, n - 1:-1].float()  # (len(cont), V)
            logp = torch.log_softmax(logits, -1)
            target = ids[0, n:]
            return float(logp.gather(1, target[:, None]).sum()), bool((logits.argmax(-1) == target).all())
        from dlm.masks import block_causal_mask
        from dlm.objectives.mdlm import check_bound, elbo_nll, masked_logits, shifted

        check_bound(self.ck)
        mask_id = self.ck.mask_id
        fixed = torch.zeros_like(ids, dtype=torch.bool)
        fixed[0, :n] = True
        gen = torch.Generator(device=self.model.device).manual_seed(self.seed)
        shift = bool(self.ck.config.get("shift"))  # Dream: token i read from the output at i - 1
        nll = elbo_nll(self.model, ids, self.ck.block_size, mask_id, self.samples, gen, fixed=fixed,
                       shift=shift)  # (samples, 1)
        xt = ids.clone()
        xt[0, n:] = mask_id
        L = self.ck.block_size
        h = self.model(xt, mask=block_causal_mask(ids.shape[1], L, ids.device) if 0 < L < ids.shape[1] else "full",
                       head=False).last
        if shift:
            h = shifted(h)

        greedy = bool((masked_logits(self.model, h[0, n:], mask_id).argmax(-1) == ids[0, n:]).all())
        return -float(nll.mean()), greedy

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return [self._score(*self._pair(*r.args)) for r in requests]

    def loglikelihood_rolling(self, requests) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for r in requests:
            ids = self.tok.encode(r.args[0], specials=False)
            lead = self.tok.lead_ids  # the first window starts after the tokenizer's <bos>, else after an <eos>
            prefix = lead[-1] if lead else self.tok.eos_id
            total = 0.0
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=ids, prefix_token=prefix, max_seq_len=self.max_length, context_len=1)):
                total += self._score(list(ctx), list(cont))[0]
            out.append(total)
        return out

    def generate_until(self, requests) -> list[str]:
        out = []
        for r in requests:
            context, kw = r.args
            kw = dict(kw or {})
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(kw.get("temperature", 0.0) or 0.0) if kw.get("do_sample", True) else 0.0
            cfg = SampleConfig(max_new_tokens=int(kw.get("max_gen_toks", 256)), seed=self.seed,
                               temperature=0.0 if self.paradigm == "usdm" else temperature)
            cfg.max_new_tokens = max(1, min(cfg.max_new_tokens, self.max_length - 1))
            room = self.max_length - cfg.max_new_tokens
            if len(self.tok.encode(context)) > room:  # the text of the context's last tokens (generate adds a <bos>)
                ctx = self.tok.encode(context, specials=False)
                context = self.tok.decode(ctx[-max(room - len(self.tok.lead_ids), 1):])
            text = generate(self.model, self.ck, context, cfg).text
            cut = min((i for i in (text.find(u) for u in until if u) if i >= 0), default=len(text))
            out.append(text[:cut])
        return out


def main() -> None:
    """lm_eval's command line, with the `dlm` model registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "python -m dlm.lmeval"
    try:
        cli_evaluate()
    except DlmError as e:
        print(f"dlm.lmeval: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
