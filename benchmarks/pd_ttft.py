"""Time to first and second token, P/D across two devices beside one single node, straight to the node
processes (and, with `--via-router`, through a router as its client sees them), plus greedy output parity
and the nodes' block audits.

A program, not a test: `python benchmarks/pd_ttft.py --model dummy:llama-3.1-8b --dtype bfloat16
--device-p cuda:0 --device-d cuda:1 --connector nccl` on a two-GPU machine (or `--device-p cpu --device-d cpu
--connector tcp --model dummy:smollm2-135m` to check it here). For each of N prompts it opens D's
`/internal/generate` stream and P's `/internal/prefill` at once, as the router does, and times the first
and second token lines from D; the single node gets the same prompts with `prefill_node_id` None. With
`--via-router`, each node set also registers in its own Redis under its own router (the default policy:
P/D whenever a prefill and a decode node are live), and other prompts of the same length go through it as
streamed completions. Every node starts at once; `--prompt-tokens 1024,4096` measures each length on the
same nodes. Prints one table per length.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx2
from pdserve.cli.redis_launch import free_port
from pdserve.cli.up import Cluster, start_redis
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.node.node_protocol import NodeGenerateRequest, PrefillRequest, StepOutput
from pdserve.shared.node.node_sign import signed
from pdserve.shared.types import NodeId, RequestId


def add_node_options(ap: argparse.ArgumentParser, connector: str) -> None:
    """The options `node_argv` reads besides the pool's size (`kv_blocks`, `prompt_tokens`)."""
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--connector", default=connector)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                    help="every node's KV cache (fp8: half of bf16's bytes per transfer)")  # fmt: skip
    ap.add_argument("--layers-per-frame", type=int, default=4, help="P's KV-transfer frame size in layers")


def node_argv(
    role: str, node_id: str, port: int, tport: int, device: str, args: argparse.Namespace, tp: int = 1
) -> list[str]:
    """A benchmark node's command line (prefix_reuse.py's too): the model, pool and connector of `args`,
    at tensor-parallel size `tp` over `device` (e.g. cuda:0,1)."""
    module = "pdserve.prefill_node" if role == "prefill" else "pdserve.decode_node"
    argv = [sys.executable, "-m", module, "--node-id", node_id, "--port", str(port), "--model", args.model,
            "--device", device, "--dtype", args.dtype, "--num-kv-blocks", str(args.kv_blocks),
            "--max-num-seqs", "8", "--max-model-len", str(args.prompt_tokens + 64),
            "--connector", args.connector, "--transfer-port", str(tport),
            "--kv-cache-dtype", args.kv_cache_dtype, "--log-level", "WARNING",
            "--tensor-parallel-size", str(tp)]  # fmt: skip
    if role == "prefill":
        argv += ["--layers-per-frame", str(args.layers_per_frame)]
    if role == "single":
        argv += ["--role", "single"]
    return argv


def start_node(
    role: str,
    node_id: str,
    device: str,
    args: argparse.Namespace,
    token: str,
    tp: int = 1,
    redis: str | None = None,
) -> tuple[subprocess.Popen[bytes], str, int]:
    """A node process (registered in `redis` when given, for a router); its URL and transfer port."""
    port, tport = free_port(), free_port()
    env = os.environ | {"PDSERVE_AUTH_TOKEN": token}  # a secret: never on argv
    argv = node_argv(role, node_id, port, tport, device, args, tp) + (["--redis", redis] if redis else [])
    return subprocess.Popen(argv, env=env), f"http://127.0.0.1:{port}", tport  # fmt: skip


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"node at {url} exited with {proc.returncode}")
        with contextlib.suppress(httpx2.HTTPError):
            if httpx2.get(f"{url}/internal/health", timeout=1).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"node at {url} not ready in {timeout_s}s")


async def drive(
    client: httpx2.AsyncClient,
    d_url: str,
    gen: NodeGenerateRequest,
    prefill: tuple[str, PrefillRequest] | None,
    on_step: Callable[[StepOutput], None],
) -> dict[str, Any]:
    """One request straight to the nodes, as the router sends it (prefix_reuse.py's too): P's
    `/internal/prefill` (prefill = (P url, request), or None) beside D's `/internal/generate` stream, each
    step line to `on_step` until the finish; returns P's result ({} without P)."""
    pre_task = None
    if prefill is not None:
        url, pre = prefill
        pre_task = asyncio.create_task(client.post(f"{url}/internal/prefill", content=pre.to_json()))
    async with client.stream("POST", f"{d_url}/internal/generate", content=gen.to_json()) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line:
                continue
            step = StepOutput.from_line(line)
            assert step.error is None, step.error
            on_step(step)
            if step.finish_reason is not None:
                break
    if pre_task is None:
        return {}
    result: dict[str, Any] = json.loads((await pre_task).content)
    assert result.get("error") is None, result
    return result


