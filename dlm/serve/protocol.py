"""The OpenAI side of the server: request schemas, their validation, errors, and the response bodies.

Requests are parsed strictly (a string where a number belongs is a 400); a top-level field the API does
not know is ignored, named in the `X-Dlm-Ignored-Fields` response header and a warning in the log (as
vLLM does: clients send fields of newer API versions), then the request is turned into a `Plan`: the encoded prompts, one `Row` per prompt and choice, and
one SampleConfig built from the OpenAI fields and dlm's extra fields. The sampler's own checks run
on that SampleConfig before anything starts (`Engine.validate`); their DlmError becomes a 400 whose
message names the request's fields instead of the CLI's options.

`Collector` turns a job's events into what the client sees: each row's text as it forms (cut at
<eos> and at stop strings, never splitting a UTF-8 character or a stop string across chunks), AR
log-probabilities, the canvases of denoising steps and the drafts of verify cycles (opt-in), and the
counters of the `dlm` object.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dlm import chat
from dlm.config import ALIASES
from dlm.errors import DlmError
from dlm.sampling import SampleConfig, encode, options_read, with_model_defaults
from dlm.sampling.common import Commit, Done, Event, Prompt, Scored, Step, Verified, before_eos, eos_index
from dlm.sampling.infill import FILL_RE
from dlm.sampling.speculative import DRAFTER_OPTIONS, kind_reads
from dlm.serve.engine import Engine, Row, Served

MAX_N = 16  # choices per prompt
MAX_PROMPTS = 16  # prompts per request
MAX_ROWS = 64  # prompts x choices
MAX_STOPS = 4
MAX_LOGPROBS = 5  # completions (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # chat
MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 100.0  # (OpenAI allows 2; far above, float32 logits / T underflow or overflow)
TEMPERATURE_RANGE = (1e-4, 100.0)  # usdm's t_min, t_max
DEFAULT_TEMPERATURE = 1.0  # OpenAI's: a request without temperature samples (temperature 0 is greedy), unless the
# model keeps a generation_config.json (an imported model): then its defaults (dlm.sampling.with_model_defaults)

log = logging.getLogger("dlm.serve")

# dlm's sampler options accepted as extra body fields, and the paradigms each applies to
def served_options(paradigm: str) -> frozenset[str]:
    """The request fields of dlm's sampler options that a paradigm reads (dlm.sampling.OPTIONS, one table)."""
    return options_read(paradigm) & (set(DlmFields.model_fields) - set(ALIASES) - {"dlm_stream_steps"})


CHAT_TEMPLATE_STOP = chat.STOP


# errors --------------------------------------------------------------------------------------------

