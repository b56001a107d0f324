"""How long a local cluster takes to start: `start_cluster` (what `pdserve up` and every cluster test run),
from nothing running to the router counting every node ready, then its stop.

A program, not a test: `python benchmarks/cluster_start.py [--shapes 1x1 2x2] [--runs 3]` starts each shape
(P prefill nodes x D decode nodes, SmolLM2 on the CPU, one torch thread per node, real redis-server) `--runs`
times, the shapes alternating, and prints a markdown table of the median and the range of the start and of
the stop. The machine's load falls on the result: run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

from pdserve.cli.up import Cluster, UpConfig, free_port, start_cluster
from pdserve.shared.cli.default_model import default_model_path


def once(prefill: int, decode: int) -> tuple[float, float]:
    """(seconds to start, seconds to stop) of one cluster of the shape."""
    cfg = UpConfig(model=default_model_path(), port=free_port(), prefill=prefill, decode=decode)
    cluster = Cluster()
    t0 = time.perf_counter()
    try:
        start_cluster(cfg, cluster)
        started = time.perf_counter() - t0
    finally:
        t1 = time.perf_counter()
        cluster.stop()
    return started, time.perf_counter() - t1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["1x1", "2x2"], help="PxD: prefill x decode nodes")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes]
    times: dict[tuple[int, ...], list[tuple[float, float]]] = {s: [] for s in shapes}
    for _ in range(args.runs):
        for s in shapes:
            times[s].append(once(s[0], s[1]))
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0]
    print(f"# cluster start-up, {now}, {os.cpu_count()} CPUs, load average {load:.2f} at the end")
    print("| cluster | start, median (range) | stop, median |\n|---|---:|---:|")
    for s, runs in times.items():
        up = [u for u, _ in runs]
        down = statistics.median(d for _, d in runs)
        span = f"{min(up):.1f}-{max(up):.1f}"
        print(f"| {s[0]}P + {s[1]}D | {statistics.median(up):.1f} s ({span}) | {down:.1f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