TOP_N = 5  # logprobs asked for: the sampled token's and the 5 most likely, per position
Position = tuple[int, dict[int, float]]  # sampled token id, token id -> logprob (sampled + top N)


def logprob_gap(a: list[list[Position]], b: list[list[Position]]) -> float:
    """Largest |logprob difference| over every position's tokens present in both; inf if any sampled
    token differs."""
    worst = 0.0
    for out_a, out_b in zip(a, b, strict=True):
        for (tok_a, lp_a), (tok_b, lp_b) in zip(out_a, out_b, strict=True):
            if tok_a != tok_b:
                return float("inf")
            worst = max([worst] + [abs(v - lp_b[k]) for k, v in lp_a.items() if k in lp_b])
    return worst


async def one(client: httpx2.AsyncClient, d_url: str, p: tuple[str, str] | None, rid: str, prompt: list[int],
              max_tokens: int) -> tuple[float, float, list[Position], dict[str, Any]]:  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP_N)
    deadline = time.time() + 120
    gen = NodeGenerateRequest(RequestId(rid), tuple(prompt), params, None, deadline,
                              None if p is None else NodeId("prefill-0"))  # fmt: skip
    t0 = time.perf_counter()
    marks: list[float] = []
    tokens: list[Position] = []

    def on_step(step: StepOutput) -> None:
        assert step.logprobs is not None
        for t, lp in zip(step.token_ids, step.logprobs, strict=True):
            marks.append(time.perf_counter() - t0)
            tokens.append((t, {x.token_id: x.logprob for x in lp.top} | {t: lp.logprob}))

    pre = None
    if p is not None:
        pre = (
            p[0],
            PrefillRequest(RequestId(rid), tuple(prompt), params, None, deadline, NodeId("decode-0"), p[1]),
        )
    result = await drive(client, d_url, gen, pre, on_step)
    return marks[0], marks[1], tokens, result


Measured = tuple[list[float], list[float], list[list[Position]], list[dict[str, Any]]]


async def measure(d_url: str, p: tuple[str, str] | None, prompts: list[list[int]], max_tokens: int, tag: str,
                  token: str) -> Measured:  # fmt: skip
    ttft, t2, outs, results = [], [], [], []
    async with httpx2.AsyncClient(timeout=300, auth=signed(token)) as client:
        await one(client, d_url, p, f"{tag}-warm", prompts[0][::-1], max_tokens)
        for i, prompt in enumerate(prompts):
            a, b, toks, result = await one(client, d_url, p, f"{tag}-{i}", prompt, max_tokens)
            ttft.append(a)
            t2.append(b)
            outs.append(toks)
            results.append(result)
    return ttft, t2, outs, results


def transfer_alone(
    d_url: str,
    p: tuple[str, str],
    prompts: list[list[int]],
    max_tokens: int,
    token: str,
    empty_d: bool = True,
    tag: str = "",
) -> list[dict[str, Any]]:
    """`prompts` to P/D again, once P holds them: P computes only each prompt's last block, so the transfer
    is (almost) all that is left; returns P's results. With `empty_d`, D's prefix cache is emptied first, so
    the whole KV moves (D kept the prompts' blocks from the run before, and would take only the last one).
    `tag` keeps the request ids of one call apart from another's."""
    if empty_d:
        evicted = httpx2.post(f"{d_url}/internal/evict", json={"all": True}, auth=signed(token), timeout=30)
        evicted.raise_for_status()
    return asyncio.run(
        measure(d_url, p, prompts, max_tokens, f"{tag}pdc" if empty_d else f"{tag}pdh", token)
    )[3]


def kv_bytes_per_token_of(model: str, kv_cache_dtype: str, dtype: str) -> int:
    """KV bytes per token of a dummy shape (0 for a model this program cannot size)."""
    from pdserve.shared.model.model_config import NAMED_SHAPES

    c = NAMED_SHAPES.get(model.removeprefix("dummy:"))
    if c is None:
        return 0
    size = 1 if kv_cache_dtype == "fp8" else (4 if dtype == "float32" else 2)
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * size


