"""The Llama-family decoder (Llama 2/3.x, Qwen2/2.5, Mistral, SmolLM) over a paged KV cache.

Owns the weights in fused form (QKV in one matrix, gate/up in one matrix: one matmul each) and the RoPE
cos/sin tables (`rope`, fp32, precomputed up to `max_position_embeddings`; every step's AttentionMetadata
carries them beside the positions, so a layer's call takes only the step's metadata). Invariants: `forward`
writes the step's K/V for layer l into `kv_cache[l]` before attending, then calls `layer_hook(l)`; it
returns the residual stream before the final norm, which `compute_logits` applies (norm is per row, so the
caller may select rows first). Nothing in `forward` syncs with the host, so it can be captured in a CUDA
graph. Everything between the matrix products goes through `ops` (one fused kernel each on GPU: add + norm,
RoPE + KV write, SiLU x up); each layer leaves its MLP output for the next layer's norm to add into the
residual stream, so the stream is updated in place and only the last add is a separate op.
Matrix products go through `linear` with weight handles made by `prepare_weights`, which every loader calls
once the weights are final (oneDNN-packed copies on a CPU in fp32, the parameters themselves elsewhere);
until then the handles are the parameters and the product is `F.linear`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from pdserve.kernels.linear import DenseLinear, Linear, select_linear
from pdserve.kernels.ops import AttentionMetadata, AttentionOps, RopeTables
from pdserve.shared.model.model_config import ModelConfig, RopeScaling
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [D/2] fp32, with the checkpoint's scaling (as Hugging Face computes them)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # [D/2]
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _param(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    """Uninitialised weight; `load_weights` or `dummy_weights` fills it."""
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param((size,), device, dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in fp32, scaled in the model dtype, as the reference implementations do
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)  # [T, E]
        return normed * self.weight


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        hq, d, e, f = cfg.num_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
        self.num_heads, self.head_dim = hq, d
        self.scale = d**-0.5
        self.input_norm = RMSNorm(e, cfg.rms_norm_eps, device, dtype)
        self.qkv_weight = _param((cfg.qkv_size, e), device, dtype)  # rows: q | k | v
        self.qkv_bias = _param((cfg.qkv_size,), device, dtype) if cfg.attention_bias else None
        self.o_weight = _param((e, hq * d), device, dtype)
        # Llama's attention_bias covers o_proj too; Qwen2's covers only q/k/v
        has_o_bias = cfg.attention_bias and cfg.architecture != "qwen2"
        self.o_bias = _param((e,), device, dtype) if has_o_bias else None
        self.post_norm = RMSNorm(e, cfg.rms_norm_eps, device, dtype)
        self.gate_up_weight = _param((2 * f, e), device, dtype)  # rows: gate | up
        self.down_weight = _param((e, f), device, dtype)
        self.prepare(DenseLinear())

    def prepare(self, linear: Linear) -> None:
        """Make the matmul handles of this layer's current weights (detached: not registered twice)."""
        self.linear = linear
        self.qkv_w = linear.prepare(self.qkv_weight.detach())
        self.o_w = linear.prepare(self.o_weight.detach())
        self.gate_up_w = linear.prepare(self.gate_up_weight.detach())
        self.down_w = linear.prepare(self.down_weight.detach())

    def forward(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        ops: AttentionOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual: [T, E] stream, updated in place; delta: [T, E] the previous layer's MLP output, not
        yet added (None before the first layer). Returns (this layer's MLP output, residual): the add is
        left to the next norm, which fuses it. kv_layer: [2, N, B, Hkv, D]."""
        n_tokens = residual.shape[0]
        hq, d = self.num_heads, self.head_dim
        norm = self.input_norm
        if delta is None:
            normed = ops.rms_norm(residual, norm.weight, norm.eps)  # normed: [T, E]
        else:
            normed, residual = ops.add_rms_norm(delta, residual, norm.weight, norm.eps)
        linear = self.linear.linear
        qkv = linear(normed, self.qkv_w, self.qkv_bias)  # qkv: [T, (Hq+2Hkv)*D]
        # q: [T, Hq, D], rotated in place in qkv; rotated K and V are in kv_layer
        q = ops.rope_write_kv(qkv, kv_layer, meta, hq)
        if meta.is_decode:
            attn = ops.decode_attention(q, kv_layer, meta, self.scale)  # attn: [T, Hq, D]
        else:
            attn = ops.prefill_attention(q, kv_layer, meta, self.scale)  # attn: [T, Hq, D]
        o = linear(attn.reshape(n_tokens, hq * d), self.o_w, self.o_bias)  # o: [T, E]
        normed, residual = ops.add_rms_norm(o, residual, self.post_norm.weight, self.post_norm.eps)
        gate_up = linear(normed, self.gate_up_w, None)  # gate_up: [T, 2F]
        return linear(ops.silu_mul(gate_up), self.down_w, None), residual  # [T, E], [T, E]


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.embed_weight = _param((cfg.vocab_size, cfg.hidden_size), device, dtype)
        self.decoder_layers = [DecoderLayer(cfg, device, dtype) for _ in range(cfg.num_layers)]
        self.layers = nn.ModuleList(self.decoder_layers)  # registers them; `decoder_layers` keeps their type
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.lm_head_weight = (
            self.embed_weight
            if cfg.tie_word_embeddings
            else _param((cfg.vocab_size, cfg.hidden_size), device, dtype)
        )
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # [D/2]
        self.rope = RopeTables.from_inv_freq(inv_freq, cfg.max_position_embeddings, device)  # [P, D/2] fp32
        self.linear: Linear = DenseLinear()
        self.lm_head_w = self.lm_head_weight.detach()

    def prepare_weights(self, linear: Linear | None = None) -> None:
        """Make every matmul's handle from the current weights with `linear` (default: the device's best
        product); loaders call it once the weights are final (a later in-place change needs another call)."""
        self.linear = linear or select_linear(self.embed_weight.device, self.dtype)
        for layer in self.decoder_layers:
            layer.prepare(self.linear)
        self.lm_head_w = self.linear.prepare(self.lm_head_weight.detach())

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: AttentionOps,
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """input_ids: [T] int64; kv_cache: [L, 2, N, B, Hkv, D]; meta: the step's, with this model's `rope`
        -> hidden [T, E] before the final norm (compute_logits applies it)."""
        cfg = self.config
        assert input_ids.dim() == 1 and meta.positions.shape == input_ids.shape, (
            input_ids.shape,
            meta.positions.shape,
        )
        assert kv_cache.dim() == 6 and kv_cache.shape[0] == cfg.num_layers and kv_cache.shape[1] == 2, (
            kv_cache.shape
        )
        assert kv_cache.shape[4:] == (cfg.num_kv_heads, cfg.head_dim), kv_cache.shape
        assert meta.rope is self.rope, "the step's metadata must carry this model's RoPE tables (model.rope)"
        h = F.embedding(input_ids, self.embed_weight)  # h: [T, E] residual stream
        delta: torch.Tensor | None = None  # [T, E] the last layer's MLP output, not yet in h
        for i, layer in enumerate(self.decoder_layers):
            delta, h = layer(delta, h, kv_cache[i], meta, ops)
            if layer_hook is not None:
                layer_hook(i)
        return h if delta is None else h.add_(delta)

    def compute_logits(self, hidden: torch.Tensor, ops: AttentionOps | None = None) -> torch.Tensor:
        """hidden: [S, E] rows of `forward`'s output -> logits [S, V] float32. With `ops`, the final norm is
        the fused kernel (one launch instead of four inside a decode step)."""
        normed = self.norm(hidden) if ops is None else ops.rms_norm(hidden, self.norm.weight, self.norm.eps)
        return self.linear.linear(normed, self.lm_head_w, None).float()  # [S, V]

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...) into the fused parameters.

        Each source tensor is copied once, converted to the model's dtype and device on the way. Raises
        ValueError naming a missing, unexpected or misshapen tensor.
        """
        cfg = self.config
        used: set[str] = set()

        def take(name: str, dst: torch.Tensor) -> None:
            src = weights.get(name)
            if src is None:
                raise ValueError(f"weight {name!r} is missing")
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(src)
            used.add(name)

        take("model.embed_tokens.weight", self.embed_weight)
        take("model.norm.weight", self.norm.weight)
        if not cfg.tie_word_embeddings:
            take("lm_head.weight", self.lm_head_weight)
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv_split = (
            ("q_proj", 0, q_rows),
            ("k_proj", q_rows, kv_rows),
            ("v_proj", q_rows + kv_rows, kv_rows),
        )
        for i, layer in enumerate(self.decoder_layers):
            p = f"model.layers.{i}."
            take(p + "input_layernorm.weight", layer.input_norm.weight)
            take(p + "post_attention_layernorm.weight", layer.post_norm.weight)
            for proj, start, rows in qkv_split:
                take(f"{p}self_attn.{proj}.weight", layer.qkv_weight[start : start + rows])
                if layer.qkv_bias is not None:
                    take(f"{p}self_attn.{proj}.bias", layer.qkv_bias[start : start + rows])
            take(p + "self_attn.o_proj.weight", layer.o_weight)
            if layer.o_bias is not None:
                take(p + "self_attn.o_proj.bias", layer.o_bias)
            take(p + "mlp.gate_proj.weight", layer.gate_up_weight[: cfg.intermediate_size])
            take(p + "mlp.up_proj.weight", layer.gate_up_weight[cfg.intermediate_size :])
            take(p + "mlp.down_proj.weight", layer.down_weight)
        # a tied checkpoint may still carry lm_head; rotary buffers are recomputed here
        ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
        unexpected = sorted(
            n for n in weights if n not in used and n not in ignorable and "rotary_emb" not in n
        )
        if unexpected:
            raise ValueError(f"unexpected weights {unexpected[:5]} ({len(unexpected)} in all)")
        self.prepare_weights()