class ApiError(Exception):
    """An error answered as OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*)")


def _field_of(flag: str) -> str:
    return {"max-new-tokens": "max_tokens"}.get(flag, flag.replace("-", "_"))


def from_dlm_error(e: DlmError) -> ApiError:
    """A sampler's one-line DlmError in the request's words: --top-p -> top_p, --max-new-tokens -> max_tokens."""
    text = str(e)
    m = _FLAG.search(text)
    msg = _FLAG.sub(lambda g: _field_of(g.group(1)), text).replace("max-new-tokens", "max_tokens")
    return ApiError(400, msg, _field_of(m.group(1)) if m else None, "invalid_value")


_EXPECTED = {"prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
             "stop": "a string or a list of strings", "content": "a string or a list of text parts"}


def _loc(loc: tuple) -> str:
    """A field's path without pydantic's type tags (`prompt.str`, `messages.0.function-after[...]`)."""
    keep = [str(p) for p in loc if isinstance(p, int) or not (
        p in ("str", "int", "float", "bool", "none") or "[" in p or p.startswith("function-") or p[:1].isupper())]
    return ".".join(keep)


def from_validation_error(e: ValidationError) -> ApiError:
    errors = e.errors()
    err = errors[0]
    loc = _loc(err["loc"])
    kinds = {"extra_forbidden": "unrecognized request argument", "missing": "required field missing"}
    same = [x for x in errors if _loc(x["loc"]) == loc]
    last = loc.rpartition(".")[2]
    if len(same) > 1 and last in _EXPECTED:  # a union: say what the field may be
        msg = f"must be {_EXPECTED[last]}"
    else:
        msg = kinds.get(err["type"], err["msg"])
    if err["type"] not in kinds and "input" in err and not isinstance(err["input"], (dict, list)):
        msg += f", got {err['input']!r}"[:200]
    return ApiError(400, f"{loc}: {msg}", loc or None,
                    "unknown_parameter" if err["type"] == "extra_forbidden" else "invalid_type")


# request schemas -------------------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class DlmFields(_Strict):
    """dlm's sampler options (the CLI's names), accepted as extra body fields."""

    top_k: int | None = None
    generation_config: Literal["auto", "none"] | None = None
    sampler: str | None = None
    steps: int | None = None
    threshold: float | None = None
    entropy_bound: float | None = None
    entropy_form: str | None = None
    block_size: int | None = None
    remasking: str | None = None
    revise: float | None = None
    editing_threshold: float | None = None
    max_post_steps: int | None = None
    preset: str | None = None
    prefix_cache: bool | None = None
    dual_cache: bool | None = None
    sub_block: int | None = None
    schedule: str | None = None
    whole_blocks: bool | None = None
    eos_early_stop: bool | None = None
    confidence: str | None = None
    mask_proposals: bool | None = None
    draw_holes: bool | None = None
    threshold_cap: bool | None = None
    leave_holes: bool | None = None
    redraw_committed: bool | None = None
    gumbel: bool | None = None
    alg_temp: float | None = None
    logits_eos_inf: bool | None = None
    confidence_eos_eot_inf: bool | None = None
    cfg_scale: float | None = None
    canvas_length: int | None = None
    t_max: float | None = None
    t_min: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None
    adaptive: bool | None = None
    last_canvas: str | None = None
    fill_length: int | None = None
    draft_passes: int | None = None
    draft_top_k: int | None = None
    draft_branches: int | None = None
    lookup_ngram: int | None = None
    # older spellings of the same options (as on the command line)
    gamma: int | None = None
    block_length: int | None = None
    max_denoising_steps: int | None = None
    # stream every denoising step's canvas and every verify cycle's draft (mdlm, usdm, speculative)
    dlm_stream_steps: bool = False


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(DlmFields):
    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(_Common):
    model_config = ConfigDict(extra="allow")  # unknown top-level fields: kept aside, ignored, named (Plan.ignored)

    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatRequest(_Common):
    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


def parse(kind: type[BaseModel], body: dict) -> Any:
    try:
        req = kind.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    if req.model_extra:
        log.warning("fields present in the request but ignored: %s", ", ".join(ignored(req)))
    return req


MAX_IGNORED_NAMED = 16


def ignored(req: BaseModel) -> list[str]:
    """The request's top-level fields the API does not know (ignored; the X-Dlm-Ignored-Fields header names them):
    escaped to printable ASCII (a header's alphabet; no line breaks into the log), cut to 64 characters, the first
    MAX_IGNORED_NAMED of them and a count of the rest."""
    names = sorted(req.model_extra or {})
    shown = [n.encode("unicode_escape").decode("ascii")[:64] for n in names[:MAX_IGNORED_NAMED]]
    return shown + ([f"... {len(names) - MAX_IGNORED_NAMED} more"] if len(names) > MAX_IGNORED_NAMED else [])


# the chat template -------------------------------------------------------------------------------------

def chat_prompt(messages: list[ChatMessage]) -> str:
    """The request's messages in dlm.chat's template (generation also stops at its header, chat.STOP)."""
    return chat.chat_prompt([(m.role, m.content if isinstance(m.content, str) else
                              "".join(p.text for p in (m.content or []))) for m in messages])


# the plan of a request ---------------------------------------------------------------------------------

@dataclass
class Plan:
    """A validated request: its rows and how to present what they produce."""

    served: Served
    kind: str  # completion | chat
    rows: list[Row]
    prompt_tokens: int
    stops: list[str]
    stream: bool
    include_usage: bool
    stream_steps: bool
    logprobs: int | None  # AR: alternatives per token (None: no logprobs)
    echo: list[str] = field(default_factory=list)  # per row: text put before the completion (echo)
    middle: list[int | None] = field(default_factory=list)  # per row: suffix infilling returns this many tokens
    id: str = ""
    created: int = 0
    ignored: list[str] = field(default_factory=list)  # the request's fields the API does not know


def _sample_config(served: Served, req: _Common, max_tokens: int) -> SampleConfig:
    given = {k: v for k, v in req.model_dump(include=set(DlmFields.model_fields)).items()
             if v is not None and k != "dlm_stream_steps"}
    for old, new in ALIASES.items():
        if old in given:
            v = given.pop(old)
            if new in given and given[new] != v:
                raise ApiError(400, f"{old} is another name for {new}; they were given different values "
                                    f"({v} and {given[new]})", old, "invalid_value")
            given[new] = v
    allowed = served_options(served.paradigm)
    for name in given:
        if name not in allowed:
            raise ApiError(400, f"{name} does not apply to {served.id} (paradigm {served.paradigm}; its options: "
                                f"{', '.join(sorted(allowed))})", name, "unsupported_parameter")
    kind = served.drafter.kind if served.drafter is not None else ""
    for name, (needs, words) in DRAFTER_OPTIONS.items():
        if name in given and not kind_reads(kind, needs):
            raise ApiError(400, f"{name} applies to {words}; {served.id} drafts with {served.draft}", name,
                           "unsupported_parameter")
    for name in ("t_min", "t_max"):  # a temperature the logits are divided by in float32
        if name in given and not TEMPERATURE_RANGE[0] <= given[name] <= TEMPERATURE_RANGE[1]:
            raise ApiError(400, f"{name} must be in [{TEMPERATURE_RANGE[0]}, {TEMPERATURE_RANGE[1]}], got {given[name]}",
                           name, "invalid_value")
    for name in ("fill_length", "canvas_length", "steps", "block_size", "sub_block"):  # sizes: bounded allocations
        if name in given and given[name] > served.context:
            raise ApiError(400, f"{name} must be <= {served.context} (the model's context), got {given[name]}",
                           name, "invalid_value")
    cfg = SampleConfig(max_new_tokens=max_tokens, **given)
    if req.top_p is not None:
        cfg.top_p = req.top_p
    if req.seed is not None:
        cfg.seed = req.seed
    if served.paradigm != "usdm":  # (usdm: temperature scales the schedule, below)
        cfg.temperature = DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
    # what the request left out: a preset (the model's recorded one) and an imported model's generation_config.json
    # (its temperature, top_k, top_p, in place of OpenAI's default temperature) fill it
    cfg.given = frozenset(given) | {k for k in ("temperature", "top_p", "seed") if getattr(req, k) is not None}
    cfg = with_model_defaults(served.ck, cfg)
    if served.paradigm == "usdm":
        cfg = _usdm_schedule(cfg, DEFAULT_TEMPERATURE if req.temperature is None else req.temperature)
    return cfg


def _usdm_schedule(cfg: SampleConfig, temperature: float) -> SampleConfig:
    """usdm samples every step on its t_max -> t_min schedule: `temperature` scales that schedule (given or the
    default), T x t_max -> T x t_min. 1 (OpenAI's default) is the schedule itself; 0, greedy elsewhere, leaves it
    as it is too (a usdm canvas is denoised by sampling; its tokens are the last step's argmax either way)."""
    if temperature in (0.0, 1.0):
        return cfg
    cfg = cfg.replace(t_max=cfg.t_max * temperature, t_min=cfg.t_min * temperature)
    lo, hi = TEMPERATURE_RANGE
    if not (lo <= cfg.t_min and cfg.t_max <= hi):
        raise ApiError(400, f"temperature {temperature} scales usdm's schedule (t_max -> t_min) to {cfg.t_max:g} -> "
                            f"{cfg.t_min:g}, outside [{lo}, {hi}]", "temperature", "invalid_value")
    return cfg


def _check_common(served: Served, req: _Common, max_tokens: int | None) -> int:
    if max_tokens is None:
        max_tokens = 16
    if max_tokens <= 0:
        raise ApiError(400, f"max_tokens must be > 0, got {max_tokens}", "max_tokens", "invalid_value")
    if max_tokens > served.context:
        raise ApiError(400, f"max_tokens must be <= {served.context} (the model's context, prompt included), "
                            f"got {max_tokens}", "max_tokens", "invalid_value")
    if req.temperature is not None and req.temperature > MAX_TEMPERATURE:
        raise ApiError(400, f"temperature must be <= {MAX_TEMPERATURE}, got {req.temperature}", "temperature",
                       "invalid_value")
    if not 1 <= req.n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {req.n}", "n", "invalid_value")
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise ApiError(400, f"seed must be in [0, 2**63 - 1], got {req.seed}", "seed", "invalid_value")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise ApiError(400, f"{name} is not supported (only 0)", name, "unsupported_parameter")
    if req.logit_bias:
        raise ApiError(400, "logit_bias is not supported", "logit_bias", "unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options", "invalid_value")
    return max_tokens


def _stops(stop: str | list[str] | None, extra: list[str] = ()) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop: at most {MAX_STOPS} sequences, got {len(stops)}", "stop", "invalid_value")
    for s in stops:
        if not s or len(s) > 256:
            raise ApiError(400, "stop: each sequence must be 1 to 256 characters", "stop", "invalid_value")
    return stops + [s for s in extra if s not in stops]


def _check_markers(served: Served, texts: list[str], fill_length: int) -> None:
    """<fill> templates ask for positions before anything is encoded: keep them within the context."""
    for t in texts:
        asked = sum(int(m.group(1)) if m.group(1) else fill_length for m in FILL_RE.finditer(t))
        if asked > served.context:
            raise ApiError(400, f"prompt: its <fill> markers ask for {asked} positions, more than the model's "
                                f"context of {served.context}", "prompt", "invalid_value")


def _logprob_paradigm(served: Served, param: str) -> None:
    if served.paradigm not in ("ar", "speculative"):
        raise ApiError(400, f"{param}: {served.paradigm} models have no per-token log-probabilities (a token is "
                            "chosen by denoising, not by one distribution); AR models have them",
                       param, "unsupported_parameter")


def plan_completion(engine: Engine, served: Served, req: CompletionRequest) -> Plan:
    """Check a completions request and encode it (runs in a worker thread: tokenizing may take a while)."""
    max_tokens = _check_common(served, req, req.max_tokens)
    stops = _stops(req.stop)
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError(400, "best_of is not supported (only best_of == n)", "best_of", "unsupported_parameter")
    if req.logprobs is not None:
        _logprob_paradigm(served, "logprobs")
        if not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", "logprobs",
                           "invalid_value")
        if req.echo:
            raise ApiError(400, "logprobs with echo (the prompt's log-probabilities) is not supported", "echo",
                           "unsupported_parameter")
    if req.echo and req.suffix is not None:
        raise ApiError(400, "echo cannot be combined with suffix", "echo", "invalid_value")
    cfg = _sample_config(served, req, max_tokens)
    cfg.suffix = req.suffix
    p = req.prompt
    vocab = served.ck.tokenizer.vocab_size
    if isinstance(p, list) and not p:
        raise ApiError(400, "prompt: an empty list", "prompt", "invalid_value")
    if isinstance(p, str) or (isinstance(p, list) and isinstance(p[0], str)):
        texts = [p] if isinstance(p, str) else p
        if len(texts) > MAX_PROMPTS:
            raise ApiError(400, f"prompt: at most {MAX_PROMPTS} prompts, got {len(texts)}", "prompt", "invalid_value")
        if req.suffix is None:
            _check_markers(served, texts, cfg.fill_length)
        prompts = _encode(served, texts, cfg)
        echoes = texts
    else:
        seqs = [p] if isinstance(p[0], int) else p
        if len(seqs) > MAX_PROMPTS:
            raise ApiError(400, f"prompt: at most {MAX_PROMPTS} prompts, got {len(seqs)}", "prompt", "invalid_value")
        for s in seqs:
            if len(s) > served.context or any(not 0 <= t < vocab for t in s):
                raise ApiError(400, f"prompt: token ids must be in [0, {vocab}) and at most {served.context} of them",
                               "prompt", "invalid_value")
        if req.suffix is not None:
            suffix_ids = served.ck.tokenizer.encode(req.suffix, specials=False)
            prompts = [Prompt(list(s), [None] * max_tokens + suffix_ids) for s in seqs]
        else:
            prompts = [Prompt(list(s)) for s in seqs]
        echoes = [served.ck.tokenizer.decode(s) for s in seqs]
    rows_n = len(prompts) * req.n
    if rows_n > MAX_ROWS:
        raise ApiError(400, f"n x prompts must be <= {MAX_ROWS}, got {rows_n}", "n", "invalid_value")
    _validate(engine, served, prompts, cfg)
    rows, echo, middle = [], [], []
    for i, pr in enumerate(prompts):
        for j in range(req.n):
            rows.append(Row(pr, cfg.replace(seed=cfg.seed + j), req.logprobs))
            echo.append(echoes[i] if req.echo else "")
            middle.append(None if req.suffix is None else _middle(served, pr, max_tokens))
    return Plan(served, "completion", rows, sum(len(pr.ids) for pr in prompts), stops, req.stream,
                bool(req.stream_options and req.stream_options.include_usage), req.dlm_stream_steps,
                req.logprobs, echo, middle, f"cmpl-{secrets.token_hex(12)}", int(time.time()), ignored(req))


def _middle(served: Served, prompt: Prompt, max_tokens: int) -> int:
    """What a suffix request returns of a row's tokens: a diffusion canvas's first max_tokens (the hole); an AR
    checkpoint trained for FIM writes a middle of its own length then the suffix: all but the suffix's tokens."""
    pinned = sum(t is not None for t in prompt.canvas or [])
    return -pinned if served.paradigm == "ar" and served.ck.fim and pinned else max_tokens


def plan_chat(engine: Engine, served: Served, req: ChatRequest) -> Plan:
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise ApiError(400, "max_tokens and max_completion_tokens differ", "max_completion_tokens", "invalid_value")
    max_tokens = _check_common(served, req, req.max_completion_tokens or req.max_tokens or 64)
    if req.tools:
        raise ApiError(400, "tools are not supported (the models are not chat- or tool-tuned)", "tools",
                       "unsupported_parameter")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise ApiError(400, "response_format: only {\"type\": \"text\"} is supported", "response_format",
                       "unsupported_parameter")
    top = None
    if req.logprobs:
        _logprob_paradigm(served, "logprobs")
        top = req.top_logprobs or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs",
                           "invalid_value")
    elif req.top_logprobs is not None:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    stops = _stops(req.stop, [CHAT_TEMPLATE_STOP])
    cfg = _sample_config(served, req, max_tokens)
    text = chat_prompt(req.messages)
    prompts = [Prompt(served.ck.tokenizer.encode(text))]  # plain continuation: <fill> in a message is text
    _validate(engine, served, prompts, cfg)
    rows = [Row(prompts[0], cfg.replace(seed=cfg.seed + j), top) for j in range(req.n)]
    return Plan(served, "chat", rows, len(prompts[0].ids), stops, req.stream,
                bool(req.stream_options and req.stream_options.include_usage), req.dlm_stream_steps, top,
                [""] * req.n, [None] * req.n, f"chatcmpl-{secrets.token_hex(12)}", int(time.time()), ignored(req))


def _encode(served: Served, texts: list[str], cfg: SampleConfig) -> list[Prompt]:
    try:
        return encode(served.ck, texts, cfg)
    except DlmError as e:
        raise from_dlm_error(e) from None


def _validate(engine: Engine, served: Served, prompts: list[Prompt], cfg: SampleConfig) -> None:
    try:
        engine.validate(served, prompts, cfg)
    except DlmError as e:
        raise from_dlm_error(e) from None


# turning events into what the client sees ------------------------------------------------------------

@dataclass
class Piece:
    """What one event adds to one row: text, log-probability entries, a dlm annotation, a finish reason."""

    row: int
    text: str = ""
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    dlm: dict | None = None
    finish: str | None = None
    offset: int = 0  # where this piece's text starts in the row's text (logprobs' text_offset)


class RowText:
    """One row's output as it forms: tokens, the text released so far, the stop strings."""

    def __init__(self, tok, stops: list[str], middle: int | None, canvas: list | None, echo: str):
        self.tok, self.stops, self.middle, self.canvas = tok, stops, middle, canvas
        self.tokens: list[int] = []
        self.scored: list[tuple[int, float, list[tuple[int, float]]]] = []
        self.text = ""  # the row's text so far (echo included), cut at a stop string
        self.sent = 0  # characters of it released
        self.stopped = False
        self.echo = echo
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.verified: Verified | None = None

    def visible(self) -> list[int]:
        t = self.tokens
        if self.middle is not None:
            return t[:self.middle]
        if self.canvas is None:
            return before_eos(t, self.tok.eos_ids)
        return t

    def update(self, final: bool = False) -> str:
        """The text released by this update (held back: a partial UTF-8 character, a possible stop string)."""
        if not self.stopped:
            text = self.echo + self.tok.text(self.visible())
            cut = [i for i in (text.find(s, len(self.echo)) for s in self.stops) if i >= 0]
            if cut:
                text, self.stopped = text[:min(cut)], True
            self.text = text
        safe = len(self.text)
        if not (final or self.stopped):
            safe -= self.hold
            while safe > self.sent and self.text[safe - 1] == "\ufffd":
                safe -= 1
        if safe <= self.sent:
            return ""
        out = self.text[self.sent:safe]
        self.sent = safe
        return out

    @property
    def ended(self) -> bool:
        return self.stopped or (self.canvas is None and eos_index(self.tokens, self.tok.eos_ids) is not None)

    def finish_reason(self) -> str:
        if self.ended or self.canvas is not None:
            return "stop"
        return "length"

    def new_tokens(self) -> int:
        if self.canvas is None:
            return len(self.tokens)
        return sum(c is None for c in self.canvas[:len(self.tokens)])


class Collector:
    """A job's events -> Pieces per row, and the `dlm` counters of the whole request."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.tok = plan.served.ck.tokenizer
        self.mask_id = plan.served.ck.mask_id
        self.rows = [RowText(self.tok, plan.stops, plan.middle[i], r.prompt.canvas, plan.echo[i])
                     for i, r in enumerate(plan.rows)]
        self.cycles = 0
        self.done: Done | None = None

    def piece_text(self, ids: list[int]) -> list[str | None]:
        mask = self.mask_id
        return [None if t == mask else self.tok.decode([t]) for t in ids]

    def feed(self, ev: Event, job=None) -> list[Piece]:
        if isinstance(ev, Done):
            self.done = ev
            return []
        row = getattr(ev, "row", 0)
        r = self.rows[row]
        if isinstance(ev, Step):
            if self.plan.stream_steps and not r.stopped:
                return [Piece(row, dlm={"event": "step", "canvas_index": ev.canvas_index, "step": ev.step,
                                        "offset": ev.offset, "entropy": ev.entropy,
                                        "tokens": self.piece_text(ev.canvas), "fixed": ev.fixed})]
            return []
        if isinstance(ev, Verified):
            self.cycles += 1
            r.verified = ev
            return []
        if isinstance(ev, Commit):
            if r.stopped:
                return []
            r.tokens.extend(ev.tokens)
            if isinstance(ev, Scored):
                r.scored.append((ev.tokens[0], ev.logprob, ev.top))
            text = r.update()
            if r.stopped and job is not None:
                job.stop_row(row)
            piece = Piece(row, text)
            if isinstance(ev, Scored) and not r.stopped and len(r.scored) <= len(r.visible()):
                piece.logprobs = [r.scored[-1]]  # (not the <eos> that ends the row)
                piece.offset = r.sent - len(text)
            if r.verified is not None and self.plan.stream_steps:
                v, r.verified = r.verified, None
                piece.dlm = {"event": "draft", "proposed": self.piece_text(v.proposed), "accepted": v.accepted,
                             "accepted_text": self.tok.decode(v.proposed[:v.accepted]),
                             "rejected_text": self.tok.decode(v.proposed[v.accepted:])}
            r.verified = None
            return [piece] if piece.text or piece.logprobs or piece.dlm else []
        return []

    def finish(self) -> list[Piece]:
        """The rest of every row's text and its finish reason."""
        return [Piece(i, r.update(final=True), finish=r.finish_reason()) for i, r in enumerate(self.rows)]

    # the response parts ---------------------------------------------------------------------------

    def usage(self) -> dict:
        completion = sum(r.new_tokens() for r in self.rows)
        return {"prompt_tokens": self.plan.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.plan.prompt_tokens + completion}

    def dlm(self, queued: float = 0.0) -> dict:
        st = self.done.stats if self.done is not None else None
        new = sum(r.new_tokens() for r in self.rows)
        forwards = st.forwards if st else 0
        seconds = st.seconds if st else 0.0
        out: dict[str, Any] = {
            "paradigm": self.plan.served.paradigm, "new_tokens": new, "forwards": forwards,
            "tokens_per_forward": new / forwards if forwards else 0.0, "seconds": seconds,
            "tokens_per_second": new / seconds if seconds > 0 else 0.0, "ttft": st.ttft if st else None,
            "queued_seconds": queued,
        }
        p = self.plan.served.paradigm
        if p in ("mdlm", "usdm"):  # the samplers' own counts (their Done statistics)
            out["canvases"] = st.canvases if st else 0
            out["steps"] = st.steps if st else 0
        if p == "speculative" and self.cycles:
            started = sum(1 for r in self.rows if r.tokens)
            out["draft_forwards"] = st.draft_forwards if st else 0
            out["cycles"] = self.cycles
            out["tau"] = (sum(len(r.tokens) for r in self.rows) - started) / self.cycles
            out["drafter"] = self.plan.served.drafter.name
        if st and "batch_rows_mean" in st.extra:
            out["batch_rows_mean"] = st.extra["batch_rows_mean"]
        return out

    def completion_logprobs(self, i: int, entries=None, start: int | None = None) -> dict | None:
        """OpenAI completions' logprobs object for row i (all its kept tokens, or the given entries)."""
        if self.plan.logprobs is None:
            return None
        r = self.rows[i]
        entries = self._kept(r) if entries is None else entries
        tokens = [self.tok.decode([t]) for t, _, _ in entries]
        offsets, at = [], len(r.echo) if start is None else start
        for s in tokens:
            offsets.append(at)
            at += len(s)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{self.tok.decode([a]): b for a, b in top} for _, _, top in entries],
                "text_offset": offsets}

    def chat_logprobs(self, i: int, entries=None) -> dict | None:
        if self.plan.logprobs is None:
            return None
        r = self.rows[i]
        entries = self._kept(r) if entries is None else entries

        def item(t: int, lp: float) -> dict:
            s = self.tok.decode([t])
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return {"content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top]} for t, lp, top in entries]}

    def _kept(self, r: RowText) -> list:
        """The scored tokens inside the returned text (before <eos> and a stop string)."""
        out, n = [], 0
        limit = len(r.text) - len(r.echo)
        for entry in r.scored[:len(r.visible())]:
            if n >= limit:
                break
            out.append(entry)
            n += len(self.tok.decode([entry[0]]))
        return out


def completion_body(plan: Plan, col: Collector, queued: float) -> dict:
    choices = [{"index": i, "text": r.text, "logprobs": col.completion_logprobs(i), "finish_reason": r.finish_reason()}
               for i, r in enumerate(col.rows)]
    return {"id": plan.id, "object": "text_completion", "created": plan.created, "model": plan.served.id,
            "choices": choices, "usage": col.usage(), "dlm": col.dlm(queued)}


def chat_body(plan: Plan, col: Collector, queued: float) -> dict:
    choices = [{"index": i, "message": {"role": "assistant", "content": r.text},
                "logprobs": col.chat_logprobs(i), "finish_reason": r.finish_reason()}
               for i, r in enumerate(col.rows)]
    return {"id": plan.id, "object": "chat.completion", "created": plan.created, "model": plan.served.id,
            "choices": choices, "usage": col.usage(), "dlm": col.dlm(queued)}


def chunk(plan: Plan, col: Collector, piece: Piece | None, first: bool = False) -> dict:
    """One streamed chunk in OpenAI's format (completion or chat); piece None: a chunk with no choices."""
    base = {"id": plan.id, "created": plan.created, "model": plan.served.id}
    if piece is None:
        return {**base, "object": "chat.completion.chunk" if plan.kind == "chat" else "text_completion",
                "choices": []}
    entries = piece.logprobs if plan.logprobs is not None else None
    if plan.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": piece.text} if first else {"content": piece.text}
        if piece.finish and not piece.text and not first:
            delta = {}
        choice = {"index": piece.row, "delta": delta,
                  "logprobs": col.chat_logprobs(piece.row, entries) if entries else None,
                  "finish_reason": piece.finish}
        out = {**base, "object": "chat.completion.chunk", "choices": [choice]}
    else:
        choice = {"index": piece.row, "text": piece.text,
                  "logprobs": col.completion_logprobs(piece.row, entries, piece.offset) if entries else None,
                  "finish_reason": piece.finish}
        out = {**base, "object": "text_completion", "choices": [choice]}
    if piece.dlm is not None:
        out["dlm"] = piece.dlm
    return out
