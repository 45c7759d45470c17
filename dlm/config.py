"""Configuration: the model (`ModelConfig` + presets), a training run (`TrainConfig`) and sampling (`SampleConfig`).

Plain dataclasses that check their own fields; no behaviour. The model's field names follow the
model, not transformers; `dlm.hf` maps them onto Qwen3/Llama configs. Options that belong to one
objective are checked by that objective (`Objective.check_config`), once, before anything is written.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from dlm.errors import DlmError, check


@dataclass
class MoEConfig:
    """A mixture of experts (dlm.moe), by its router:

    - "sigmoid" (LLaDA 2's BailingMoeV2; GLM 4 MoE's, DeepSeek V3's): sigmoid scores, the top_k chosen within the
      topk_group best of n_group groups, weights x scale; the experts and `shared` shared experts replace the MLP
      from layer first_dense on;
    - "softmax" (Gemma 4's): a normed, scaled input, softmax, top_k, a per-expert scale; the experts run beside the
      dense MLP in every layer, each branch with its own norms;
    - "topk" (Qwen3-MoE's, Mixtral's): a linear, fp32 softmax, top_k, renormalised when norm_topk; the experts
      replace the MLP except in the first first_dense layers and the dense_layers.
    """

    n_experts: int
    top_k: int
    ffn_dim: int  # hidden size of one expert
    router: str = "sigmoid"
    shared: int = 0  # shared experts (sigmoid: one MLP of shared x ffn_dim hidden units)
    first_dense: int = 0  # layers before this one keep the dense MLP
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0  # routed_scaling_factor
    norm_topk: bool = True  # topk: the chosen experts' weights renormalised to sum 1 (Qwen3-MoE's norm_topk_prob)
    dense_layers: list[int] = dataclasses.field(default_factory=list)  # more layers that keep the dense MLP (topk)

    def replaces_mlp(self, i: int) -> bool:
        """Whether layer i's MLP is these experts (the sigmoid and topk routers'; Gemma 4's run beside it)."""
        return self.router != "softmax" and i >= self.first_dense and i not in self.dense_layers

    def validate(self, n_layers: int) -> None:
        for k in ("n_experts", "top_k", "ffn_dim", "shared", "first_dense", "n_group", "topk_group"):
            v = getattr(self, k)
            check(_is_int(v) and v >= 0, f"model.moe.{k} must be an integer >= 0, got {v!r}")
        E, g = self.n_experts, self.n_group
        check(self.router in ("sigmoid", "softmax", "topk"),
              f"model.moe.router must be sigmoid, softmax or topk, got {self.router!r}")
        check(isinstance(self.norm_topk, bool), f"model.moe.norm_topk must be true or false, got {self.norm_topk!r}")
        d = self.dense_layers
        check(isinstance(d, list) and all(_is_int(i) and 0 <= i < n_layers for i in d) and d == sorted(set(d)),
              f"model.moe.dense_layers must be a sorted list of layer indices in [0, {n_layers}), got {d!r}"[:200])
        check(0 < self.top_k <= E <= 4096 and 0 < self.ffn_dim <= 1 << 18,
              f"model.moe needs 0 < top_k <= n_experts <= 4096 and ffn_dim > 0, got {self}"[:200])
        check(g > 0 and E % g == 0 and (self.router == "softmax" or E // g >= 2) and 0 < self.topk_group <= g,
              f"model.moe: n_group ({g}) must divide n_experts ({E}) into groups of 2 or more, and 0 < topk_group <= "
              "n_group")
        check(self.top_k <= self.topk_group * (E // g),
              f"model.moe: top_k ({self.top_k}) must be at most the experts of topk_group groups "
              f"({self.topk_group * (E // g)})")
        check(self.first_dense <= n_layers, f"model.moe.first_dense must be in [0, {n_layers}], got {self.first_dense}")
        s = self.scale
        check(isinstance(s, (int, float)) and not isinstance(s, bool) and 0 < s <= 1000,
              f"model.moe.scale must be a number in (0, 1000], got {s!r}")
        check(self.router != "softmax" or (self.shared == 0 and self.first_dense == 0 and not d),
              "model.moe: the softmax router's experts run in every layer, without shared experts")
        check(self.router != "topk" or self.shared == 0, "model.moe: the topk router has no shared experts")

    @classmethod
    def from_dict(cls, d: Any) -> MoEConfig:
        if not isinstance(d, dict):
            raise DlmError(f"model.moe must be null or an object, got {d!r}"[:200])
        names = {f.name for f in dataclasses.fields(cls)}
        check(not set(d) - names and {"n_experts", "top_k", "ffn_dim"} <= set(d),
              f"model.moe must be null or an object of n_experts, top_k, ffn_dim and optionally "
              f"{sorted(names - {'n_experts', 'top_k', 'ffn_dim'})}, got {sorted(d)}")
        return cls(**d)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class LayerSpec(NamedTuple):
    """What one decoder layer's attention looks like (ModelConfig.layer)."""

    kind: str  # "full" | "sliding"
    head_dim: int
    n_kv_heads: int
    k_eq_v: bool  # no v_proj: V is the K projection
    window: int  # sliding: the keys of the last `window` positions; 0: every key the mask allows


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    dim: int = 256  # hidden size D
    n_layers: int = 6
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: n_heads % n_kv_heads == 0
    head_dim: int = 0  # 0 means dim // n_heads (Qwen3 may set it explicitly)
    ffn_dim: int = 768  # gated MLP hidden size
    rope_theta: float = 10000.0
    # None (default RoPE), Llama 3's {"rope_type": "llama3", ...} or YaRN's {"rope_type": "yarn", "factor", ...}; with
    # "llama_4_scaling_beta" the queries are also scaled by position (Llama 4 / Ministral 3's attention temperature)
    rope_scaling: dict[str, Any] | None = None
    norm_eps: float = 1e-6
    qk_norm: bool = True  # Qwen3: RMSNorm on q and k per head; Llama: off
    attn_bias: bool = False  # Qwen2 / Qwen2.5 (Dream, Fast-dLLM v2): a bias on the q, k and v projections (not o)
    # partial rotary (LLaDA 2, GLM 4): RoPE turns the first partial_rotary x head_dim dimensions of each head (its
    # frequencies over that many), the rest pass unrotated; 1.0 = the whole head
    partial_rotary: float = 1.0
    # a mixture of experts (dlm.moe; MoEConfig: LLaDA 2's sigmoid router in place of the MLP, Gemma 4's softmax router
    # beside it); None: dense
    moe: MoEConfig | None = None
    tie_embeddings: bool = True
    max_seq_len: int = 1024  # longest position the model is trained and sampled for
    self_cond: bool = False  # uniform-state diffusion: self-conditioning module (DiffusionGemma)
    # usdm: RMS of the denoiser's canvas input (the self-conditioning module's unit-RMS output times this). 1.0 is
    # DiffusionGemma's (its encoder's token embeddings, scaled by sqrt(dim), have RMS ~1); a model adapted from a
    # Qwen3/Llama AR checkpoint, whose embeddings have RMS ~0.05, sets it to theirs (--canvas-scale encoder)
    canvas_rms: float = 1.0
    # usdm: shifted prediction (Dream, DiffuLLaMA): the denoiser's output at canvas position j predicts the token
    # at j + 1, and the canvas's first token is predicted by the encoder's next-token logits at the last clean
    # position, so a denoiser adapted from an AR checkpoint starts from the AR head's alignment (--canvas-shift)
    canvas_shift: bool = False
    # a learned absolute position embedding added to the token embeddings (GPT-2's), beside RoPE: puzzles whose
    # geometry is absolute (sudoku: a cell's row, column and box); Qwen3/Llama have none (no transformers export)
    learned_pos: bool = False
    # grid positions (puzzles on a side x side grid whose boxes are sqrt(side) wide: sudoku 9): learned row, column
    # and box embeddings of each position's cell added to the token embeddings, so a cell's constraints (the cells
    # sharing its row, column or box) are a few embeddings to match, not 81 free vectors to discover. A layout
    # repeats every side^2 + 1 positions (QUIZ, separator, SOLUTION: the separator and <eos> get embeddings of
    # their own); 0 = off
    grid_pos: int = 0
    # per-layer attention (Gemma 4's layer types, nanochat's window pattern): "full" or "sliding" for each layer;
    # [] = every layer full. A sliding layer's query sees the keys of the last sliding_window positions up to its
    # own (a bidirectional block over a cache: the cache's last sliding_window - 1 and the whole block)
    layer_types: list[str] = dataclasses.field(default_factory=list)
    sliding_window: int = 0
    # the full layers' own attention where it differs from the fields above, which the sliding layers keep (Gemma 4's
    # global layers); 0 = the same
    full_head_dim: int = 0
    full_kv_heads: int = 0
    full_rope_theta: float = 0.0
    # Gemma 4's "proportional" RoPE on the full layers: the first full_rotary of the head's angles turn, at theta's
    # frequencies over the whole head dim; the rest stay (1.0: all turn)
    full_rotary: float = 1.0
    k_eq_v: bool = False  # the full layers have no v_proj: V is the K projection (Gemma 4's attention_k_eq_v)
    v_norm: bool = False  # V normed per head, without a scale (Gemma 4)
    attn_scale: float = 0.0  # the attention's softmax scale; 0 = head_dim ** -0.5 (Gemma 4: 1.0, q/k-norm scale it)
    sandwich_norm: bool = False  # norms after the attention and the MLP as well as before them (Gemma)
    layer_scalar: bool = False  # a stored scalar multiplies each layer's output (Gemma 4)
    mlp_act: str = "silu"  # the gated MLP's (and experts') activation: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)
    norm_upcast: bool = False  # RMSNorm multiplies by its weight in fp32, then casts (Gemma); else casts, then scales
    embed_scale: float = 1.0  # token embeddings (and a canvas's soft embeddings) x this (Gemma: sqrt(dim))
    logit_softcap: float = 0.0  # logits = c tanh(logits / c) (Gemma's final_logit_softcapping); 0 = off

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # (a config.json's object)
            self.moe = MoEConfig.from_dict(self.moe)
        self.check_types()
        if not self.head_dim:
            self.head_dim = self.dim // max(self.n_heads, 1)
        self.validate()

    def check_types(self) -> None:
        """Each field has its type (a config.json or an HF config may say anything)."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            want, ok = {
                "int": ("an integer", _is_int(v)),
                "float": ("a number", isinstance(v, (int, float)) and not isinstance(v, bool)),
                "bool": ("true or false", isinstance(v, bool)),
                "str": ("a string", isinstance(v, str)),
                "list[str]": ("a list of strings", isinstance(v, list) and all(isinstance(x, str) for x in v)),
                "MoEConfig | None": ("null or an object", v is None or isinstance(v, MoEConfig)),
            }.get(f.type, ("null or an object", v is None or isinstance(v, dict)))
            check(ok, f"model.{f.name} must be {want}, got {v!r}"[:200])

    def validate(self) -> None:
        for name, most in MODEL_LIMITS.items():
            v = getattr(self, name)
            check(0 < v <= most, f"model.{name} must be in [1, {most}], got {v}")
        check(
            self.n_heads % self.n_kv_heads == 0,
            f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.n_kv_heads})",
        )
        check(self.head_dim % 2 == 0, f"model.head_dim must be even for RoPE, got {self.head_dim}")
        check(self.rope_theta > 0, f"model.rope_theta must be > 0, got {self.rope_theta}")
        check(0 < self.canvas_rms <= 100, f"model.canvas_rms must be in (0, 100], got {self.canvas_rms}")
        check(0 < self.norm_eps < 1, f"model.norm_eps must be in (0, 1), got {self.norm_eps}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            check(kind in ("default", "llama3", "yarn"),
                  f"model.rope_scaling type must be 'default', 'llama3' or 'yarn', got {kind!r}")
            check(kind != "yarn" or (self.rope_scaling.get("factor") and self.rope_scaling.get(
                "original_max_position_embeddings")), "model.rope_scaling yarn needs factor and "
                  "original_max_position_embeddings")
        p = self.partial_rotary
        check(0 < p <= 1 and int(self.head_dim * p) % 2 == 0 and int(self.head_dim * p) >= 2,
              f"model.partial_rotary must be in (0, 1] and turn an even number of the head's {self.head_dim} "
              f"dimensions, got {p}")
        check(p == 1 or self.rope_scaling is None, "model.partial_rotary with rope_scaling is not supported")
        if self.moe is not None:
            self.moe.validate(self.n_layers)
        lt = self.layer_types
        check(not lt or (len(lt) == self.n_layers and all(t in ("sliding", "full") for t in lt)),
              f"model.layer_types must be [] or list 'sliding' or 'full' for each of the {self.n_layers} layers, "
              f"got {lt!r}"[:200])
        check(0 <= self.sliding_window <= 1 << 20, f"model.sliding_window must be in [0, {1 << 20}], got "
              f"{self.sliding_window}")
        check("sliding" not in lt or self.sliding_window > 0, "model.sliding_window must be > 0 with sliding layers")
        check(0 <= self.full_head_dim <= MODEL_LIMITS["head_dim"] and self.full_head_dim % 2 == 0,
              f"model.full_head_dim must be 0 or even in [2, {MODEL_LIMITS['head_dim']}], got {self.full_head_dim}")
        check(0 <= self.full_kv_heads <= MODEL_LIMITS["n_kv_heads"] and self.n_heads % (self.full_kv_heads or 1) == 0,
              f"model.full_kv_heads must be 0 or divide model.n_heads ({self.n_heads}), got {self.full_kv_heads}")
        check(self.full_rope_theta >= 0, f"model.full_rope_theta must be >= 0, got {self.full_rope_theta}")
        check(0 < self.full_rotary <= 1, f"model.full_rotary must be in (0, 1], got {self.full_rotary}")
        check(self.attn_scale >= 0, f"model.attn_scale must be >= 0, got {self.attn_scale}")
        check(self.mlp_act in ("silu", "gelu_tanh"), f"model.mlp_act must be silu or gelu_tanh, got {self.mlp_act!r}")
        check(0 < self.embed_scale <= 1 << 10, f"model.embed_scale must be in (0, 1024], got {self.embed_scale}")
        check(self.logit_softcap >= 0, f"model.logit_softcap must be >= 0, got {self.logit_softcap}")
        g = self.grid_pos
        check(g == 0 or (4 <= g <= 64 and math.isqrt(g) ** 2 == g),
              f"model.grid_pos must be 0 or a square side of 4..64 (sudoku: 9), got {g}")

    def layer(self, i: int) -> LayerSpec:
        """Layer i's attention: a sliding layer keeps head_dim / n_kv_heads, a full one takes full_* where set."""
        if self.layer_types and self.layer_types[i] == "sliding":
            return LayerSpec("sliding", self.head_dim, self.n_kv_heads, False, self.sliding_window)
        return LayerSpec("full", self.full_head_dim or self.head_dim, self.full_kv_heads or self.n_kv_heads,
                         self.k_eq_v, 0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """A config.json's model object; one written with the `arch` object of Gemma 4 layers is read into the
        fields that now say the same."""
        if not isinstance(d, dict):
            raise DlmError(f"model config must be an object of fields, got {d!r}"[:200])
        d = dict(d)
        if "arch" in d:
            d.update(_from_arch(d.pop("arch"), d))
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise DlmError(f"model config has unknown fields {unknown}; known: {sorted(names)}")
        return cls(**d)

    def num_params(self) -> int:
        """Parameter count of the backbone (without self-conditioning; stored scalars and buffers not counted)."""
        d, m = self.dim, self.moe
        total = self.vocab_size * d * (1 if self.tie_embeddings else 2) + d  # embeddings (+ head), final norm
        total += self.max_seq_len * d if self.learned_pos else 0
        total += 3 * (self.grid_pos + 1) * d if self.grid_pos else 0
        mlp = 3 * d * self.ffn_dim
        for i in range(self.n_layers):
            _, hd, kv, k_eq_v, _ = self.layer(i)
            attn = d * hd * (2 * self.n_heads + kv * (1 if k_eq_v else 2)) + (2 * hd if self.qk_norm else 0)
            attn += hd * (self.n_heads + 2 * kv) if self.attn_bias else 0
            total += attn + (4 if self.sandwich_norm else 2) * d
            experts = m.n_experts * 3 * m.ffn_dim * d if m else 0
            if m and m.router == "softmax":  # beside the MLP: experts, router (proj, scale, per-expert), 3 norms
                total += mlp + experts + m.n_experts * d + d + m.n_experts + 3 * d
            elif m and m.replaces_mlp(i):  # in place of the MLP: experts, router, shared experts
                total += experts + m.n_experts * d + 3 * d * m.ffn_dim * m.shared
            else:
                total += mlp
        return total


def _from_arch(a: Any, d: dict[str, Any]) -> dict[str, Any]:
    """The typed fields of the `arch` object that config.json files once held for Gemma 4 layers
    ({"family": "gemma4", "layer_types", "sliding_window", "full_head_dim", "full_kv_heads", "full_rope_theta",
    "full_partial_rotary", "k_eq_v", "moe", "final_softcap"})."""
    if a is None:
        return {}
    check(isinstance(a, dict) and a.get("family") == "gemma4",
          f"model.arch must be null or a gemma4 object, got {a!r}"[:200])
    keys = {"family", "layer_types", "sliding_window", "full_head_dim", "full_kv_heads", "full_rope_theta",
            "full_partial_rotary", "k_eq_v", "moe", "final_softcap", "layer_scalar"}
    check(not set(a) - keys, f"model.arch has unknown fields {sorted(set(a) - keys)}; known: {sorted(keys)}")
    check(not d.get("moe"), "model.moe and model.arch.moe cannot both be set")
    dim = d.get("dim", 256)
    check(_is_int(dim) and dim > 0, f"model.dim must be a positive integer, got {dim!r}")
    moe = a.get("moe")
    return {"layer_types": a.get("layer_types"), "sliding_window": a.get("sliding_window"),
            "full_head_dim": a.get("full_head_dim"), "full_kv_heads": a.get("full_kv_heads"),
            "full_rope_theta": float(a.get("full_rope_theta") or 0.0),
            "full_rotary": a.get("full_partial_rotary", 1.0), "k_eq_v": bool(a.get("k_eq_v", False)),
            "moe": None if moe is None else {**moe, "router": "softmax"} if isinstance(moe, dict) else moe,
            "logit_softcap": float(a.get("final_softcap") or 0.0), **GEMMA_LAYERS, "embed_scale": math.sqrt(dim)}


# the fields that shape a family's layers beyond the Qwen3/Llama block; their defaults are that block
FAMILY_FIELDS = ("layer_types", "sliding_window", "full_head_dim", "full_kv_heads", "full_rope_theta", "full_rotary",
                 "k_eq_v", "v_norm", "attn_scale", "sandwich_norm", "layer_scalar", "mlp_act", "norm_upcast",
                 "embed_scale", "logit_softcap")


def plain_layers() -> dict[str, Any]:
    """FAMILY_FIELDS at their defaults: the Qwen3/Llama block."""
    f = {f.name: f for f in dataclasses.fields(ModelConfig)}
    return {k: f[k].default_factory() if f[k].default is dataclasses.MISSING else f[k].default for k in FAMILY_FIELDS}


# the numerics every Gemma 4 layer has (beside its per-layer specs): what `arch` implied
GEMMA_LAYERS = {"qk_norm": True, "attn_bias": False, "v_norm": True, "attn_scale": 1.0, "sandwich_norm": True,
                "layer_scalar": True, "mlp_act": "gelu_tanh", "norm_upcast": True}


# the largest sizes a model config may ask for: beyond them a crafted config.json would only allocate until memory
# runs out (real models stay far below: Llama-3-405B has 126 layers of 16384, vocabularies reach ~260k tokens)
MODEL_LIMITS = {"vocab_size": 1 << 21, "dim": 1 << 16, "n_layers": 1024, "n_heads": 1024, "n_kv_heads": 1024,
                "head_dim": 1024, "ffn_dim": 1 << 18, "max_seq_len": 1 << 20}

MAX_SEED = 2**63 - 1


def check_seed(seed: int, option: str = "--seed") -> None:
    """Seeds are integers in [0, 2**63 - 1] (what torch and numpy generators both take)."""
    check(isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed <= MAX_SEED,
          f"{option} must be an integer in [0, {MAX_SEED}], got {seed!r}")


# other names of options, accepted on the command line and in --config files (block_length: LLaDA's; gamma: the
# speculative-decoding papers'; max_denoising_steps: DiffusionGemma's)
ALIASES = {"block_length": "block_size", "gamma": "block_size", "max_denoising_steps": "steps",
           "batch": "cases_per_batch"}  # (eval: --batch is the cases per batch)
# The block of block diffusion (mdlm, joint) and of a DFlash draft when none is given: one default, one place.
# (The public recipes: DFlash trains with 16; Nemotron-Labs-Diffusion decodes with 32 or 16; small models use 16.)
DEFAULT_BLOCK_SIZE = 16


def block_size_of(cfg: Any) -> int:
    """A run's block (joint, dflash): --block-size, else DEFAULT_BLOCK_SIZE."""
    return DEFAULT_BLOCK_SIZE if cfg.block_size is None else cfg.block_size


# Presets. vocab_size is filled from the tokenizer when a model is built for training.
PRESETS: dict[str, dict[str, Any]] = {
    # for tests: ~0.3M parameters with a 4k vocabulary
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, max_seq_len=512),
    # the shipped reference models: ~3.8M parameters with a 4k vocabulary
    "small": dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=640, max_seq_len=1024),
    # the AR draft model of ar-small (speculative-decoding baseline): ~0.92M parameters with a 4k vocabulary,
    # comparable to a 1-layer DFlash drafter at ar-small's width (~0.95M, embedding and head shared with the target)
    "draft": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=1024),
    # puzzles (sudoku) with a character vocabulary (~28 tokens): ~0.89M parameters, a fraction of Ye et al.'s
    # 6M (3 layers, d 384), sized for CPU training in tens of minutes,
    # and learned absolute positions (a bidirectional RoPE model can hardly tell a cell's row and column: docs/sudoku.md)
    "puzzle": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=384, max_seq_len=256, learned_pos=True),
    # the puzzle preset with sudoku's grid positions (row, column and box embeddings of each cell, ModelConfig.grid_pos)
    "sudoku": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=384, max_seq_len=256, learned_pos=True,
                   grid_pos=9),
    # for GPU runs: ~26M parameters with a 4k vocabulary
    "base": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1408, max_seq_len=2048),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise DlmError(f"--preset must be one of {sorted(PRESETS)}, got {name!r}")
    return ModelConfig(**{**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}})