def transfer_line(who: str, results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """One row of the `--cached` report: P's transfer to D (first DATA frame to D's ACK) beside P's compute
    of the same step, which per-layer frames wait for, and the part after P's first token (medians)."""
    med = statistics.median
    blocks = med([r.get("transferred_blocks", 0) for r in results])
    kv_bytes = blocks * 16 * kv_bytes_per_token_of(args.model, args.kv_cache_dtype, args.dtype)
    transfer = med([r.get("transfer_seconds", 0.0) for r in results])
    compute = med([r.get("compute_seconds", 0.0) for r in results])
    tail = med([r.get("transfer_tail_seconds", 0.0) for r in results])
    return (f"{who}: {blocks:.0f} blocks ({kv_bytes / 2**20:.1f} MiB) in {transfer * 1e3:.2f} ms "
            f"({kv_bytes / max(transfer, 1e-9) / 2**30:.1f} GiB/s); P's compute {compute * 1e3:.2f} ms; "
            f"after P's first token {tail * 1e3:.2f} ms")  # fmt: skip


def audit(url: str, token: str) -> dict[str, int]:
    return dict(httpx2.get(f"{url}/internal/audit", auth=signed(token), timeout=10).json())


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RouterRefused(Exception):
    """The router answered a request with an error (before it has seen the nodes: no node can take it)."""


async def routed(
    client: httpx2.AsyncClient, base: str, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, float]:
    """Times to the first and second token of one greedy request through the router, as its client sees
    them: the chunks carry logprobs (logprobs=0), which arrive with their token whether or not its text is
    held back (the detokenizer releases no incomplete UTF-8)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0}  # fmt: skip
    t0 = time.perf_counter()
    marks: list[float] = []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RouterRefused(f"{resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            marks += [time.perf_counter() - t0] * len((choice.get("logprobs") or {}).get("tokens") or ())
    return marks[0], marks[1]


Routed = tuple[list[float], list[float], str]
"""The first and second token times of each prompt through a router, and its decisions by kind."""


async def measure_routed(base: str, prompts: list[list[int]], max_tokens: int, token: str) -> Routed:
    """`prompts` one at a time through the router (after a warm request, retried until the router has seen
    the nodes through Redis); the first and second token times of each, and the router's decisions."""
    ttft, t2 = [], []
    async with httpx2.AsyncClient(timeout=300, auth=signed(token)) as client:
        deadline = time.monotonic() + 60
        while True:
            try:
                model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
                await routed(client, base, model, prompts[0][::-1], max_tokens)
                break
            except (RouterRefused, IndexError, KeyError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        for prompt in prompts:
            a, b = await routed(client, base, model, prompt, max_tokens)
            ttft.append(a)
            t2.append(b)
        page = (await client.get(f"{base}/metrics")).text
    kinds = re.findall(r'pdserve_router_decisions_total\{kind="(\w+)"\} ([0-9.e+]+)', page)
    return ttft, t2, ", ".join(f"{k} {float(v):.0f}" for k, v in kinds if float(v))


def start_router(cluster: Cluster, model: str) -> str:
    """A router (the default policy: P/D whenever a prefill and a decode node are live) over the cluster's
    Redis; its base URL once it answers."""
    port = free_port()
    redis_url = cluster.redis[0].url
    argv = [sys.executable, "-m", "pdserve.router", "--model", model, "--redis", redis_url,
            "--port", str(port), "--log-level", "WARNING"]  # fmt: skip
    cluster.spawn("router", argv, env=cluster.secret_env)
    base = f"http://127.0.0.1:{port}"
    cluster.wait_http(f"{base}/health", timeout_s=120)
    return base


def copy_limit(src: str, dst: str, mib: int = 256) -> float:
    """GiB/s of one plain device-to-device copy of `mib` MiB from `src` to `dst` (the copy engines; NVLink
    between two GPUs), median of 10 after a warm-up: the limit a transfer between those GPUs is held to."""
    import torch

    a = torch.empty(mib << 20, dtype=torch.uint8, device=src)
    b = torch.empty_like(a, device=dst)
    times = []
    for _ in range(11):
        torch.cuda.synchronize(a.device)
        torch.cuda.synchronize(b.device)
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(a.device)
        torch.cuda.synchronize(b.device)
        times.append(time.perf_counter() - t0)
    return mib / 1024 / statistics.median(times[1:])


def prompt_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: accepted a token count or counts, e.g. 1024,4096"
        ) from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: token counts must be positive")
    return lengths


@dataclass
class Results:
    """One prompt length's measurements: straight to the nodes (and through a router), P/D and single."""

    pd: Measured
    single: Measured | None = None
    pd_routed: Routed | None = None
    single_routed: Routed | None = None
    held: list[dict[str, Any]] = field(default_factory=list)
    cached: list[dict[str, Any]] = field(default_factory=list)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_node_options(ap, connector="nccl")
    ap.add_argument("--device-p", default="cuda:0")
    ap.add_argument("--device-d", default="cuda:1")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=prompt_lengths, default=[4096],
                    help="the prompts' length, or lengths (1024,4096: each on the same nodes)")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=4096)
    ap.add_argument("--cached", action="store_true",
                    help="every prompt to P/D again, held by P now, into D holding it and into D emptied "
                         "first (the whole KV; one frame of every layer after P's forward: the transfer "
                         "alone)")  # fmt: skip
    ap.add_argument("--device-s", default=None, help="the single node's devices (default: --device-p)")
    ap.add_argument("--tp-p", type=int, default=1, help="P's tensor-parallel size")
    ap.add_argument("--tp-d", type=int, default=1, help="D's tensor-parallel size")
    ap.add_argument(
        "--tp-s", type=int, default=None, help="the single node's tensor-parallel size (default: D's)"
    )
    ap.add_argument("--no-single", action="store_true",
                    help="P/D alone, without the single-node peer (for the transfer figures)")  # fmt: skip
    ap.add_argument("--via-router", action="store_true",
                    help="also through a router and Redis (one each for P/D and for the single node): the "
                         "client's TTFT, other prompts of the same lengths")  # fmt: skip
    ap.add_argument(
        "--copy-limit",
        action="store_true",
        help="after the nodes stop, time a plain copy from P's first GPU to D's (the link's limit)",
    )
    args = ap.parse_args()
    lengths: list[int] = args.prompt_tokens
    args.prompt_tokens = max(lengths)  # node_argv sizes the nodes' --max-model-len by it
    import random

    rng = random.Random(0)
    prompts = {
        n: [[rng.randrange(1, 30000) for _ in range(n)] for _ in range(args.requests)] for n in lengths
    }
    others = {n: [[rng.randrange(1, 30000) for _ in range(n)] for _ in range(args.requests)] for n in lengths}
    token = secrets.token_hex(16)
    tp_s = args.tp_d if args.tp_s is None else args.tp_s
    s_devices = args.device_s or args.device_p
    clusters: list[Cluster] = []  # Redis and a router each, with --via-router

    def redis() -> str | None:
        if not args.via_router:
            return None
        clusters.append(Cluster(auth_token=token))
        return start_redis(clusters[-1])

    procs: list[subprocess.Popen[bytes]] = []
    results: dict[int, Results] = {}
    audits: list[tuple[str, dict[str, int]]] = []
    try:  # every node starts at once (they fit the two GPUs side by side) and is measured alone, in turn
        s_url = ""
        if not args.no_single:
            s_redis = redis()
            s_proc, s_url, _ = start_node("single", "single-0", s_devices, args, token, tp_s, s_redis)
            procs.append(s_proc)
        pd_redis = redis()
        p_proc, p_url, _ = start_node("prefill", "prefill-0", args.device_p, args, token, args.tp_p, pd_redis)
        d_proc, d_url, d_tport = start_node(
            "decode", "decode-0", args.device_d, args, token, args.tp_d, pd_redis
        )
        procs += [p_proc, d_proc]
        for url, proc in zip([s_url, p_url, d_url][-len(procs) :], procs, strict=True):
            wait_ready(url, proc)
        routers = [start_router(c, args.model) for c in clusters]  # [single's,] P/D's
        d_addr = f"{args.connector}://127.0.0.1:{d_tport}"
        for n in lengths:
            r = Results(
                asyncio.run(measure(d_url, (p_url, d_addr), prompts[n], args.max_tokens, f"pd{n}", token))
            )
            if args.cached:  # D holding the prompts first (as the run above left it), then emptied
                pd = (p_url, d_addr)
                r.held = transfer_alone(d_url, pd, prompts[n], args.max_tokens, token, False, f"{n}")
                r.cached = transfer_alone(d_url, pd, prompts[n], args.max_tokens, token, True, f"{n}")
            if args.via_router:  # after: its prompts would evict the first ones from P's pool
                r.pd_routed = asyncio.run(measure_routed(routers[-1], others[n], args.max_tokens, token))
            if s_url:
                r.single = asyncio.run(measure(s_url, None, prompts[n], args.max_tokens, f"s{n}", token))
                if args.via_router:
                    r.single_routed = asyncio.run(
                        measure_routed(routers[0], others[n], args.max_tokens, token)
                    )
            results[n] = r
        time.sleep(0.5)
        audits = [("P", audit(p_url, token)), ("D", audit(d_url, token))]
        if s_url:
            audits.append(("single", audit(s_url, token)))
    finally:
        stop(procs)
        for c in clusters:
            c.stop()
    print(f"\n{args.requests} prompts of each length, {args.model} {args.dtype} (KV {args.kv_cache_dtype}), "
          f"P {args.device_p} TP={args.tp_p} -> D {args.device_d} TP={args.tp_d} over {args.connector} "
          f"(single: {'none' if args.no_single else f'{s_devices} TP={tp_s}'}), "
          f"{args.layers_per_frame} layer(s) per frame; straight to the nodes"
          f"{', and through a router (other prompts, same lengths)' if args.via_router else ''}")  # fmt: skip
    for n in lengths:
        report(n, results[n], args)
    for who, au in audits:
        print(f"- {who} audit in_use/reserved/live: {au['in_use']}/{au['reserved']}/{au['live_requests']}")
    if args.copy_limit:
        src, dst = args.device_p.split(",")[0], "cuda:" + args.device_d.removeprefix("cuda:").split(",")[0]
        src = src if ":" in src else "cuda:0"
        print(f"- plain copy {src} -> {dst}, 256 MiB: {copy_limit(src, dst):.0f} GiB/s")
    clean = all(au["in_use"] == au["reserved"] == au["live_requests"] == 0 for _, au in audits)
    return 0 if clean else 1


