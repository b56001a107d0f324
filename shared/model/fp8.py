"""FP8 weights: the linear layers' weights in float8_e4m3fn with one fp32 scale per output channel (row),
read from an FP8 checkpoint or quantized at load, and the product that runs on them.

Invariants: a quantized weight is `(q [N, K] float8_e4m3fn, scale [N] fp32)` with W ~= q * scale[:, None];
rowwise scales compose with everything the model does to rows (q | k | v and gate | up are fused by
stacking rows, a tensor-parallel rank keeps rows or columns), so one form serves every source:
- a bf16/fp32 tensor (a checkpoint, or dummy weights) is quantized per row, scale = row max / 448;
- an FP8 checkpoint with a per-tensor or per-channel `weight_scale` is used as stored (the scale broadcast
  to rows: exact);
- an FP8 checkpoint with 128 x 128 block scales (`weight_scale_inv`, as DeepSeek-V3 and Qwen3-FP8 ship) is
  dequantized and requantized per row at load (one more rounding, no block-scaled GEMM kernel needed).
Static activation scales (`input_scale`) are dropped: activations are quantized per token at run time.
Products: on a GPU of compute capability >= 8.9, up to 16 rows (decode; up to 64 where its tuned table
says it measured faster, kernels/triton_gemv.py's `runs_gemv`) go through the Triton GEMV on
the FP8 weights (x stays bf16; each weight byte is read once, widened in registers, the row scale applied
to the fp32 sum), larger ones through `torch._scaled_mm` with rowwise scales after a per-token dynamic
quantization of x. Anywhere else FP8 is refused (`unsupported_reason`) before any weight is read.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

import torch
from pdserve.shared.model.parallel import RowSlice, WeightSource, narrow

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
BLOCK = 128
"""Side of a block-scaled checkpoint's scale blocks (`weight_block_size` [128, 128])."""
QUANTIZED_SUFFIXES = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)  # fmt: skip
"""The weights held in FP8; embeddings, norms and the LM head stay in the model dtype, as FP8 checkpoints
keep them."""
SCALE = "_scale"
"""`<weight name>_scale`: the name under which a quantized weight's rowwise scale [N] is read."""
_CHECKPOINT_SCALES = ("_scale", "_scale_inv")
_MIN_CAPABILITY = (8, 9)


def unsupported_reason(device: torch.device) -> str | None:
    """None when `device` multiplies FP8 (CUDA, compute capability >= 8.9); else why not, one line."""
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap >= _MIN_CAPABILITY:
            return None
        name = torch.cuda.get_device_name(device)
        return f"FP8 needs compute capability 8.9 or newer (Ada, Hopper, Blackwell); {name} has {cap}"
    return f"FP8 weights need a GPU of compute capability 8.9 or newer; the {device.type} has no FP8 product"


def checkpoint_quantization(path: str) -> str | None:
    """ "fp8" when the HF directory's config.json declares `quantization_config.quant_method: fp8`; None
    for an unquantized one, and for `gguf` (transformers writes it when it saves a model it loaded from a
    GGUF file: the saved tensors are the dequantized ones). ValueError for another method (none of those is
    implemented)."""
    config = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.exists(config):
        return None
    with open(config, encoding="utf-8") as f:
        quant: dict[str, Any] | None = json.load(f).get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method == "gguf":
        return None
    if method != "fp8":
        raise ValueError(f"config.json quantization_config.quant_method={method!r}; accepted: 'fp8'")
    block = quant.get("weight_block_size")
    if block is not None and list(block) != [BLOCK, BLOCK]:
        raise ValueError(f"config.json weight_block_size={block}; accepted: [{BLOCK}, {BLOCK}]")
    return "fp8"


def quantized_identity(identity: bytes, method: str) -> bytes:
    """The weights identity of a checkpoint quantized at load by `method`: other weights than the
    checkpoint's own, so another fingerprint (shared/engine/block_hash.py)."""
    return hashlib.sha256(b"pdserve-quantized-v1\0" + method.encode() + b"\0" + identity).digest()


