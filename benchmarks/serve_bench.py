"""`pdserve bench` against a cluster this program starts: Redis, the nodes given, one router.

A program, not a test:

    python benchmarks/serve_bench.py --model dummy:llama-3.1-8b --node single --node-args "--device cuda:0" \
        -- --device cuda:0 --max-concurrency 1,16,64 --ignore-eos --compare-engine ...

Each `-- ARGS...` group is one `pdserve bench` run against the same cluster (its --base-url is this
cluster's router, its --model the cluster's). `--node ROLE[:FLAGS]` adds one node (prefill, decode or
single; repeat it: `--node prefill:"--device cuda:0" --node decode:"--device cuda:1"` is P/D across two
GPUs, two `--node single:...` two replicas behind the same router). After each run, the router's
cost-model table and every node's mean queue, prefill, TTFT and TPOT over that run are printed. After the
runs, every node's block audit is read and printed (clean: nothing in use or reserved, no live request; exit
status 3 when one is not). `--profile DIR` records every node and the router with py-spy (non-blocking,
all threads, idle included, raw collapsed stacks) during each run; `--wrap SCRIPT` starts nodes, the router
and the bench as `python SCRIPT -m MODULE ...` (a harness that patches something before running the module);
`--planner-args "--watch 5 --apply ..."` runs `pdserve plan` beside the cluster for all the runs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx2
from pdserve.cli.up import MODULES, Cluster, free_port, start_redis
from pdserve.shared.cli.default_model import default_model_path
from pdserve.shared.node.node_sign import signed
from prometheus_client.parser import text_string_to_metric_families


def node_specs(values: Sequence[str]) -> list[tuple[str, list[str]]]:
    specs = []
    for value in values:
        role, _, flags = value.partition(":")
        if role not in ("prefill", "decode", "single"):
            raise SystemExit(f"--node {value!r}: the role must be prefill, decode or single")
        specs.append((role, shlex.split(flags)))
    if not any(role in ("decode", "single") for role, _ in specs):
        raise SystemExit("--node: at least one decode or single node is needed")
    return specs


def start(cluster: Cluster, args: argparse.Namespace) -> tuple[str, list[tuple[str, str]]]:
    redis_url = start_redis(cluster)
    py = [sys.executable, *([args.wrap] if args.wrap else [])]
    nodes = []
    for i, (role, flags) in enumerate(node_specs(args.node)):
        port = free_port()
        name = f"{role}-{i}"
        argv = [*py, "-m", MODULES[role], "--node-id", name, "--port", str(port), "--redis", redis_url]
        argv += ["--model", args.model]
        argv += [*shlex.split(args.node_args), *flags, *(["--role", "single"] if role == "single" else [])]
        cluster.spawn(name, argv, env=cluster.secret_env)
        nodes.append((name, f"http://127.0.0.1:{port}"))
    for _, url in nodes:
        cluster.wait_http(f"{url}/internal/health", timeout_s=600)
    port = free_port()
    router = [*py, "-m", "pdserve.router", "--model", args.model, "--redis", redis_url]
    router += ["--port", str(port)]
    cluster.spawn("router", [*router, *shlex.split(args.router_args)], env=cluster.secret_env)
    base = f"http://127.0.0.1:{port}"
    cluster.wait_http(f"{base}/health", timeout_s=120)
    if args.planner_args is not None:
        planner = [sys.executable, "-m", "pdserve.cli", "plan", "--router-url", base, "--redis", redis_url]
        cluster.spawn("planner", [*planner, *shlex.split(args.planner_args)], env=cluster.secret_env)
    return base, nodes


def profilers(cluster: Cluster, out: str, run: int) -> list[subprocess.Popen[bytes]]:
    exe = shutil.which("py-spy")
    if exe is None:
        raise SystemExit("--profile needs py-spy on PATH")
    os.makedirs(out, exist_ok=True)
    procs = []
    for name, proc in cluster.procs:
        argv = [exe, "record", "--nonblocking", "--threads", "--idle", "--rate", "250", "--format", "raw"]
        argv += ["-o", os.path.join(out, f"{name}-{run}.txt"), "--pid", str(proc.pid)]
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def cost_model_table(metrics: str) -> str:
    """The router's cost-model series so far (pdserve_router_cost_model_*), one row per option: decisions,
    mean estimated and measured time to first token, the median of estimate / measured (interpolated in its
    histogram's buckets) and the share of choices whose estimate was within 25 % of the measured time."""
    rows: dict[str, dict[str, float]] = {}
    ratio: dict[str, list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(metrics):
        if not family.name.startswith("pdserve_router_cost_model_"):
            continue
        for sample in family.samples:
            option = sample.labels.get("option", "")
            row = rows.setdefault(option, {})
            name = sample.name.removeprefix("pdserve_router_cost_model_")
            if name.endswith("_bucket") and name.startswith("estimate_ratio"):
                ratio.setdefault(option, []).append((float(sample.labels["le"]), sample.value))
            else:
                row[name] = sample.value
    out = ["| option | decisions | estimated TTFT mean (ms) | measured TTFT mean (ms) | estimate / measured, "
           "median | within 25 % |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for option, row in sorted(rows.items()):
        n = row.get("actual_ttft_seconds_count", 0.0)
        est = row.get("estimated_ttft_seconds_sum", 0.0) / max(
            row.get("estimated_ttft_seconds_count", 0.0), 1
        )
        act = row.get("actual_ttft_seconds_sum", 0.0) / max(n, 1)
        cum = sorted(ratio.get(option, []))
        median, within = float("nan"), float("nan")
        if cum and cum[-1][1] > 0:
            total = cum[-1][1]
            lo, below = 0.0, 0.0
            for le, c in cum:
                if c >= total / 2:
                    hi = le if le != float("inf") else lo * 2
                    median = lo + (hi - lo) * (total / 2 - below) / max(c - below, 1e-9)
                    break
                lo, below = le, c
            at = dict(cum)
            within = (at.get(1.25, 0.0) - at.get(0.75, 0.0)) / total
        out.append(f"| {option} | {row.get('decisions_total', 0):.0f} | {est * 1e3:.1f} | {act * 1e3:.1f} | "
                   f"{median:.2f} | {within:.0%} |")  # fmt: skip
    return "cost model (the router's pdserve_router_cost_model_* series, cumulative):\n" + "\n".join(out)


_NODE_SERIES = {
    "time_to_first_token_seconds": "TTFT",
    "request_queue_time_seconds": "queue",
    "request_prefill_time_seconds": "prefill",
    "request_time_per_output_token_seconds": "TPOT",
}


def node_latency_sums(nodes: Sequence[tuple[str, str]]) -> dict[str, dict[str, tuple[float, float]]]:
    """Each node's vLLM latency histograms so far: {node: {series: (sum, count)}}."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for name, url in nodes:
        sums: dict[str, list[float]] = {}
        for family in text_string_to_metric_families(httpx2.get(f"{url}/metrics", timeout=30).text):
            short = family.name.removeprefix("vllm:")
            if short not in _NODE_SERIES:
                continue
            for sample in family.samples:
                at = {"_sum": 0, "_count": 1}.get(sample.name.removeprefix(family.name))
                if at is not None:
                    sums.setdefault(short, [0.0, 0.0])[at] += sample.value
        out[name] = {k: (v[0], v[1]) for k, v in sums.items()}
    return out


def node_latency_table(
    before: dict[str, dict[str, tuple[float, float]]], after: dict[str, dict[str, tuple[float, float]]]
) -> str:
    """Mean node-side latencies of one bench run (the difference of two reads): where a request's time to
    first token goes inside the node (queue: from the node's receipt to its first scheduled step; prefill:
    from there to the first token) against what the client measured."""
    head = " | ".join(f"{label} mean (ms)" for label in _NODE_SERIES.values())
    rows = [f"| node | requests | {head} |", "|---|---:|" + "---:|" * len(_NODE_SERIES)]
    for name, series in after.items():
        cells, n = [], 0.0
        for short in _NODE_SERIES:
            s1, c1 = series.get(short, (0.0, 0.0))
            s0, c0 = before.get(name, {}).get(short, (0.0, 0.0))
            n = max(n, c1 - c0)
            cells.append(f"{1000 * (s1 - s0) / (c1 - c0):.1f}" if c1 > c0 else "-")
        rows.append(f"| {name} | {n:.0f} | {' | '.join(cells)} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own = argv[: argv.index("--")] if "--" in argv else argv
    benches: list[list[str]] = []
    for arg in argv[len(own) :]:
        if arg == "--":
            benches.append([])
        else:
            benches[-1].append(arg)
    p = argparse.ArgumentParser(prog="python benchmarks/serve_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=None, help="every node's, the router's and the bench's (default SmolLM2)"
    )
    p.add_argument("--node", action="append", required=True, help="ROLE[:FLAGS], repeatable")
    p.add_argument("--node-args", default="", help="flags for every node (model, dtype, KV pool, ...)")
    p.add_argument("--router-args", default="", help="more router flags")
    p.add_argument("--wrap", default=None, help="start nodes and the bench as `python WRAP -m MODULE ...`")
    p.add_argument("--profile", default=None, metavar="DIR", help="py-spy every process during the bench")
    p.add_argument(
        "--planner-args",
        default=None,
        help="also run `pdserve plan` on the cluster with these flags (--watch)",
    )
    p.add_argument("--logs", default=None, metavar="DIR", help="copy the processes' logs here at the end")
    args = p.parse_args(own)
    args.model = args.model or default_model_path()
    benches = [b if "--model" in b else [*b, "--model", args.model] for b in benches or [[]]]
    cluster = Cluster()
    rc = 0
    try:
        t0 = time.perf_counter()
        base, nodes = start(cluster, args)
        print(f"cluster up in {time.perf_counter() - t0:.0f} s: {', '.join(n for n, _ in nodes)}", flush=True)
        bench = [sys.executable, *([args.wrap] if args.wrap else []), "-m", "pdserve.cli", "bench"]
        for i, bench_args in enumerate(benches):
            print(f"bench {i}: pdserve bench {shlex.join(bench_args)}", flush=True)
            spies = profilers(cluster, args.profile, i) if args.profile else []
            sums = node_latency_sums(nodes)
            rc = subprocess.run([*bench, "--base-url", base, *bench_args], check=False).returncode or rc
            for spy in spies:
                spy.send_signal(signal.SIGINT)
            for spy in spies:
                spy.wait(timeout=60)
            print(cost_model_table(httpx2.get(f"{base}/metrics", timeout=30).text), flush=True)
            print(node_latency_table(sums, node_latency_sums(nodes)), flush=True)
        for name, url in nodes:
            a = httpx2.get(f"{url}/internal/audit", auth=signed(cluster.auth_token), timeout=30).json()
            clean = a["in_use"] == a["reserved"] == a.get("pinned", 0) == a["live_requests"] == 0
            print(f"audit {name}: in_use {a['in_use']} reserved {a['reserved']} "
                  f"live {a['live_requests']} free+cached {a['free'] + a['cached']}/{a['num_blocks']} "
                  f"{'clean' if clean else 'NOT CLEAN'}", flush=True)  # fmt: skip
            rc = rc or (0 if clean else 3)
    finally:
        if args.logs:
            os.makedirs(args.logs, exist_ok=True)
            for name, _ in cluster.procs:
                shutil.copy(os.path.join(cluster.workdir, f"{name}.log"), args.logs)
        cluster.stop()
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
