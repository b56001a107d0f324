"""Many concurrent streams against a CPU cluster: every request completes with its greedy text or is refused
(429/503) before streaming; the router's CPU time against the busiest node's; completions per second.

A program, not a test:

    python benchmarks/streams_cpu.py --prefill 2 --decode 2 --streams 200,1000 \
        --router-args "--max-requests-per-node 32"

One cluster (Redis, router, nodes, the default SmolLM2 model) serves every load in turn. Each load sends
that many streamed completions at once (short distinct prompts, `--max-tokens` greedy tokens) through one
HTTP client, then waits for the cluster to be idle and reads every process's CPU seconds from /proc. The
greedy references come from one `pdserve generate` run. Prints one markdown row per load; exit status 1
if any admitted request failed or gave other text, or a node's audit is not clean.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import httpx
from pdserve.launch import Cluster, UpConfig, free_port, start_cluster
from pdserve.shared.node_auth import bearer


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its reaped children, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / ticks


def references(model: str, prompts: list[str], max_tokens: int) -> list[str]:
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--json", "--model", model,
           "--prompts-file", f.name, "--max-tokens", str(max_tokens), "--max-num-seqs", "256"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    os.unlink(f.name)
    if done.returncode != 0:
        raise SystemExit(f"pdserve generate failed: {done.stderr[-2000:]}")
    return [json.loads(line)["text"] for line in done.stdout.strip().splitlines()]


async def one(
    client: httpx.AsyncClient, base: str, model: str, prompt: str, max_tokens: int
) -> tuple[str, str]:
    """(outcome, text): outcome is 'ok', 'refused <status>' before streaming, or 'failed <why>'."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            if r.status_code in (429, 503):
                await r.aread()
                return f"refused {r.status_code}", ""
            if r.status_code != 200:
                return f"failed HTTP {r.status_code}", ""
            text = ""
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return f"failed {chunk['error'].get('code')}", text
                    text += chunk["choices"][0]["text"]
            return "ok", text
    except httpx.HTTPError as exc:
        return f"failed {type(exc).__name__}", ""


async def load(
    base: str, model: str, prompts: list[str], max_tokens: int
) -> tuple[list[tuple[str, str]], float]:
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0, connect=60.0), limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(client, base, model, p, max_tokens) for p in prompts))
        return list(results), time.perf_counter() - t0


def audits(cluster: Cluster, nodes: dict[str, str]) -> dict[str, dict[str, int]]:
    return {
        name: httpx.get(f"{url}/internal/audit", headers=bearer(cluster.auth_token), timeout=120).json()
        for name, url in nodes.items()
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--streams", default="200,1000", help="comma-separated loads (concurrent streams)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--router-args", default="", help='e.g. "--max-requests-per-node 32"')
    ap.add_argument("--node-args", default="--kv-cache-gib 0.25 --max-num-seqs 64")
    args = ap.parse_args()
    from pdserve.cli import default_model_path

    model = default_model_path()
    loads = [int(x) for x in args.streams.split(",")]
    prompts = {n: [f"Load {n}, request {i}: name a colour and a fruit." for i in range(n)] for n in loads}
    want = references(model, [p for n in loads for p in prompts[n]], args.max_tokens)
    cfg = UpConfig(
        model=model, prefill=args.prefill, decode=args.decode, port=free_port(), threads_per_node=1,
        extra_node_args=tuple(shlex.split(args.node_args)), router_args=tuple(shlex.split(args.router_args)),
    )  # fmt: skip
    cluster = Cluster()
    bad = False
    try:
        base = start_cluster(cfg, cluster)
        served = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        procs = {name: proc.pid for name, proc in cluster.procs}
        nodes = {}
        for name, proc in cluster.procs:
            argv = [str(a) for a in proc.args]  # type: ignore[union-attr]
            if name != "router":
                nodes[name] = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
        print(f"cluster: {args.prefill} P + {args.decode} D, router args {args.router_args!r}, node args "
              f"{args.node_args!r}, {args.max_tokens} tokens per request\n")  # fmt: skip
        print("| streams | completed | refused | failed | wrong text | wall s | completed/s | router CPU s | "
              "busiest node CPU s |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        offset = 0
        for n in loads:
            before = {name: cpu_seconds(pid) for name, pid in procs.items()}
            results, wall = asyncio.run(load(base, served, prompts[n], args.max_tokens))
            expected = want[offset : offset + n]
            offset += n
            time.sleep(2)
            after = {name: cpu_seconds(pid) for name, pid in procs.items()}
            used = {name: after[name] - before[name] for name in procs}
            ok = [i for i, (o, _) in enumerate(results) if o == "ok"]
            refused = sum(o.startswith("refused") for o, _ in results)
            failed = [o for o, _ in results if o.startswith("failed")]
            wrong = sum(results[i][1] != expected[i] for i in ok)
            busiest = max(v for k, v in used.items() if k != "router")
            rate = len(ok) / wall
            print(f"| {n} | {len(ok)} | {refused} | {len(failed)} | {wrong} | {wall:.1f} | {rate:.2f} | "
                  f"{used['router']:.1f} | {busiest:.1f} |", flush=True)  # fmt: skip
            if failed:
                print(f"  failures: {sorted(set(failed))}")
            bad |= bool(failed) or bool(wrong)
        dirty = {
            k: a
            for k, a in audits(cluster, nodes).items()
            if a["in_use"] or a["reserved"] or a["live_requests"]
        }
        print(f"\naudits: {dirty or 'clean'}")
        bad |= bool(dirty)
    finally:
        cluster.stop()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
