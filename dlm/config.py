"""Model configuration: one dataclass, a few presets.

The field names follow the model, not transformers; `dlm.hf` maps them onto Qwen3/Llama configs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dlm.errors import DlmError, check


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    dim: int = 256  # hidden size D
    n_layers: int = 6
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: n_heads % n_kv_heads == 0
    head_dim: int = 0  # 0 means dim // n_heads (Qwen3 may set it explicitly)
    ffn_dim: int = 768  # SwiGLU hidden size
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None (default RoPE) or a Llama-3 {"rope_type": "llama3", ...}
    norm_eps: float = 1e-6
    qk_norm: bool = True  # Qwen3: RMSNorm on q and k per head; Llama: off
    tie_embeddings: bool = True
    max_seq_len: int = 1024  # longest position the model is trained and sampled for
    self_cond: bool = False  # uniform-state diffusion: self-conditioning module (DiffusionGemma)

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.dim // max(self.n_heads, 1)
        self.validate()

    def validate(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len"):
            check(getattr(self, name) > 0, f"model.{name} must be > 0, got {getattr(self, name)}")
        check(
            self.n_heads % self.n_kv_heads == 0,
            f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.n_kv_heads})",
        )
        check(self.head_dim % 2 == 0, f"model.head_dim must be even for RoPE, got {self.head_dim}")
        check(self.rope_theta > 0, f"model.rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            check(kind in ("default", "llama3"), f"model.rope_scaling type must be 'default' or 'llama3', got {kind!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise DlmError(f"model config has unknown fields {unknown}; known: {sorted(names)}")
        return cls(**d)

    def num_params(self) -> int:
        """Parameter count of the backbone (without self-conditioning)."""
        d, hd = self.dim, self.head_dim
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads) + (2 * hd if self.qk_norm else 0)
        mlp = 3 * d * self.ffn_dim
        per_layer = attn + mlp + 2 * d
        emb = self.vocab_size * d
        return emb + self.n_layers * per_layer + d + (0 if self.tie_embeddings else emb)


# Presets. vocab_size is filled from the tokenizer when a model is built for training.
PRESETS: dict[str, dict[str, Any]] = {
    # for tests: ~0.3M parameters with a 4k vocabulary
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, max_seq_len=512),
    # the shipped reference models: ~3.8M parameters with a 4k vocabulary
    "small": dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=640, max_seq_len=1024),
    # the AR draft model of ar-small (speculative-decoding baseline): ~0.92M parameters with a 4k vocabulary,
    # comparable to a 1-layer DFlash drafter at ar-small's width (~0.95M, embedding and head shared with the target)
    "draft": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=1024),
    # for GPU runs: ~26M parameters with a 4k vocabulary
    "base": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1408, max_seq_len=2048),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise DlmError(f"--preset must be one of {sorted(PRESETS)}, got {name!r}")
    return ModelConfig(**{**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}})