@dataclass
class TrainConfig:
    """A training run (the options of `dlm train`).

    Attributes:
        objective: ar | mdlm | usdm | dflash | joint
        preset: model size when training from scratch: tiny | small | draft | base | puzzle | sudoku (puzzle with the
            grid's row, column and box positions)
        data: corpus: stdlib, a folder, a text file, or a .jsonl file with a "text" field
        tokenizer: a tokenizer.json or a checkpoint folder, or 'char' (train one token per character on the corpus: tasks such as sudoku) (default: train a byte-level BPE on the corpus)
        vocab_size: vocabulary of a tokenizer trained on the corpus
        seq_len: tokens per training window
        batch_size: windows per step
        max_steps: optimizer steps
        lr: peak learning rate (AdamW)
        min_lr_ratio: cosine decays to lr * min_lr_ratio
        warmup: linear warmup: a fraction of max_steps (< 1) or a number of steps (>= 1)
        weight_decay: AdamW weight decay of matrices
        beta1: AdamW beta1
        beta2: AdamW beta2
        grad_clip: clip the gradient norm to this (0 = off)
        eval_every: validate every this many steps
        eval_batches: validation batches
        save_every: checkpoint every this many steps
        log_every: write metrics every this many steps
        seed: data order and every random draw depend only on (seed, step)
        device: auto, cpu, cuda or cuda:N
        compile: torch.compile the model (CUDA only)
        dtype: autocast precision of forward and backward: auto (bf16 on a CUDA device that has it, else fp32), bf16 or fp32 (bf16 on CPU works, slowly: for checking numerics)
        grad_accum: micro-batches per optimizer step (--batch-size is the global batch: it splits into grad_accum x processes equal slices)
        fsdp: under torchrun, shard parameters, gradients and optimizer state over the processes (FSDP2) instead of replicating them (DDP)
        activation_checkpointing: recompute each decoder layer's activations in the backward pass instead of keeping them (less memory, ~1/3 more compute: the large presets)
        init_from: start from this checkpoint's weights (e.g. diffusion adapted from AR)
        grow_layers: with --init-from: this many decoder layers appended on top of the checkpoint's, each starting as the identity (its o_proj and down_proj zero), so training starts from the checkpoint's exact function and gains depth
        lora_rank: low-rank adaptation (peft): train rank-R adapters on --lora-targets and freeze every other weight (0 = full fine-tuning); the checkpoint holds the merged weights
        lora_alpha: adapter scale alpha (the update is alpha / R x B A; default 2 R)
        lora_targets: comma-separated names of the linear layers that get adapters
        freeze_router: a mixture-of-experts backbone's routers (gemma4, LLaDA 2) keep their weights (full fine-tuning; with --lora-rank everything but the adapters is frozen anyway)
        block_size: block of block diffusion (mdlm; default 0 = the whole window; joint: default 16) or of the DFlash drafter (dflash; default 16)
        canvas_length: usdm: tokens per canvas
        loss_weight: usdm canvas loss: constant (1) or inverse (1 / (1 - t))
        self_cond_prob: usdm: probability of a self-conditioned training pass
        canvas_shift: usdm: shifted prediction: the denoiser's output at canvas position j predicts the token at j + 1 and the encoder's next-token logits predict the canvas's first token (Dream and DiffuLLaMA's alignment for a model adapted from AR; recorded in the checkpoint, the sampler and the likelihood bound follow it)
        canvas_scale: usdm: RMS of the denoiser's canvas input: unit (1.0, DiffusionGemma's) or encoder (the RMS of the token embeddings of the --init-from checkpoint, else of a fresh model: the clean text's scale)
        target: dflash: the AR checkpoint to speed up
        draft_layers: dflash: decoder layers of the drafter (0 = default; with --init-from, more than its drafter's grows it by depth: the new layers start with their output projections at zero, adding nothing)
        anchors: dflash: blocks per training window (0 = default)
        target_layers: dflash: target layer ids read by the drafter (default: spread over the target)
        injection: dflash ablation: kv (context K/V in every layer) or input (context as input tokens)
        target_features: dflash ablation: off = context from token embeddings, not target hidden states
        conv_kernel_size: dflash: DFlash 2's grouped dynamic causal convolution around each draft layer's attention and MLP, over this many block positions (0 = off, a DFlash 1 drafter; DFlash 2: 2); starts as the identity
        conv_group_size: dflash: channels per group of the DFlash 2 convolution's dynamic kernel (must divide the width)
        selector_rank: dflash: DFlash 2's candidate selector, the rank of its bilinear predecessor/successor score (0 = off; DFlash 2: 256); its successor codebook starts at zero, so the drafter starts as the DFlash 1 one; with --init-from a DFlash 2 drafter, a larger rank widens its selector (the new successor codes at zero: the same function at step 0)
        selector_top_k: dflash: candidates per slot of the selector (the top-k of the slot's draft logits; default: the --init-from drafter's, else 16; a continued drafter may train with another number, it has no weights of its own)
        selector_weight: dflash, with --selector-rank: weight w of the selector's loss (cross-entropy of the gold token among the top-k candidates, the gold token before it as predecessor, slots whose gold is not a candidate dropped, the slot decay)
        selector_ramp: dflash, with --selector-rank: share of --max-steps over which the selector's weight rises linearly from 0 to --selector-weight (0 = the full weight from step 0)
        selector_soft: dflash, with --selector-rank and --distill-logits: the selector's loss is the soft cross-entropy against the target's softmax at the slot, restricted to the candidates and renormalised (what acceptance at temperature 1 rewards: q close to p over the candidates), not the gold token's; every slot counts
        distill_logits: dflash: the draft loss is the soft cross-entropy against the target's softmax at each slot (self logit distillation), not the hard next token
        block_noise: dflash: what the block's slots hold in training and at the first draft pass: mask (the <mask> token, DFlash) or uniform (random tokens, a fraction t ~ U(0, 1] of the slots per block with the rest the true tokens, as uniform-state diffusion trains: later passes may revise any slot, --draft-passes 2-3)
        ar_weight: joint: weight of the AR (clean half) loss
        dlm_weight: joint: weight of the masked-diffusion (noisy half) loss
        dlm_data: joint: a second corpus for the diffusion loss alone (e.g. a `dlm distill` .jsonl of the AR mode's own greedy continuations: the drafts learn what the verifier will accept), while the AR loss keeps reading --data; each step reads --batch-size windows of each
        draft_rate: joint: share of the noisy blocks noised as a self-speculation draft sees its block (its first token kept, every other token masked), instead of at a random time; 0 = the public recipe
        draft_ar_first: joint, with --draft-rate: the kept first token of a draft-form block attends causally (the clean prefix and itself, not the masks after it), as `--sampler self-spec-linear-ar` decodes it, so the masks learn the view they draft from; off = the reference's bidirectional block
        ar_target: joint: the diffusion loss's target at a masked token is this share of the AR half's own next-token distribution at the same position (detached: the AR mode is the teacher, as its verifier) and the rest the data token; 0 = the public recipe (the data token alone)
        fim_rate: ar: fraction of training documents rearranged for fill-in-the-middle (Bavarian et al. 2022: prefix, suffix, middle around the FIM markers; document level, cut at two random characters); default 0.5 for ar, 0 = off
        answer_sep: supervised pairs: documents are PROMPT + this text + ANSWER (one token); the loss reads only the answer and diffusion noises only the answer, the prompt is the condition (LLaDA's SFT); default '=' for a .csv task corpus, '' = off
        prompt_loss: data whose documents mark a prompt (a .jsonl from `dlm distill`): train on the prompt tokens too; default off: every loss reads the response tokens only (diffusion noises only them, DFlash anchors its blocks in them), as SpecForge trains drafters
        keep_given: mdlm or usdm with --answer-sep, an answer that edits a prompt of its own length (sudoku): never noise the answer tokens the prompt already holds at the same place (the givens, pinned at solving), so the loss reads only the unknowns; default on for a .csv task corpus
    """

    objective: str = "ar"
    preset: str = "tiny"
    data: str = "stdlib"
    tokenizer: str | None = None
    vocab_size: int = 4096
    seq_len: int = 256
    batch_size: int = 16
    max_steps: int = 1000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: float = 0.04
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 250
    log_every: int = 10
    seed: int = 0
    device: str = "auto"
    compile: bool = False
    dtype: str = "auto"
    grad_accum: int = 1
    fsdp: bool = False
    activation_checkpointing: bool = False
    init_from: str | None = None
    grow_layers: int = 0
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    freeze_router: bool = False
    # block diffusion (mdlm) and the DFlash drafter (dflash): one name for one idea
    block_size: int | None = None
    # uniform-state diffusion (usdm)
    canvas_length: int = 256
    loss_weight: str = "constant"
    self_cond_prob: float = 0.5
    canvas_scale: str = "unit"
    canvas_shift: bool = False
    # DFlash drafter (dflash)
    target: str | None = None
    draft_layers: int = 0
    anchors: int = 0
    target_layers: list[int] = dataclasses.field(default_factory=list)
    injection: str = "kv"
    target_features: bool = True
    conv_kernel_size: int = 0
    conv_group_size: int = 16
    selector_rank: int = 0
    selector_top_k: int | None = None
    selector_weight: float = 1.0
    selector_ramp: float = 0.2
    selector_soft: bool = False
    distill_logits: bool = False
    block_noise: str = "mask"
    # joint AR + diffusion (joint)
    ar_weight: float = 1.0
    dlm_weight: float = 0.3
    dlm_data: str | None = None
    draft_rate: float = 0.0
    ar_target: float = 0.0
    draft_ar_first: bool = False
    # tasks
    fim_rate: float | None = None
    answer_sep: str | None = None
    keep_given: bool | None = None
    prompt_loss: bool | None = None

    def validate(self) -> None:
        """The checks every objective shares (each objective checks its own options)."""
        check(self.preset in PRESETS, f"--preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        for f in dataclasses.fields(self):
            if f.type == "float":
                v = getattr(self, f.name)
                check(math.isfinite(v), f"--{f.name.replace('_', '-')} must be a finite number, got {v}")
        check(self.seq_len <= MODEL_LIMITS["max_seq_len"],
              f"--seq-len must be in [1, {MODEL_LIMITS['max_seq_len']}], got {self.seq_len}")
        for f in ("seq_len", "batch_size", "max_steps", "eval_batches", "eval_every", "save_every", "log_every",
                  "grad_accum"):
            check(getattr(self, f) > 0, f"--{f.replace('_', '-')} must be > 0, got {getattr(self, f)}")
        check(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        check(0 <= self.min_lr_ratio <= 1, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        check(self.warmup >= 0, f"--warmup must be >= 0, got {self.warmup}")
        check(self.grad_clip >= 0, f"--grad-clip must be >= 0, got {self.grad_clip}")
        check(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        for f in ("beta1", "beta2"):
            check(0 <= getattr(self, f) < 1, f"--{f} must be in [0, 1), got {getattr(self, f)}")
        check_seed(self.seed)
        check(self.batch_size % self.grad_accum == 0,
              f"--batch-size {self.batch_size} must be a multiple of --grad-accum {self.grad_accum} "
              "(the global batch splits into equal micro-batches)")
        check(self.dtype in ("auto", "bf16", "fp32"), f"--dtype must be auto, bf16 or fp32, got {self.dtype!r}")
        check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
              f"--device must be auto, cpu or cuda[:N], got {self.device!r}")
        check(self.fim_rate is None or 0 <= self.fim_rate <= 1, f"--fim-rate must be in [0, 1], got {self.fim_rate}")
        check(not self.fim_rate or self.objective == "ar",
              f"--fim-rate applies to --objective ar (fill-in-the-middle for a causal model), got {self.objective}")
        check(self.grow_layers >= 0, f"--grow-layers must be >= 0, got {self.grow_layers}")
        check(self.lora_rank >= 0 and self.lora_alpha >= 0,
              f"--lora-rank and --lora-alpha must be >= 0, got {self.lora_rank}, {self.lora_alpha}")
        check(not self.lora_rank or self.objective != "dflash",
              "--lora-rank adapts a model's own layers; a DFlash drafter is small: train it whole")
        check(bool(self.lora_targets.strip(", ")), "--lora-targets must name at least one linear layer")
        check(not self.grow_layers or (self.init_from is not None and self.objective != "dflash"),
              "--grow-layers adds layers to an --init-from checkpoint (not to a DFlash drafter: see --draft-layers)")
        check(self.block_noise in ("mask", "uniform"), f"--block-noise must be mask or uniform, got {self.block_noise!r}")
        dflash2 = {"conv_kernel_size": 0, "selector_rank": 0, "distill_logits": False, "block_noise": "mask"}
        for f, off in dflash2.items():
            check(getattr(self, f) == off or self.objective == "dflash",
                  f"--{f.replace('_', '-')} applies to --objective dflash, got {self.objective}")
        check(self.dlm_data is None or self.objective == "joint",
              f"--dlm-data applies to --objective joint, got {self.objective}")
        check(not self.draft_rate or self.objective == "joint",
              f"--draft-rate applies to --objective joint, got {self.objective}")
        check(not self.draft_ar_first or self.objective == "joint",
              f"--draft-ar-first applies to --objective joint, got {self.objective}")
        check(not self.ar_target or self.objective == "joint",
              f"--ar-target applies to --objective joint, got {self.objective}")
        check(not self.answer_sep or self.objective in ("ar", "mdlm", "usdm"),
              f"--answer-sep applies to --objective ar, mdlm or usdm, got {self.objective}")
        check(not self.keep_given or (self.objective in ("mdlm", "usdm") and self.answer_sep != ""),
              f"--keep-given applies to --objective mdlm or usdm with an --answer-sep, got --objective {self.objective} "
              f"--answer-sep {self.answer_sep!r}")

    def resolved(self) -> TrainConfig:
        """The config with the defaults that depend on other options filled in (what a run saves)."""
        fim = self.fim_rate if self.fim_rate is not None else (0.5 if self.objective == "ar" else 0.0)
        sep = self.answer_sep
        if sep is None:
            sep = "=" if self.data.lower().endswith(".csv") and self.objective in ("ar", "mdlm", "usdm") else ""
        keep = self.keep_given
        if keep is None:
            keep = bool(sep) and self.objective in ("mdlm", "usdm") and self.data.lower().endswith(".csv")
        return dataclasses.replace(self, fim_rate=fim, answer_sep=sep, keep_given=keep,
                                   prompt_loss=bool(self.prompt_loss))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """A saved run's config (other names of options accepted)."""
        d = dict(d)
        if "block_length" in d:  # an mdlm run's block_size under the other name
            old = d.pop("block_length")
            if d.get("objective") == "mdlm":
                d["block_size"] = old
        d.setdefault("fim_rate", 0.0)  # runs saved before fill-in-the-middle existed trained without it
        d.setdefault("answer_sep", "")
        d.setdefault("keep_given", False)  # runs saved before --keep-given noised the givens too
        d.setdefault("prompt_loss", True)  # runs saved before response-only losses read every token
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise DlmError(f"train config has unknown fields {unknown}")
        return cls(**d)


@dataclass
class SampleConfig:
    """Sampling options (each paradigm reads the ones that concern it).

    Attributes:
        max_new_tokens: tokens to generate at most (infilling: the middle's length)
        temperature: 0 = greedy; > 0 samples (AR, speculative, mdlm); default 0, or for generate, chat and serve an imported model's generation_config.json's (see --generation-config)
        top_k: keep the k most likely tokens (0 = off; generate, chat and serve: a sampling generation_config.json's, 50 where it leaves top_k out)
        top_p: nucleus sampling mass in (0, 1] (generate, chat and serve: a sampling generation_config.json's)
        seed: makes sampling reproducible
        generation_config: auto (an imported model's generation_config.json sets the defaults of the options not given, as transformers' generate reads them: AR and speculative: do_sample false = greedy, true = its temperature, top_k (50 unset) and top_p; DiffusionGemma: its steps, t_max, t_min, entropy bound and stopping thresholds) or none (dlm's own defaults: greedy); read by generate, chat and serve, not by eval and bench
        naive: AR, mdlm: recompute the whole sequence every step (no KV cache)
        sampler: confidence | threshold | entropy_bound | entropy | margin | origin (mdlm); entropy_bound (usdm); ar | self-spec-linear | self-spec-linear-ar | self-spec-quadratic | confidence | threshold | entropy_bound | entropy | margin (joint); auto = the paradigm's default
        steps: denoising steps per block (mdlm; default: one token per step; threshold / entropy_bound: at most this many) or per canvas at most (usdm; default 48)
        threshold: mdlm threshold sampler: commit every position with confidence above this
        entropy_bound: entropy-bound acceptance: cumulative entropy minus its largest entropy <= this
        entropy_form: mdlm entropy_bound: eb (each position's predictive entropy, the acceptance above) or sdar (SDAR's entropy_bounded as its generate.py computes it, the sdar preset's: one "entropy" for the whole block, the sum over its positions of -p log p of each drawn token's probability p; the holes commit left to right, as many as multiples of that sum stay below --entropy-bound, at least one; a block gets at most --steps + 1 passes, and one that takes them all keeps its holes as <mask> and is out of every later block's context, as SDAR's KV cache never holds it)
        block_size: a block of positions: mdlm's semi-autoregressive block (default: the checkpoint's training block, else the whole generation); speculative: the block of one verify cycle, the last committed token + block_size-1 proposals (default: the drafter's: its block size for DFlash, 5 for an AR draft, 8 for lookup)
        remasking: mdlm, the confidence sampler: which k positions a step commits: low_confidence (the most confident), random, or sequential (the k from the block's first hole on, left to right: SDAR's `sequential`; a committed position in that stretch, after a <mask> proposal kept a hole before it, is drawn again, as there)
        preset: mdlm: a public model's decoding recipe: llada | fast-dllm | dream | sdar | fast-dllm-v2 | llada2 | llada2.1 | none (options given explicitly win; default: the one an imported checkpoint records, docs/public-models.md)
        prefix_cache: mdlm, a full-attention checkpoint (LLaDA, Dream): Fast-dLLM's approximate prefix cache (a block's later passes read the K/V its first pass computed for the positions before it); off = exact, the whole sequence every step
        dual_cache: mdlm, a full-attention checkpoint (LLaDA, Dream): Fast-dLLM's approximate dual cache (a block's first pass keeps the K/V of every position; its later passes rerun only the block, reading the positions before and after it from that cache); implies the prefix cache; off = exact, the whole sequence every step
        schedule: mdlm: positions committed per step: even (a block's holes spread evenly over --steps, LLaDA), dream (Dream's time grid, linspace(1, 1e-3, steps + 1): int(holes x (1 - t[i+1] / t[i])), the rest at the last step) or block (the block's length spread over --steps, prompt positions included: LLaDA 2 and SDAR; with LLaDA 2, steps above the generation's length shrink to it)
        whole_blocks: mdlm: pad the last block with holes to its full size and denoise it whole, as training saw blocks (SDAR, Fast-dLLM v2); what lies past --max-new-tokens is dropped
        eos_early_stop: mdlm: stop denoising the positions after a committed <eos> at once (fewer passes; the tokens before it may differ from the public models' own generate, which denoises the block whole and cuts after the <eos>: the default)
        confidence: mdlm: the probability the commit rules read: model (the model's probability of the proposed token) or sampled (at temperature > 0, its probability under the distribution it was drawn from, temperature and top-k/top-p applied: SDAR's generate; the sdar preset's)
        mask_proposals: mdlm: keep <mask> among the candidates a step proposes (a position whose proposal is <mask> stays masked), as LLaDA's, Dream's and SDAR's own generate functions do (their presets set it); off: <mask> is never proposed
        draw_holes: mdlm at temperature > 0: a draw only for the positions still masked, one each in order (torch's categorical draw), the confidence, entropy and margin read from the distribution drawn from (Dream's sample_tokens; the dream preset's); default: a draw for every position of the block, the scores from the model's own distribution
        threshold_cap: mdlm, the threshold sampler with --steps: a step commits at most its quota (the block's holes spread evenly over --steps, what a step leaves carried to the next), the most confident above --threshold, at least the most confident; past --steps, what is left of the quota (Dream's alg="confidence_threshold"; the dream preset's); off: the quota is the least a step commits
        leave_holes: mdlm: a block ends after its planned passes (--steps, one a position without; --threshold-cap: once its quota is spent), holes or not, a hole left being <mask> in the output and <mask> proposed on every pass, as Dream's generate and Fast-dLLM's Dream block decoding end (with one step per block: the block's first position alone); the dream preset's; off (and with --revise): a block is denoised until no hole is left
        redraw_committed: mdlm, low-confidence remasking and the threshold sampler: a step whose count is above the positions still masked (a quota of the block's length over --steps, --schedule block, with fewer steps than the block) draws the rest again among the block's committed positions, the prompt's included, the ones torch.topk picks among their -inf scores (SDAR's generate; the sdar preset's); off: a step commits at most the holes left
        alg_temp: mdlm, the confidence, entropy and margin samplers: draw the positions a step commits, without replacement, with probabilities softmax(score / alg_temp) over the sequence (Dream's alg_temp: torch.multinomial from the row's generator after the step's token draws), instead of taking the highest scores; default off (0)
        gumbel: mdlm at temperature > 0: LLaDA's draw (its generate's float64 Gumbel noise): a float64 uniform u for every token of every position of the whole sequence, prompt included, from the row's generator, each position's token the argmax of exp(logit) / (-log u)^T; with --seed S the draws of LLaDA's generate after torch.manual_seed(S) (the llada preset's); default: one draw per position of the block (torch.multinomial's), the same distribution at a fraction of the draws
        logits_eos_inf: mdlm: the <eos> logit at -inf before each draw, so no position proposes <eos> (LLaDA's generate's logits_eos_inf)
        confidence_eos_eot_inf: mdlm, low-confidence remasking: a proposed <eos> or <|eot_id|> has confidence 0, so it commits last in its block (LLaDA's generate's confidence_eos_eot_inf: the softmax the confidence reads has those logits at -inf; as there, at temperature > 0 only <|eot_id|>'s)
        cfg_scale: mdlm, a full-attention checkpoint (LLaDA): classifier-free guidance: each pass also runs with the prompt's tokens at <mask>, and the logits are un + (s + 1) (cond - un) (LLaDA's generate's cfg_scale; twice the forwards); 0 = off
        sub_block: mdlm: commit only in the first stretch of this many positions of the block that still has holes (Fast-dLLM v2: 8); a step reads (at temperature > 0: draws for) that stretch's positions only; default: the whole block
        block_cache: mdlm with --sub-block, a block-causal checkpoint: Fast-dLLM v2's block cache (its generate's use_block_cache): a pass whose sub-block starts with a known token runs only that sub-block's positions, reading the rest of the block's K/V as the block's last whole pass left them (an approximation: fewer positions per pass); off: every pass runs the whole block
        greedy_first: mdlm, a shifted checkpoint (Fast-dLLM v2): the first token of a block after a finished one (read from the finished block alone, committed alone) is its most likely token whatever the temperature, as Fast-dLLM v2's generate appends it (the fast-dllm-v2 preset's); off: drawn as the others
        editing_threshold: mdlm token editing (LLaDA 2.1): every pass also replaces a token the block has committed when the model's most likely token there differs with probability above this; default off
        max_post_steps: mdlm token editing: passes that only edit after a block's last mask (LLaDA 2.1's max_post_steps)
        revise: mdlm revision (ReMDM-style): a committed token whose probability under a later pass falls below this goes back to <mask> and is predicted again (at most 3 times per position); 0 = off
        canvas_length: usdm: tokens per canvas (default: the checkpoint's)
        t_max: usdm: temperature of the first step
        t_min: usdm: temperature approached at the last step
        stability_threshold: usdm adaptive stopping: steps the argmax canvas must stay unchanged
        confidence_threshold: usdm adaptive stopping: mean entropy below which a canvas may stop
        adaptive: usdm: stop a canvas early (adaptive stopping); off = always the full number of steps
        self_cond_input: usdm: what the next step is self-conditioned on: tempered (the softmax of the temperature-scaled logits, as DiffusionGemma's reference sampler) or untempered (their T = 1 softmax, what training feeds)
        ar_seed: joint, the diffusion samplers: blocks start right after the prompt; each block's first token is the AR mode's next token, read from the causal pass that writes the prompt or the block before to the cache, and its other positions are denoised over that cache (confidence: --steps of the block's budget, default one per position; threshold: every hole at or above --threshold, at least the most confident; at temperature > 0 LLaDA's float64 Gumbel draw): Nemotron-Labs-Diffusion's generate. Default: on for an imported Nemotron-Labs-Diffusion, off for dlm's own joint checkpoints (blocks on the training grid, finished blocks written in the next block's first pass)
        draft_threshold: self-spec-linear, greedy: the draft is denoised in passes over the cache, each committing every slot whose confidence is at or above this (at least the most confident), until the block is full (Nemotron-Labs-Diffusion's linear_spec_generate threshold); 0: one pass fills every slot
        bidirectional_context: joint, --ar-seed: the prompt and every finished block are written to the cache by a bidirectional pass (each position seeing the whole prompt or block and the cache) and no block is seeded by the AR mode (every position starts <mask>): Nemotron-Labs-Diffusion's generate with causal_context=False; off: causal writes, AR seeds
        shift_logits: joint, --ar-seed: a denoising pass reads position j's proposal from the output at j - 1, a block's first position's from the last output of the pass that wrote the cache before it (generate_diffusion's shift_logits, Dream-style); off: each position from its own output
        max_thinking_tokens: joint, --ar-seed: a thinking budget: a block that reaches past this many generated tokens while the answer before it holds no --end-think token gets that token at this position (the block's first when the budget ran out before it), a known token before the block's first pass (Nemotron-Labs-Diffusion's generate with max_thinking_tokens); default: none
        end_think: the token --max-thinking-tokens injects, as its text (one token of the tokenizer)
        ar_mix_weight: joint, self-spec-quadratic, greedy: each row verifies (and takes its bonus token) with W x the AR mode's logit + (1 - W) x the logit of its first mask slot (the same position), as self_spec_generate's ar_mix_weight: not lossless; default: the AR mode's logit alone
        last_canvas: usdm, when --max-new-tokens ends inside a canvas: whole (denoise a whole canvas, as DiffusionGemma's generate does; what lies past --max-new-tokens is dropped) or fit (a canvas of only the positions left); default: whole for an imported DiffusionGemma, fit for dlm's own usdm checkpoints
        suffix: infilling: text after the hole (pinned, comes out byte-exact)
        fill_length: template markers: positions per <fill> (<fill:N> asks for N)
        draft: speculative decoding: a drafter checkpoint folder, or 'lookup' (prompt lookup), or FOLDER+lookup (that drafter, giving way to prompt lookup in cycles whose context ends in an n-gram of --lookup-ngram tokens seen before: those drafts cost nothing)
        draft_passes: DFlash: denoising passes per draft (1-3; later passes re-predict the slots below 0.9 confidence)
        draft_top_k: DFlash 2: candidates per slot the selector chooses among (default: the drafter's selector_top_k, what it was trained with); at T > 0 more candidates give its proposal distribution more of the target's support
        draft_branches: DFlash: paths per draft that differ at the first slot (its best W candidates greedy, W draws without replacement at T > 0), verified together in one forward of 1 + W x (block - 1) tokens (multi-draft verification; 1: one path)
        lookup_ngram: prompt lookup: longest n-gram to match in the context (FOLDER+lookup: the n-gram that must match for lookup to draft)
        check_lossless: speculative: also run the target alone and report whether the outputs agree
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    generation_config: str = "auto"
    naive: bool = False
    # diffusion (mdlm, usdm)
    sampler: str = "auto"
    steps: int | None = None
    threshold: float = 0.9
    entropy_bound: float = 0.1
    entropy_form: str = "eb"
    block_size: int | None = None
    remasking: str = "low_confidence"
    preset: str | None = None
    prefix_cache: bool = False
    dual_cache: bool = False
    sub_block: int | None = None
    block_cache: bool = False
    greedy_first: bool = False
    schedule: str = "even"
    whole_blocks: bool = False
    eos_early_stop: bool = False
    confidence: str = "model"
    mask_proposals: bool = False
    draw_holes: bool = False
    threshold_cap: bool = False
    leave_holes: bool = False
    redraw_committed: bool = False
    gumbel: bool = False
    alg_temp: float | None = None
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    cfg_scale: float = 0.0
    revise: float = 0.0
    editing_threshold: float | None = None
    max_post_steps: int = 16
    canvas_length: int | None = None
    t_max: float = 0.8
    t_min: float = 0.4
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    adaptive: bool = True
    self_cond_input: str = "tempered"
    last_canvas: str | None = None
    # joint
    ar_seed: bool | None = None
    draft_threshold: float = 0.0
    bidirectional_context: bool = False
    shift_logits: bool = False
    ar_mix_weight: float | None = None
    max_thinking_tokens: int | None = None
    end_think: str = "</think>"
    suffix: str | None = None
    fill_length: int = 16
    # speculative decoding
    draft: str | None = None
    draft_passes: int = 1
    draft_top_k: int | None = None
    draft_branches: int = 1
    lookup_ngram: int = 3
    check_lossless: bool = False

    # the options the user set (command-line flags, --config keys, request fields): a preset fills only the others,
    # so an option given at its default value is kept (dlm.sampling.mdlm.apply_preset)
    given: ClassVar[frozenset[str]] = frozenset()

    def replace(self, **kw) -> SampleConfig:
        new = dataclasses.replace(self, **kw)
        new.given = self.given
        return new

    def check(self) -> None:
        """The checks that hold for every paradigm, made before anything heavy is imported or loaded (each sampler
        checks the rest, and these again)."""
        check_seed(self.seed)
        check(self.generation_config in ("auto", "none"),
              f"--generation-config must be auto or none, got {self.generation_config!r}")
        check(self.temperature >= 0, f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        check(self.top_k >= 0, f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        check(0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}")
        check(self.max_new_tokens > 0, f"--max-new-tokens must be > 0, got {self.max_new_tokens}")
        check(self.steps is None or self.steps > 0, f"--steps must be > 0, got {self.steps}")
        check(self.fill_length > 0, f"--fill-length must be > 0, got {self.fill_length}")