def report(n: int, r: Results, args: argparse.Namespace) -> None:
    """One prompt length's table."""
    med = statistics.median
    pd_ttft, pd_t2, pd_out, pd_res = r.pd
    transfer = [x.get("transfer_seconds", 0.0) for x in pd_res]
    tail = [x.get("transfer_tail_seconds", 0.0) for x in pd_res]
    blocks = med([x.get("transferred_blocks", 0) for x in pd_res])
    kv_bytes = blocks * 16 * kv_bytes_per_token_of(args.model, args.kv_cache_dtype, args.dtype)
    rate = kv_bytes / max(med(transfer), 1e-9) / 2**30
    print(f"\n### {n} tokens\n\nKV transfer P -> D per request, p50: {med(transfer) * 1e3:.2f} ms for "
          f"{blocks:.0f} blocks ({kv_bytes / 2**20:.1f} MiB, {rate:.1f} GiB/s); not hidden under P's compute "
          f"(tail) p50 {med(tail) * 1e3:.2f} ms\n")  # fmt: skip
    if r.cached:
        hits = med([x.get("cached_tokens", 0) for x in r.cached])
        print(f"Again with the prompt held by P ({hits:.0f} cached tokens; P computes the last block, and "
              f"its {args.layers_per_frame}-layer frames go out as it computes), p50:")  # fmt: skip
        for who, res in (("D emptied first", r.cached), ("D holding the prompt already", r.held)):
            print("- " + transfer_line(who, res, args))
        print()
    rows = [("time to first token p50 (ms)", pd_ttft, r.single[0] if r.single else None),
            ("time to second token p50 (ms)", pd_t2, r.single[1] if r.single else None)]  # fmt: skip
    if r.pd_routed is not None:
        s_routed = r.single_routed or (None, None, "")
        rows += [("time to first token, via the router, p50 (ms)", r.pd_routed[0], s_routed[0]),
                 ("time to second token, via the router, p50 (ms)", r.pd_routed[1], s_routed[1])]  # fmt: skip
    print("| metric | P/D | single | P/D / single |\n|---|---:|---:|---:|")
    for name, pd, one_node in rows:
        if one_node is None:
            print(f"| {name} | {med(pd) * 1e3:.1f} | | |")
        else:
            a, b = med(pd), med(one_node)
            print(f"| {name} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.3f} |")
    if r.pd_routed is not None:
        print(f"| routers' decisions so far, warm ones included | {r.pd_routed[2]} | {s_routed[2]} | |")
    if r.single is not None:
        s_out = r.single[2]
        same = sum([t for t, _ in x] == [t for t, _ in y] for x, y in zip(pd_out, s_out, strict=True))
        print(f"| greedy outputs identical, P/D vs single | {same}/{len(pd_out)} | | |")
        print(
            f"| max abs logprob difference, P/D vs single (sampled + top {TOP_N}, every position) | "
            f"{logprob_gap(pd_out, s_out):.3g} | | |"
        )


if __name__ == "__main__":
    sys.exit(main())
