"""`ModelConfig`: the architecture of a Llama-family decoder, frozen and validated at construction.

Invariants: every field is checked in `__post_init__` (a bad value raises ValueError naming the field);
`to_dict()` is canonical (plain JSON types, same dict for equal configs), because the model fingerprint
hashes it. Sliding-window attention is not implemented, so a config that declares a window shorter than
its context is clamped: `max_position_embeddings` becomes the window, which keeps every served token exact.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "mistral")
ROPE_TYPES = ("llama3", "linear")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: `llama3` (Llama 3.1 smooth interpolation) or `linear` (divide by factor)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type={self.rope_type!r}; accepted: {ROPE_TYPES}")
        if not self.factor >= 1.0:
            raise ValueError(f"rope_scaling.factor={self.factor!r} must be >= 1")
        if self.rope_type == "llama3":
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                raise ValueError(
                    f"rope_scaling low_freq_factor={self.low_freq_factor!r} and "
                    f"high_freq_factor={self.high_freq_factor!r} must satisfy 0 < low < high"
                )
            if self.original_max_position_embeddings <= 0:
                raise ValueError(
                    "rope_scaling.original_max_position_embeddings="
                    f"{self.original_max_position_embeddings!r} must be > 0"
                )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r}; accepted: {ARCHITECTURES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r} must be > 0")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta!r} must be > 0")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling={self.rope_scaling!r} must be a RopeScaling or None")
        if self.bos_token_id is not None and not 0 <= self.bos_token_id < self.vocab_size:
            raise ValueError(f"bos_token_id={self.bos_token_id} outside [0, vocab_size={self.vocab_size})")
        if not isinstance(self.eos_token_ids, tuple):
            raise ValueError(f"eos_token_ids={self.eos_token_ids!r} must be a tuple")
        for eos in self.eos_token_ids:
            if not 0 <= eos < self.vocab_size:
                raise ValueError(f"eos_token_ids has {eos}, outside [0, vocab_size={self.vocab_size})")

    @property
    def qkv_size(self) -> int:
        """Rows of the fused QKV projection: (Hq + 2 * Hkv) * D."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        """Canonical JSON-able dict (the model fingerprint hashes it); `from_dict` inverts it."""
        out = dataclasses.asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        fields = dict(d)
        scaling = fields.get("rope_scaling")
        fields["rope_scaling"] = RopeScaling(**scaling) if scaling is not None else None
        fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
        return cls(**fields)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face `config.json` dict (4.x `rope_scaling` or 5.x `rope_parameters`)."""
        arch = hf.get("model_type")
        if arch not in ARCHITECTURES:
            raise ValueError(f"config.json model_type={arch!r}; accepted: {ARCHITECTURES}")
        if hf.get("mlp_bias"):
            raise ValueError("config.json mlp_bias=true is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act={hf['hidden_act']!r}; only 'silu' is supported")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        num_heads = int(hf["num_attention_heads"])
        max_pos = int(hf.get("max_position_embeddings", 4096))
        window = hf.get("sliding_window")
        if window and (arch == "mistral" or hf.get("use_sliding_window")):
            max_pos = min(max_pos, int(window))
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(int(e) for e in eos)
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling_from_dict(rope),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def rope_scaling_from_dict(rope: dict[str, Any]) -> RopeScaling | None:
    """HF's rope dict (`rope_type` or legacy `type`) -> RopeScaling; None for the default RoPE."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; accepted: {ROPE_TYPES}")
    if rope_type == "linear":
        return RopeScaling("linear", float(rope["factor"]))
    return RopeScaling(
        "llama3",
        float(rope["factor"]),
        float(rope["low_freq_factor"]),
        float(rope["high_freq_factor"]),
        int(rope["original_max_position_embeddings"]),
    )


NAMED_SHAPES: dict[str, ModelConfig] = {
    "llama-3.1-8b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3.1-70b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
    "smollm2-135m": ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
}
