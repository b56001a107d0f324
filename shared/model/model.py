"""The Llama-family decoder (Llama 2/3.x, Qwen2/2.5, Qwen3, Mistral, SmolLM, and the mixture-of-experts
Qwen3-MoE, Mixtral and Qwen2-MoE) over a paged KV cache.

Owns the weights in fused form (QKV in one matrix, gate/up in one matrix: one matmul each) and the RoPE
cos/sin tables (`rope`, fp32, precomputed up to `max_position_embeddings`; every step's AttentionMetadata
carries them beside the positions, so a layer's call takes only the step's metadata). Invariants: `forward`
writes the step's K/V for layer l into `kv_cache[l]` before attending, then calls `layer_hook(l)`; it
returns the residual stream before the final norm, which `compute_logits` applies (norm is per row, so the
caller may select rows first). Nothing in `forward` syncs with the host, so it can be captured in a CUDA
graph. Everything between the matrix products goes through `ops` (one fused kernel each on GPU: add + norm,
RoPE + KV write, SiLU x up); each layer leaves its MLP output for the next layer's norm to add into the
residual stream, so the stream is updated in place and only the last add is a separate op. Qwen3's
per-head q/k RMSNorm runs between the QKV product and RoPE, in RoPE's own pass (`ops.rope_write_kv`'s
`qk_norm`: one kernel for the norm, RoPE and the KV write on GPU). A sparse layer's MLP is
shared/model/moe.py's `SparseMoE`, picked at construction.
Matrix products go through `linear` with weight handles made by `prepare_weights`, which every loader calls
once the weights are final (oneDNN-packed copies on a CPU in fp32, the parameters themselves elsewhere);
until then the handles are the parameters and the product is `F.linear`. With `quantization="fp8"` the
four projections of each layer are FP8 parameters with a rowwise scale each (shared/model/fp8.py), loaded
through `Fp8Weights` and multiplied by `Fp8Linear`; embeddings, norms and the LM head keep the model dtype.
Tensor parallelism (shared/model/parallel.py): a model holds one rank's share (`tp`): its query and KV
heads, its slice of the MLP and of the vocabulary. QKV and gate/up are column-parallel (this rank's rows),
O and down row-parallel (this rank's columns, partial sums all-reduced through `comm`; a bias is added on
rank 0 only, so the sum holds it once). The all-reduce that feeds a norm (O's into the post-attention norm,
down's into the next layer's input norm) is `comm.all_reduce_add_rms_norm`: one fused kernel on a GPU group,
all_reduce then `ops.add_rms_norm` elsewhere; only the last layer's down is a plain all-reduce. The embedding
all-reduces each rank's rows, and `compute_logits` gathers the vocabulary slices on rank 0 (`greedy_tokens`,
for a step that needs only each row's argmax, exchanges each rank's best (value, id) per row instead). Every
rank runs the same collectives in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from pdserve.kernels.linear import DenseLinear, Linear, select_linear
from pdserve.kernels.ops import AttentionMetadata, AttentionOps, QKNorm, RopeTables
from pdserve.shared.model.fp8 import FP8, SCALE, Fp8Linear, Fp8Weights
from pdserve.shared.model.model_config import ModelConfig, RopeScaling
from pdserve.shared.model.moe import SparseMoE
from pdserve.shared.model.parallel import Collectives, RowSlice, SingleRank, TPPlan, WeightSource, plan
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


def _detach(scale: torch.Tensor | None) -> torch.Tensor | None:
    return None if scale is None else scale.detach()


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
    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPPlan,
        comm: Collectives,
        device: torch.device,
        dtype: torch.dtype,
        sparse: bool = False,
        quantized: bool = False,
    ) -> None:
        """`sparse`: the MLP is the mixture of experts (`self.moe`) instead of the dense SwiGLU."""
        super().__init__()
        # per rank: Hq, Hkv and F are this rank's shares
        hq, d, e, f = tp.num_heads, cfg.head_dim, cfg.hidden_size, tp.intermediate_size
        self.num_heads, self.num_kv_heads, self.head_dim = hq, tp.num_kv_heads, d
        self.comm = comm
        self.scale = d**-0.5
        self.input_norm = RMSNorm(e, cfg.rms_norm_eps, device, dtype)
        wdtype = FP8 if quantized else dtype  # the four projections'; *_scale: [rows] fp32 when FP8
        self.qkv_weight = _param((tp.qkv_size, e), device, wdtype)  # rows: q | k | v
        self.qkv_bias = _param((tp.qkv_size,), device, dtype) if cfg.attention_bias else None
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, device, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, device, dtype) if cfg.qk_norm else None
        self.o_weight = _param((e, hq * d), device, wdtype)
        # Llama's attention_bias covers o_proj too; Qwen2's covers only q/k/v. Added once, on rank 0.
        self.o_bias = _param((e,), device, dtype) if cfg.o_bias and tp.rank == 0 else None
        self.post_norm = RMSNorm(e, cfg.rms_norm_eps, device, dtype)
        self.moe = SparseMoE(cfg, tp, device, dtype) if sparse else None  # experts stay in the model dtype
        # a bound method, not the module: registering `moe` twice would name its weights twice
        self.mlp: Callable[[torch.Tensor, AttentionOps], torch.Tensor] = (
            self._dense_mlp if self.moe is None else self.moe.forward
        )
        scale = (lambda rows: _param((rows,), device, torch.float32)) if quantized else (lambda rows: None)
        self.qkv_scale, self.o_scale = scale(tp.qkv_size), scale(e)
        self.gate_up_scale: nn.Parameter | None = None
        self.down_scale: nn.Parameter | None = None
        if not sparse:
            self.gate_up_weight = _param((2 * f, e), device, wdtype)  # rows: gate | up
            self.down_weight = _param((e, f), device, wdtype)
            self.gate_up_scale, self.down_scale = scale(2 * f), scale(e)
        if not quantized:
            self.prepare(DenseLinear())

    def prepare(self, linear: Linear, model_linear: Linear | None = None) -> None:
        """Make the matmul handles of this layer's current weights (detached: not registered twice) with
        `linear`; the mixture of experts, which stays in the model dtype, with `model_linear` (default
        `linear`: they differ in an FP8 model)."""
        self.linear = linear
        self.qkv_w = linear.prepare(self.qkv_weight.detach(), _detach(self.qkv_scale))
        self.o_w = linear.prepare(self.o_weight.detach(), _detach(self.o_scale))
        if self.moe is not None:
            self.moe.prepare(model_linear or linear)
        else:
            self.gate_up_w = linear.prepare(self.gate_up_weight.detach(), _detach(self.gate_up_scale))
            self.down_w = linear.prepare(self.down_weight.detach(), _detach(self.down_scale))

    def _dense_mlp(self, normed: torch.Tensor, ops: AttentionOps) -> torch.Tensor:
        """normed: [T, E] -> [T, E] this rank's partial sum."""
        act = self.linear.linear_silu_mul(normed, self.gate_up_w, ops.silu_mul)  # act: [T, F]
        return self.linear.linear(act, self.down_w, None)  # [T, E]

    def forward(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        ops: AttentionOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual: [T, E] stream, updated in place; delta: [T, E] this rank's partial sum of the previous
        layer's MLP output, not yet all-reduced nor added (None before the first layer). Returns (this
        layer's MLP output, this rank's partial sum; residual): the all-reduce and the add are left to the
        next norm, which fuses them. kv_layer: [2, N, B, Hkv, D]."""
        n_tokens = residual.shape[0]
        hq, d = self.num_heads, self.head_dim
        norm = self.input_norm
        if delta is None:
            normed = ops.rms_norm(residual, norm.weight, norm.eps)  # normed: [T, E]
        else:  # the previous layer's down projection summed over the ranks, added, normed: one op
            normed, residual = self.comm.all_reduce_add_rms_norm(delta, residual, norm.weight, norm.eps, ops)
        linear = self.linear.linear
        qkv = linear(normed, self.qkv_w, self.qkv_bias)  # qkv: [T, (Hq+2Hkv)*D]
        qk_norm = None  # Qwen3's per-head RMSNorm of q and k, fused into RoPE
        if self.q_norm is not None and self.k_norm is not None:
            qk_norm = QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        # q: [T, Hq, D], rotated in place in qkv; rotated K and V are in kv_layer
        q = ops.rope_write_kv(qkv, kv_layer, meta, hq, qk_norm)
        if meta.is_decode:
            attn = ops.decode_attention(q, kv_layer, meta, self.scale)  # attn: [T, Hq, D]
        else:
            attn = ops.prefill_attention(q, kv_layer, meta, self.scale)  # attn: [T, Hq, D]
        o = linear(attn.reshape(n_tokens, hq * d), self.o_w, self.o_bias)  # o: [T, E] this rank's partial
        post = self.post_norm
        normed, residual = self.comm.all_reduce_add_rms_norm(o, residual, post.weight, post.eps, ops)
        return self.mlp(normed, ops), residual  # [T, E] this rank's partial sum, [T, E]


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        tp: TPPlan | None = None,
        comm: Collectives | None = None,
        quantization: str | None = None,
    ) -> None:
        """`tp` and `comm` default to the whole model on one rank; `quantization`: None or "fp8"."""
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or plan(cfg, 0, 1)
        self.comm = comm = comm or SingleRank()
        assert (comm.rank, comm.size) == (tp.rank, tp.size), (comm.rank, comm.size, tp)
        # embed_weight, lm_head_weight: [V / N rounded up, E] this rank's vocabulary rows
        self.embed_weight = _param((tp.vocab_rows, cfg.hidden_size), device, dtype)
        assert quantization in (None, "fp8"), f"quantization={quantization!r}: accepted None, 'fp8'"
        self.quantization = quantization
        quantized = quantization == "fp8"
        self.decoder_layers = [
            DecoderLayer(cfg, tp, comm, device, dtype, cfg.is_sparse_layer(i), quantized)
            for i in range(cfg.num_layers)
        ]
        self.layers = nn.ModuleList(self.decoder_layers)  # registers them; `decoder_layers` keeps their type
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.lm_head_weight = (
            self.embed_weight
            if cfg.tie_word_embeddings
            else _param((tp.vocab_rows, cfg.hidden_size), device, dtype)
        )
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # [D/2]
        self.rope = RopeTables.from_inv_freq(inv_freq, cfg.max_position_embeddings, device)  # [P, D/2] fp32
        self.linear: Linear = DenseLinear()
        self.lm_head_w = self.lm_head_weight.detach()

    def prepare_weights(self, linear: Linear | None = None) -> None:
        """Make every matmul's handle from the current weights with `linear` (default: the device's best
        product; the FP8 product for the layers of an FP8 model); loaders call it once the weights are final
        (a later in-place change needs another call)."""
        self.linear = linear or select_linear(self.embed_weight.device, self.dtype)
        fp8 = self.quantization == "fp8" and linear is None
        layer_linear: Linear = Fp8Linear(self.embed_weight.device) if fp8 else self.linear
        for layer in self.decoder_layers:
            layer.prepare(layer_linear, self.linear)
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
        assert kv_cache.shape[4:] == (self.tp.num_kv_heads, cfg.head_dim), kv_cache.shape
        assert meta.rope is self.rope, "the step's metadata must carry this model's RoPE tables (model.rope)"
        h = self._embed(input_ids)  # h: [T, E] residual stream
        delta: torch.Tensor | None = None  # [T, E] the last layer's MLP output (this rank's part), not in h
        for i, layer in enumerate(self.decoder_layers):
            delta, h = layer(delta, h, kv_cache[i], meta, ops)
            if layer_hook is not None:
                layer_hook(i)
        return h if delta is None else h.add_(self.comm.all_reduce(delta))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, E]. Split vocabulary: each rank looks up the ids in its rows (zeros for the
        others) and the all-reduce adds the one non-zero row per token (exact: x + 0 = x)."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.embed_weight)
        local = input_ids - self.tp.vocab_start  # [T]
        mine = (local >= 0) & (local < self.tp.vocab_rows)  # [T] bool
        h = F.embedding(local.clamp(0, self.tp.vocab_rows - 1), self.embed_weight) * mine.unsqueeze(1)
        return self.comm.all_reduce(h)  # [T, E]

    def compute_logits(self, hidden: torch.Tensor, ops: AttentionOps | None = None) -> torch.Tensor:
        """hidden: [S, E] rows of `forward`'s output -> logits [S, V] float32 (on ranks other than 0: this
        rank's vocabulary columns, which they discard). With `ops`, the final norm is the fused kernel (one
        launch instead of four inside a decode step)."""
        normed = self.norm(hidden) if ops is None else ops.rms_norm(hidden, self.norm.weight, self.norm.eps)
        local = self.linear.linear(normed, self.lm_head_w, None)  # [S, V / N]
        return self.comm.gather_logits(local)[:, : self.config.vocab_size].float()  # [S, V]

    def greedy_tokens(self, hidden: torch.Tensor, ops: AttentionOps | None = None) -> torch.Tensor:
        """hidden: [S, E] as for `compute_logits` -> [S] int64 the argmax of each row's logits, on every
        rank: each rank reduces its own vocabulary columns (its padding past V at -inf) and the group
        exchanges only (value, id) per row, the first maximum winning as in torch's argmax."""
        normed = self.norm(hidden) if ops is None else ops.rms_norm(hidden, self.norm.weight, self.norm.eps)
        local = self.linear.linear(normed, self.lm_head_w, None).float()  # [S, V / N]
        real = self.tp.vocab()
        if real.stop - real.start < local.shape[1]:
            local[:, max(0, real.stop - real.start) :] = float("-inf")
        index = local.argmax(dim=-1)  # [S] first maximum of this rank's columns
        best = local.gather(1, index[:, None])[:, 0]  # [S]
        return self.comm.argmax_tokens(best, index + self.tp.vocab_start)  # [S]

    @torch.no_grad()
    def load_weights(self, weights: WeightSource) -> None:
        """Copy HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...) into the fused parameters,
        reading only this rank's part of each (`self.tp`).

        Each source tensor is read once, converted to the model's dtype and device on the way. Raises
        ValueError naming a missing, unexpected or misshapen tensor.
        """
        cfg, tp = self.config, self.tp
        if self.quantization == "fp8":
            weights = Fp8Weights(weights)
        names = weights.names()
        used: set[str] = set()

        def take(name: str, dst: torch.Tensor, part: RowSlice | None = None) -> None:
            if name not in names:
                raise ValueError(f"weight {name!r} is missing ({cfg.architecture} checkpoint)")
            src = weights.read(name, part)
            if tuple(src.shape) != tuple(dst.shape):
                what = "" if part is None else f" (rows {part.start}:{part.stop} of dim {part.dim})"
                raise ValueError(
                    f"weight {name!r}{what} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(src)
            used.add(name)

        vocab = tp.vocab()
        n_vocab = vocab.stop - vocab.start
        self.embed_weight[n_vocab:].zero_()  # padding rows of the last rank
        take("model.embed_tokens.weight", self.embed_weight[:n_vocab], vocab if tp.size > 1 else None)
        take("model.norm.weight", self.norm.weight)
        if not cfg.tie_word_embeddings:
            self.lm_head_weight[n_vocab:].zero_()
            take("lm_head.weight", self.lm_head_weight[:n_vocab], vocab if tp.size > 1 else None)
        q_rows, kv_rows = tp.num_heads * cfg.head_dim, tp.num_kv_heads * cfg.head_dim
        whole = tp.size == 1
        qkv_split = (
            ("q_proj", 0, q_rows, None if whole else tp.q_rows()),
            ("k_proj", q_rows, kv_rows, None if whole else tp.kv_rows()),
            ("v_proj", q_rows + kv_rows, kv_rows, None if whole else tp.kv_rows()),
        )
        f = tp.intermediate_size
        for i, layer in enumerate(self.decoder_layers):
            p = f"model.layers.{i}."
            take(p + "input_layernorm.weight", layer.input_norm.weight)
            take(p + "post_attention_layernorm.weight", layer.post_norm.weight)
            for proj, start, rows, part in qkv_split:
                take(f"{p}self_attn.{proj}.weight", layer.qkv_weight[start : start + rows], part)
                if layer.qkv_scale is not None:
                    take(f"{p}self_attn.{proj}.weight{SCALE}", layer.qkv_scale[start : start + rows], part)
                if layer.qkv_bias is not None:
                    bias_part = None if part is None else RowSlice(0, part.start, part.stop)
                    take(f"{p}self_attn.{proj}.bias", layer.qkv_bias[start : start + rows], bias_part)
            take(p + "self_attn.o_proj.weight", layer.o_weight, None if whole else tp.q_rows().along(1))
            if layer.o_scale is not None:
                take(p + "self_attn.o_proj.weight" + SCALE, layer.o_scale)  # per output row: whole
            if layer.o_bias is not None:
                take(p + "self_attn.o_proj.bias", layer.o_bias)
            elif p + "self_attn.o_proj.bias" in names and tp.rank > 0:
                used.add(p + "self_attn.o_proj.bias")  # rank 0 adds it
            if layer.q_norm is not None and layer.k_norm is not None:
                take(p + "self_attn.q_norm.weight", layer.q_norm.weight)
                take(p + "self_attn.k_norm.weight", layer.k_norm.weight)
            if layer.moe is not None:
                layer.moe.load(cfg, i, tp, take)
                continue
            ffn = None if whole else tp.ffn_rows()
            take(p + "mlp.gate_proj.weight", layer.gate_up_weight[:f], ffn)
            take(p + "mlp.up_proj.weight", layer.gate_up_weight[f:], ffn)
            take(p + "mlp.down_proj.weight", layer.down_weight, None if ffn is None else ffn.along(1))
            if layer.gate_up_scale is not None and layer.down_scale is not None:
                take(p + "mlp.gate_proj.weight" + SCALE, layer.gate_up_scale[:f], ffn)
                take(p + "mlp.up_proj.weight" + SCALE, layer.gate_up_scale[f:], ffn)
                take(p + "mlp.down_proj.weight" + SCALE, layer.down_scale)  # per output row: whole
        # a tied checkpoint may still carry lm_head; rotary buffers are recomputed here
        ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
        unexpected = sorted(
            n for n in names if n not in used and n not in ignorable and "rotary_emb" not in n
        )
        if unexpected:
            raise ValueError(f"unexpected weights {unexpected[:5]} ({len(unexpected)} in all)")
        self.prepare_weights()
