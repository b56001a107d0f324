"""P/D (1 prefill + 1 decode node) against one `single` node, as a client sees them through the router.

A program, not a test: `python benchmarks/cluster_cpu.py [--requests 20] [--prompt-tokens 200] ...` starts
both clusters (each with its own redis-server and router; SmolLM2 on CPU, --threads torch threads per node;
`--node-args` and `--prefill-args`/`--decode-args`/`--single-args` add node flags, e.g. GPUs and a connector),
then sends the same prompts to both, one request at a time, alternating which cluster goes first, so that
load from other processes on the machine falls on both alike. Each request streams (greedy, ignore_eos, so
every request yields exactly --max-tokens tokens); the client records the time to the first and to the
second content chunk and to [DONE]. Prompts are distinct token-id lists (random ids, fixed seed), so no
request reuses a cached prefix. Prints a markdown table of medians (and p90) with the P/D / single ratio.
Target: P/D time to first and second token within 5 % of a single node's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx2
from pdserve.cli.up import Cluster, UpConfig, free_port, start_cluster
from pdserve.shared.cli.default_model import default_model_path

ROLES = ("prefill", "decode", "single")


@dataclass(frozen=True)
class Sample:
    """Client-side times of one streamed request, seconds from sending it."""

    ttft: float
    tt2t: float
    e2e: float
    tokens: int


def stream_once(base: str, model: str, prompt: list[int], max_tokens: int) -> Sample:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    marks: list[float] = []
    tokens = 0
    t0 = time.perf_counter()
    with httpx2.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base} answered {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(f"{base} failed a request: {chunk['error']}")
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                marks.append(time.perf_counter() - t0)
    e2e = time.perf_counter() - t0
    if len(marks) < 2:
        raise RuntimeError(f"{base} streamed {len(marks)} content chunks; need at least 2")
    return Sample(marks[0], marks[1], e2e, tokens)


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """Distinct prompts of `length` token ids from the ordinary part of SmolLM2's vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(count)]


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def table(results: dict[str, list[Sample]]) -> str:
    pd, single = results["pd"], results["single"]
    rows = [
        "| metric (client, through the router) | P/D (1 P + 1 D) | single | P/D / single |",
        "|---|---|---|---|",
    ]
    for label, attr in (
        ("time to first token", "ttft"),
        ("time to second token", "tt2t"),
        ("end to end", "e2e"),
    ):
        for q, qname in ((0.5, "p50"), (0.9, "p90")):
            a = pct([getattr(s, attr) for s in pd], q)
            b = pct([getattr(s, attr) for s in single], q)
            rows.append(f"| {label} {qname} (ms) | {1000 * a:.1f} | {1000 * b:.1f} | {a / b:.3f} |")
    toks = f"{statistics.mean(s.tokens for s in pd):.1f} | {statistics.mean(s.tokens for s in single):.1f}"
    rows.append(f"| output tokens per request (mean) | {toks} | |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/cluster_cpu.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (Q4_1 GGUF)")
    p.add_argument("--requests", type=int, default=20, help="measured requests per cluster")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests per cluster first")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads per node")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--node-args", default="", help="more flags for every node, e.g. '--dtype bfloat16'")
    for role in ROLES:
        p.add_argument(f"--{role}-args", default="", help=f"more flags for the {role} node(s)")
    args = p.parse_args(argv)
    if args.requests < 1 or args.prompt_tokens < 1 or args.max_tokens < 2 or args.warmup < 0:
        p.error("--requests, --prompt-tokens >= 1, --max-tokens >= 2 and --warmup >= 0 required")
    model = args.model or default_model_path()
    name = os.path.basename(os.path.normpath(model))
    clusters = {"pd": Cluster(), "single": Cluster()}
    bases: dict[str, str] = {}
    try:
        for key, (prefill, decode) in (("pd", (1, 1)), ("single", (0, 1))):
            cfg = UpConfig(
                model,
                free_port(),
                prefill,
                decode,
                args.threads,
                extra_node_args=tuple(shlex.split(args.node_args)),
                role_node_args=tuple(
                    (role, tuple(shlex.split(getattr(args, f"{role}_args")))) for role in ROLES
                ),
            )
            t0 = time.perf_counter()
            bases[key] = start_cluster(cfg, clusters[key])
            print(f"started {key} cluster in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        work = prompts(args.warmup + args.requests, args.prompt_tokens, args.seed)
        results: dict[str, list[Sample]] = {"pd": [], "single": []}
        for i, prompt in enumerate(work):
            order = ("pd", "single") if i % 2 == 0 else ("single", "pd")
            for key in order:
                sample = stream_once(bases[key], name, prompt, args.max_tokens)
                if i >= args.warmup:
                    results[key].append(sample)
    finally:
        for cluster in clusters.values():
            cluster.stop()
    cpu = f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}"
    print(f"# P/D vs single through the router, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {cpu}, {platform.system()} {platform.release()}; model {name}; torch threads per node "
          f"{args.threads}")  # fmt: skip
    flags = {role: getattr(args, f"{role}_args") for role in ROLES if getattr(args, f"{role}_args")}
    if args.node_args or flags:
        print(f"node flags: {args.node_args!r} for every node, {flags} by role")
    print(f"workload: {args.requests} requests per cluster (after {args.warmup} warm-up), one at a time, "
          f"{args.prompt_tokens}-token distinct prompts, {args.max_tokens} output tokens, greedy, "
          "streamed\n")  # fmt: skip
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
