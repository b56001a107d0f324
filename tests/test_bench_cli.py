"""`pdserve bench` through its command line against a real single-node cluster (redis-server, a node, the
router): a short sweep of two loads writes a result file that matches the schema, with every request served
at its exact output length, and a PNG; chat works too (and --save-detailed keeps every request);
`--backend engine` runs the same workload in-process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pdserve.cli.bench import command_line, loads
from pdserve.cli.bench_datasets import Lengths, jsonl_requests, shared_prefix_requests
from pdserve.cli.bench_options import BenchOptions
from pdserve.cli.bench_report import RESULT_SCHEMA, parse_goodput
from pdserve.shared.cli.settings import load_settings
from pdserve.tests.harness.cluster_fixture import LiveCluster, model_path, run_cli, up_config

pytestmark = pytest.mark.slow

SHORT = ("--num-prompts", "6", "--input-len", "24", "--output-len", "12", "--ignore-eos", "--disable-tqdm")


@pytest.fixture(scope="module")
def live() -> Iterator[LiveCluster]:
    with LiveCluster.start(up_config(prefill=0, decode=1)) as cluster:
        yield cluster


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
        "--label", "single", "--goodput", "ttft:60000,tpot:60000", "--compare-engine", "--threads", "1",
    )  # fmt: skip
    assert result["label"] == "single" and [r["load"]["max_concurrency"] for r in result["runs"]] == [1, 4]
    for run in result["runs"]:
        assert run["backend"] == "openai"
        assert_all_served(run, 6, 12)
        assert run["request_goodput"] == run["request_throughput"]  # SLOs no request can miss
    assert [r["backend"] for r in result["engine_runs"]] == ["engine"] * 2
    for served, engine, ratio in zip(
        result["runs"], result["engine_runs"], result["served_over_engine"], strict=True
    ):
        assert_all_served(engine, 6, 12)
        assert ratio == pytest.approx(served["output_throughput"] / engine["output_throughput"])
        waves = engine["offline_waves"]  # the same prompts offline, in waves of the load's concurrency
        assert waves["output_tokens"] == 6 * 12 and waves["output_throughput"] > 0
    assert [r["offline_waves"]["waves"] for r in result["engine_runs"]] == [6, 2]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_at_a_poisson_rate(live: LiveCluster, tmp_path: Path) -> None:
    result = bench(
        tmp_path, "chat", "--base-url", live.base, "--backend", "openai-chat", *SHORT,
        "--request-rate", "20", "--burstiness", "0.5", "--goodput", "ttft:1", "--save-detailed",
    )  # fmt: skip
    (run,) = result["runs"]
    assert run["load"] == {"request_rate": 20.0, "burstiness": 0.5, "max_concurrency": None}
    assert_all_served(run, 6, 12)
    assert 0 <= run["request_goodput"] <= run["request_throughput"]
    assert len(run["requests"]) == 6  # --save-detailed: [ttft, tpot, e2el ms, tokens] of each request
    assert all(0 < ttft < e2el and tpot > 0 and n == 12 for ttft, tpot, e2el, n in run["requests"])


def test_the_engine_backend_runs_the_same_workload_in_process(tmp_path: Path) -> None:
    result = bench(
        tmp_path, "engine", "--backend", "engine", "--threads", "1", *SHORT, "--max-concurrency", "4"
    )
    (run,) = result["runs"]
    assert run["backend"] == "engine"
    assert_all_served(run, 6, 12)
    assert run["input_lens"] == [24] * 6 and run["request_goodput"] is None


def test_workloads_and_flags_without_a_server(tmp_path: Path) -> None:
    """Shared prefixes come turn by turn; JSONL takes text or ids; bad loads and SLOs name the flag."""
    reqs = shared_prefix_requests(3, 2, 5, Lengths(4, 8), None, seed=1)
    assert len(reqs) == 6 and all(r.prompt_len == 9 and r.output_len == 8 for r in reqs)
    prefixes = [" ".join(str(r.prompt).split()[:5]) for r in reqs]
    assert prefixes[:3] == prefixes[3:] and len(set(prefixes)) == 3
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one two three"}\n\n{"prompt_token_ids": [5, 6], "output_len": 3}\n')
    text, ids = jsonl_requests(str(path), 16, None, None)
    assert (text.prompt, text.prompt_len, text.output_len) == ("one two three", 3, 16)
    assert (ids.prompt, ids.prompt_len, ids.output_len) == ((5, 6), 2, 3)
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    with pytest.raises(ValueError, match="--goodput 'itl:5'"):
        parse_goodput(["itl:5"])
    flags = load_settings(BenchOptions, {"request_rate": "1,2", "max_concurrency": "4,8"}, None)
    with pytest.raises(ValueError, match="sweep one of"):
        loads(flags)
    flags = flags.model_copy(update={"max_concurrency": "4"})
    assert [(x["request_rate"], x["max_concurrency"]) for x in loads(flags)] == [(1.0, 4), (2.0, 4)]
    flags = flags.model_copy(update={"goodput": ("ttft:500",), "input_len": 24, "ignore_eos": True})
    assert command_line(flags) == ("pdserve bench --input-len 24 --request-rate 1,2 --max-concurrency 4 "
                                   "--ignore-eos --goodput ttft:500")  # fmt: skip
