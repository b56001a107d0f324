"""Engine configuration: one frozen dataclass per engine, validated at construction.

Values learned at start-up (the number of KV blocks, EOS ids) live in the runtime state of the engine,
never here. Nothing in this module reads the environment; the CLI builds the config from argv.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn"}
"""--kv-cache-dtype: auto stores the KV in the model dtype; fp8 in float8_e4m3fn at a fixed scale of 1.0."""
QUANTIZATIONS = ("fp8",)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    """A .gguf file, an HF checkpoint directory, or `dummy:<named shape | config.json>`."""
    tokenizer: str | None = None
    chat_template: str | None = None
    """A Jinja chat template replacing the tokenizer's (its text: shared/cli loads `--chat-template`)."""
    device: str = "cpu"
    dtype: str = "auto"
    """float32 | bfloat16 | float16, or auto: float32 on the CPU, bfloat16 on a GPU."""
    block_size: int = 16
    num_kv_blocks: int | None = None
    """Fixed pool size; None sizes it from `kv_cache_bytes` (CPU) or free GPU memory."""
    kv_cache_bytes: int = 1 << 30
    host_kv_cache_bytes: int = 0
    """The host-memory tier under the device pool (evicted blocks wait there for a hit); 0: off."""
    gpu_memory_utilization: float = 0.90
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    """Chunked-prefill token budget per step."""
    max_model_len: int | None = None
    seed: int = 0
    """Seed of dummy weights."""
    cuda_graphs: bool = True
    tensor_parallel_size: int = 1
    """Ranks (one process each) that split the model's heads, MLP and vocabulary; rank r of a CUDA engine
    runs on GPU `index + r` (shared/engine/parallel/)."""
    kv_cache_dtype: str = "auto"
    """auto: the model dtype; fp8: float8_e4m3fn (half the bytes of bf16 per token, in the pool, the host
    tier and every transfer; kernels/ quantizes on write at a fixed scale of 1.0)."""
    quantization: str | None = None
    """fp8: the linear layers' weights in float8_e4m3fn with per-output-channel scales (a bf16 checkpoint is
    quantized at load; an FP8 checkpoint's `quantization_config` turns it on by itself). None: as stored."""
    async_scheduling: bool | None = None
    """Launch step n+1 before step n's tokens reach the host (vLLM's async scheduling): the host schedules,
    prepares and launches the next step, then reads, detokenizes and emits this one while the device
    computes. None: on for one GPU, off on the CPU (whose steps are synchronous: nothing to overlap) and at
    tensor_parallel_size > 1."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: a path or dummy:<shape> is required")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: accepted auto, {', '.join(sorted(_DTYPES))}")
        if not re.fullmatch(r"cpu|cuda(:\d+(,\d+)*)?", self.device):
            raise ValueError(f"device={self.device!r}: accepted 'cpu', 'cuda', 'cuda:N' or 'cuda:A,B,...'")
        listed = self.device.count(",") + 1
        if listed > 1 and listed != self.tensor_parallel_size:
            raise ValueError(
                f"device={self.device!r} names {listed} GPUs for tensor_parallel_size="
                f"{self.tensor_parallel_size}: name one per rank, or 'cuda:N' for N, N+1, ..."
            )
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size={self.block_size}: accepted 8, 16, 32, 64, 128")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks}: need at least 2")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes}: must be positive")
        if self.host_kv_cache_bytes < 0:
            raise ValueError(f"host_kv_cache_bytes={self.host_kv_cache_bytes}: must be >= 0 (0: no tier)")
        if not 0.05 <= self.gpu_memory_utilization <= 0.98:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization}: accepted 0.05..0.98")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs}: must be >= 1")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens}: must be >= block_size")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len}: must be >= 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: accepted {', '.join(KV_CACHE_DTYPES)}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r}: accepted {', '.join(QUANTIZATIONS)}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: must be >= 1")

    @property
    def dtype_name(self) -> str:
        """The resolved dtype name of the weights and activations (and of the KV cache under auto)."""
        if self.dtype == "auto":
            return "float32" if self.device == "cpu" else "bfloat16"
        return self.dtype

    @property
    def kv_dtype_name(self) -> str:
        """The KV cache's dtype (torch's name): what the fingerprint and the KV layout record."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype_name

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.kv_dtype_name)
        return dtype

    @property
    def overlap(self) -> bool:
        """async_scheduling, resolved: auto is on on GPUs (at every tensor-parallel size: the other ranks
        get each step's sampled tokens on the device) and off on the CPU."""
        if self.async_scheduling is None:
            return self.device != "cpu"
        return self.async_scheduling

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype_name]

    @property
    def torch_device(self) -> torch.device:
        """Rank 0's device; a bare "cuda" means GPU 0 (the engine binds its threads to one GPU by index)."""
        return self.rank_device(0)

    def rank_device(self, rank: int) -> torch.device:
        """Tensor-parallel rank `rank`'s device: the CPU; the rank-th GPU of 'cuda:A,B,...'; or the GPU `rank`
        places after 'cuda:N' (after GPU 0 for a bare 'cuda': the first N visible)."""
        if self.device == "cpu":
            return torch.device("cpu")
        _, _, indices = self.device.partition(":")
        gpus = [int(i) for i in indices.split(",")] if indices else [0]
        return torch.device("cuda", gpus[rank] if len(gpus) > 1 else gpus[0] + rank)
