"""`ModelConfig`: the architecture of a Llama-family decoder (dense, or with mixture-of-experts MLPs),
frozen and validated at construction.

Invariants: every field is checked in `__post_init__` (a bad value raises ValueError naming the field);
`to_dict()` is canonical (plain JSON types, same dict for equal configs), because the model fingerprint
hashes it; `moe` appears in it only when set, so a dense model's fingerprint is what it was before MoE
existed. `moe` is set exactly for the MoE architectures. Per-head q/k RMSNorm (Qwen3) and which biases
exist follow from the architecture (`qk_norm`, `o_bias`), as they do in Hugging Face's classes.
Sliding-window attention is not implemented, so a config that declares a window shorter than its context
is clamped: `max_position_embeddings` becomes the window, which keeps every served token exact.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe")
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "qwen2_moe")
QK_NORM_ARCHITECTURES = ("qwen3", "qwen3_moe")
QKV_BIAS_ARCHITECTURES = ("qwen2", "qwen2_moe")
"""Their attention bias covers q/k/v only; Llama's (and Qwen3's) `attention_bias` covers o_proj too."""
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
class MoEConfig:
    """The sparse MLP: a router picks `top_k` of `num_experts` SwiGLU experts per token (softmax over all
    experts in fp32, then the top k; `norm_topk_prob`: the k weights renormalised to sum to 1, as Mixtral
    always does). An optional shared expert (Qwen2-MoE) runs on every token, scaled by sigmoid of its
    own 1-row gate. Layer i is sparse unless i is in `mlp_only_layers` or (i + 1) % `decoder_sparse_step`
    is not 0; the dense ones use the model's `intermediate_size`."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"moe.{name}={value!r} must be a positive int")
        if self.top_k > self.num_experts:
            raise ValueError(f"moe.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"moe.shared_expert_intermediate_size={self.shared_expert_intermediate_size} must be >= 0"
            )
        if not isinstance(self.mlp_only_layers, tuple):
            raise ValueError(f"moe.mlp_only_layers={self.mlp_only_layers!r} must be a tuple")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


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
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r}; accepted: {ARCHITECTURES}")
        if (self.moe is not None) != (self.architecture in MOE_ARCHITECTURES):
            raise ValueError(
                f"architecture={self.architecture!r} with moe={self.moe!r}: the MoE architectures "
                f"{MOE_ARCHITECTURES} need a MoEConfig and the others take none"
            )
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise ValueError(f"moe={self.moe!r} must be a MoEConfig or None")
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

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of q and k (over head_dim) before RoPE (Qwen3)."""
        return self.architecture in QK_NORM_ARCHITECTURES

    @property
    def o_bias(self) -> bool:
        """Whether o_proj has a bias."""
        return self.attention_bias and self.architecture not in QKV_BIAS_ARCHITECTURES

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts."""
        return self.moe is not None and self.moe.is_sparse(layer)

    def to_dict(self) -> dict[str, Any]:
        """Canonical JSON-able dict (the model fingerprint hashes it); `from_dict` inverts it."""
        out = dataclasses.asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        if self.moe is None:
            del out["moe"]
        else:
            out["moe"]["mlp_only_layers"] = list(self.moe.mlp_only_layers)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        fields = dict(d)
        scaling = fields.get("rope_scaling")
        fields["rope_scaling"] = RopeScaling(**scaling) if scaling is not None else None
        fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
        moe = fields.get("moe")
        if moe is not None:
            fields["moe"] = MoEConfig(**{**moe, "mlp_only_layers": tuple(moe.get("mlp_only_layers", ()))})
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
        if window and (arch in ("mistral", "mixtral") or hf.get("use_sliding_window")):
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
            attention_bias=_attention_bias(arch, hf),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=moe_from_hf(arch, hf),
        )


def _attention_bias(arch: str, hf: dict[str, Any]) -> bool:
    if arch == "qwen2":
        return True
    if arch == "qwen2_moe":
        return bool(hf.get("qkv_bias", True))
    return bool(hf.get("attention_bias", False))


def moe_from_hf(arch: str, hf: dict[str, Any]) -> MoEConfig | None:
    """The MoE part of an HF config (None for a dense architecture). Mixtral's experts are
    `intermediate_size` wide and always renormalise their top-k weights; the Qwen MoE families name the
    expert width `moe_intermediate_size`. `num_local_experts` is what transformers 5 writes for
    `num_experts`."""
    if arch not in MOE_ARCHITECTURES:
        return None
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not experts:
        raise ValueError(f"config.json model_type={arch!r} has no num_experts (or num_local_experts)")
    if arch == "mixtral":
        return MoEConfig(int(experts), int(hf.get("num_experts_per_tok", 2)), int(hf["intermediate_size"]),
                         norm_topk_prob=True)  # fmt: skip
    return MoEConfig(
        num_experts=int(experts),
        top_k=int(hf["num_experts_per_tok"]),
        intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
        decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
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


def _shape(architecture: str, vocab: int, hidden: int, intermediate: int, layers: int, heads: int,
           kv_heads: int, *, theta: float, max_pos: int, bos: int, eos: tuple[int, ...], head_dim: int = 128,
           eps: float = 1e-5, scaling: RopeScaling | None = None, tie: bool = False,
           moe: MoEConfig | None = None) -> ModelConfig:  # fmt: skip
    """One row of NAMED_SHAPES: the numbers that tell these models apart; no attention bias in any."""
    return ModelConfig(
        architecture=architecture,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=eps,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie,
        attention_bias=False,
        bos_token_id=bos,
        eos_token_ids=eos,
        moe=moe,
    )


_LLAMA31_ROPE = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


def _llama31(hidden: int, intermediate: int, layers: int, heads: int) -> ModelConfig:
    """A Llama 3.1 shape (their vocabulary, 8 KV heads, 128k context with llama3 RoPE scaling)."""
    return _shape("llama", 128256, hidden, intermediate, layers, heads, 8, theta=500000.0, max_pos=131072,
                  bos=128000, eos=(128001, 128008, 128009), scaling=_LLAMA31_ROPE)  # fmt: skip


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
           moe: MoEConfig | None = None) -> ModelConfig:  # fmt: skip
    """A Qwen3 shape (their shared vocabulary, RoPE and special tokens)."""
    architecture = "qwen3" if moe is None else "qwen3_moe"
    return _shape(architecture, 151936, hidden, intermediate, layers, heads, kv_heads, theta=1000000.0,
                  max_pos=40960, bos=151643, eos=(151645,), eps=1e-6, moe=moe)  # fmt: skip


# fmt: off
NAMED_SHAPES: dict[str, ModelConfig] = {
    "llama-3.1-8b": _llama31(4096, 14336, 32, 32),
    "llama-3.1-70b": _llama31(8192, 28672, 80, 64),
    "smollm2-135m": _shape("llama", 49152, 576, 1536, 30, 9, 3, theta=100000.0, max_pos=8192, bos=1, eos=(2,),
                           head_dim=64, tie=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, 8),
    "qwen3-30b-a3b": _qwen3(2048, 6144, 48, 32, 4, MoEConfig(128, 8, 768, norm_topk_prob=True)),
    "mixtral-8x7b": _shape("mixtral", 32000, 4096, 14336, 32, 32, 8, theta=1000000.0, max_pos=32768, bos=1,
                           eos=(2,), moe=MoEConfig(8, 2, 14336, norm_topk_prob=True)),
}
# fmt: on
