"""The settings of `pdserve plan` (flags, PDSERVE_* variables or the --config file, like every command).
Imports nothing heavy, so `pdserve plan --help` is fast."""

from __future__ import annotations

from pdserve.shared.cli.settings import ClusterCredential
from pydantic import Field


class PlanOptions(ClusterCredential):
    """Where to measure, the SLOs, the priors of the rates, the damping and what to do with a decision."""

    router_url: str = Field("http://127.0.0.1:8000", description="the router whose /metrics gives the load")
    bench_result: str | None = Field(
        None, description="a `pdserve bench --result-file`: its last run is the load (the router is not read)"
    )
    redis: str = Field(
        "redis://127.0.0.1:6379",
        description="redis://, rediss:// or redis+sentinel:// URL of the index (the nodes and their roles)",
    )
    cluster: str = Field("default", description="the cluster name (key prefix) in Redis")
    api_key_file: str | None = Field(
        None, description="file holding a router API key for its /metrics (else PDSERVE_API_KEY, else none)"
    )
    ttft_slo_ms: float = Field(1000.0, gt=0, description="time-to-first-token SLO")
    tpot_slo_ms: float = Field(50.0, gt=0, description="time-per-output-token SLO")
    prefill_tokens_per_s: float = Field(
        5000.0, gt=0, description="prior of one prefill node's tokens per busy second, until measured"
    )
    decode_step_s: float = Field(
        0.02, gt=0, description="prior of a decode step's fixed seconds (batch 0), until measured"
    )
    decode_step_s_per_seq: float = Field(
        0.0005, gt=0, description="prior of a decode step's seconds per sequence in the batch, until measured"
    )
    margin: float = Field(
        0.25, ge=0, description="hysteresis: nodes past the rounding point the ideal split must be to act"
    )
    dwell: float = Field(300.0, ge=0, description="seconds a node keeps a role before it may change again")
    stabilize: float = Field(
        60.0, ge=0, description="seconds of recent rounds that must all ask for a move before one is made"
    )
    window: float = Field(
        10.0,
        gt=0,
        description="seconds the load is measured over (one decision: the time between its two scrapes)",
    )
    watch: float | None = Field(None, gt=0, description="decide every SECONDS until interrupted")
    apply: bool = Field(False, description="change the nodes' roles as decided (else only say)")
    role_timeout: float = Field(300.0, gt=0, description="seconds one node's role change may take")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="with --watch: serve pdserve_desired_nodes{role} here for an HPA"
    )
    json_output: bool = Field(
        False, description="print the decision as JSON", json_schema_extra={"flag": "--json"}
    )