def quantize_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (q [N, K] FP8, scale [N] fp32), scale = the row's max |w| / 448 (a zero row: 1)."""
    wf = w.float()
    amax = wf.abs().amax(dim=1)  # [N]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An FP8 checkpoint tensor in fp32. q: [N, K] FP8; scale: a scalar or [1] (per tensor), [N] or [N, 1]
    (per channel), or [ceil(N/128), ceil(K/128)] (per 128 x 128 block: DeepSeek's `weight_scale_inv`,
    which multiplies despite its name)."""
    n, k = q.shape
    qf, s = q.float(), scale.float()
    rowwise = _rowwise(s, n)
    if rowwise is not None:
        return qf * rowwise[:, None]
    blocks = (-(-n // BLOCK), -(-k // BLOCK))
    if tuple(s.shape) != blocks:
        raise ValueError(f"an FP8 weight [{n}, {k}] with scales {tuple(s.shape)}: expected one per tensor, "
                         f"per row or per {BLOCK}x{BLOCK} block {blocks}")  # fmt: skip
    full = s.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]  # [N, K]
    return qf * full


def _rowwise(scale: torch.Tensor, n: int) -> torch.Tensor | None:
    """A per-tensor (scalar, [1]) or per-channel ([N], [N, 1]) scale as [N] fp32; None for block scales."""
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(n).contiguous()
    if scale.numel() == n and tuple(scale.shape) in ((n,), (n, 1)):
        return scale.float().reshape(n)
    return None


class Fp8Weights:
    """A `WeightSource` for an FP8 model over any checkpoint's source: each quantized weight (see
    QUANTIZED_SUFFIXES) reads as FP8, and its rowwise scale as `<name>_scale`; every other tensor as
    stored. A weight is read whole (a tensor-parallel rank then keeps its part: a row's scale needs the
    whole row), one at a time: the last one's scale waits until it is read."""

    def __init__(self, inner: WeightSource) -> None:
        self._inner = inner
        names = inner.names()
        self._checkpoint_scales = {
            n: n + suffix for n in names for suffix in _CHECKPOINT_SCALES if n + suffix in names
        }
        hidden = set(self._checkpoint_scales.values()) | {n for n in names if n.endswith(".input_scale")}
        quantized = {n for n in names if n.endswith(QUANTIZED_SUFFIXES)}
        self._names = frozenset((names - hidden) | {n + SCALE for n in quantized})
        self._last: tuple[str, torch.Tensor, torch.Tensor] | None = None

    def names(self) -> frozenset[str]:
        return self._names

    def read(self, name: str, part: RowSlice | None) -> torch.Tensor:
        if name.endswith(QUANTIZED_SUFFIXES):
            return narrow(self._quantized(name)[0], part)
        if name.endswith(SCALE) and name[: -len(SCALE)].endswith(QUANTIZED_SUFFIXES):
            scale = self._quantized(name[: -len(SCALE)])[1]
            return scale if part is None or part.dim == 1 else narrow(scale, part)  # columns: every row's
        return self._inner.read(name, part)

    def _quantized(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last is None or self._last[0] != name:
            w = self._inner.read(name, None)
            scale_name = self._checkpoint_scales.get(name)
            if w.dtype != FP8:
                q, scale = quantize_rowwise(w)
            elif scale_name is None:
                raise ValueError(f"FP8 weight {name!r} has no {name}_scale or {name}_scale_inv")
            else:
                s = self._inner.read(scale_name, None).float()
                rowwise = _rowwise(s, w.shape[0])
                if rowwise is not None:
                    q, scale = w, rowwise  # as stored: exact
                else:
                    q, scale = quantize_rowwise(dequantize(w, s))  # block scales: requantized per row
            self._last = (name, q, scale)
        return self._last[1], self._last[2]


class Fp8Linear:
    """y = x W^T (+ b) over `(q, scale)` handles (see the module). Served on CUDA with compute capability
    >= 8.9 only (the loader refuses elsewhere); on a CPU every product is `scaled_mm`, which torch runs
    there too, so CPU tests exercise the FP8 model."""

    name = "fp8"

    def __init__(self, device: torch.device) -> None:
        self._gemv: Any = None
        self._runs_gemv: Callable[[torch.device, torch.dtype, int, int, int], bool] = lambda *_: False
        if device.type == "cuda":  # triton comes with the [gpu] extra
            from pdserve.kernels import triton_gemv

            self._gemv, self._gemv_silu_mul = triton_gemv.gemv, triton_gemv.gemv_silu_mul
            self._runs_gemv = triton_gemv.runs_gemv

    def prepare(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> Any:
        assert weight.dtype == FP8 and scale is not None and scale.shape == (weight.shape[0],), (
            f"an FP8 product takes an FP8 [N, K] weight and its [N] scale, got {weight.dtype} "
            f"{tuple(weight.shape)} and {None if scale is None else tuple(scale.shape)}"
        )
        return weight, scale.float().contiguous()

    def linear(self, x: torch.Tensor, handle: Any, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [T, K] bf16 -> [T, N] in x's dtype."""
        w, scale = handle  # w: [N, K] FP8, scale: [N] fp32
        if self._runs_gemv(x.device, w.dtype, w.shape[0], w.shape[1], x.shape[0]):
            return self._gemv(x if x.stride(-1) == 1 else x.contiguous(), w, bias, scale=scale)
        return scaled_mm(x, w, scale, bias)

    def linear_silu_mul(
        self, x: torch.Tensor, handle: Any, silu_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """x: [T, K] bf16, a [2F, K] gate | up handle -> silu(gate) * up [T, F]: one GEMV launch at decode."""
        w, scale = handle
        if self._runs_gemv(x.device, w.dtype, w.shape[0], w.shape[1], x.shape[0]):
            return self._gemv_silu_mul(x if x.stride(-1) == 1 else x.contiguous(), w, scale=scale)
        return silu_mul(scaled_mm(x, w, scale, None))


def scaled_mm(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x: [T, K] -> [T, N] in x's dtype through torch._scaled_mm: x quantized per token (row max / 448),
    w: [N, K] FP8 with rowwise scale [N]; the product in fp32, out in bf16, then the bias."""
    xf = x.float()
    x_scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # [T, 1]
    xq = (xf / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    y = torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16)
    y = y.to(x.dtype)  # [T, N]
    return y if bias is None else y + bias
