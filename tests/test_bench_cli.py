"""`pdserve bench` through its command line against a real single-node cluster (redis-server, a node, the
router): a short sweep of two loads writes a result file that matches the schema, with every request served
at its exact output length, and a PNG; chat works too; `--backend engine` runs the same workload in-process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pdserve.bench_report import RESULT_SCHEMA
from pdserve.tests.cluster_fixture import LiveCluster, model_path, run_cli, up_config

pytestmark = pytest.mark.slow

SHORT = ("--num-prompts", "8", "--input-len", "24", "--output-len", "16", "--ignore-eos", "--disable-tqdm")


@pytest.fixture(scope="module")
def live() -> Iterator[LiveCluster]:
    cluster = LiveCluster.start(up_config(prefill=0, decode=1))
    try:
        yield cluster
    finally:
        cluster.stop()


def bench(tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    result_file = tmp_path / f"{name}.json"
    done = run_cli(
        "pdserve.cli",
        "bench",
        "--model",
        model_path(),
        "--result-file",
        str(result_file),
        *args,
        timeout_s=120,
    )
    assert done.returncode == 0, f"pdserve bench exited {done.returncode}: {done.stderr[-2000:]}"
    assert "Serving Benchmark Result" in done.stdout
    result: dict[str, Any] = json.loads(result_file.read_text())
    jsonschema.validate(result, RESULT_SCHEMA)
    return result


def assert_all_served(run: dict[str, Any], prompts: int, output_len: int) -> None:
    assert (run["completed"], run["failed"], run["errors"]) == (prompts, 0, [])
    assert run["output_lens"] == [output_len] * prompts
    assert run["total_output_tokens"] == prompts * output_len
    assert 0 < run["ttft_ms"]["median"] <= run["e2el_ms"]["median"]
    assert run["tpot_ms"]["p99"] >= run["tpot_ms"]["median"] > 0 and run["itl_ms"]["mean"] > 0


def test_a_sweep_against_the_router_writes_results_and_a_plot(live: LiveCluster, tmp_path: Path) -> None:
    png = tmp_path / "sweep.png"
    result = bench(
        tmp_path, "sweep", "--base-url", live.base, *SHORT, "--max-concurrency", "1,4", "--plot", str(png),
        "--goodput", "ttft:60000", "tpot:60000",
    )  # fmt: skip
    assert [r["load"]["max_concurrency"] for r in result["runs"]] == [1, 4]
    for run in result["runs"]:
        assert run["backend"] == "openai"
        assert_all_served(run, 8, 16)
        assert run["request_goodput"] == run["request_throughput"]  # SLOs no request can miss
    assert result["engine_runs"] == [] and result["served_over_engine"] == []
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_at_a_poisson_rate(live: LiveCluster, tmp_path: Path) -> None:
    result = bench(
        tmp_path, "chat", "--base-url", live.base, "--backend", "openai-chat", *SHORT,
        "--request-rate", "20", "--burstiness", "0.5", "--goodput", "ttft:1",
    )  # fmt: skip
    (run,) = result["runs"]
    assert run["load"] == {"request_rate": 20.0, "burstiness": 0.5, "max_concurrency": None}
    assert_all_served(run, 8, 16)
    assert 0 <= run["request_goodput"] <= run["request_throughput"]


def test_the_engine_backend_runs_the_same_workload_in_process(tmp_path: Path) -> None:
    result = bench(
        tmp_path, "engine", "--backend", "engine", "--threads", "1", *SHORT, "--max-concurrency", "4"
    )
    (run,) = result["runs"]
    assert run["backend"] == "engine"
    assert_all_served(run, 8, 16)
    assert run["input_lens"] == [24] * 8 and run["request_goodput"] is None
