"""HTTP requests per second of one router process, with the model taken out of the measurement.

Starts a real redis-server, a real router process (`python -m pdserve.router`) and an *echo node*: a real
node process that registers in the index as a `single` node and answers every `/internal/generate` at once
with one token (after decoding the request as a node does). So each request pays everything the router does
(parse, validate, tokenize with the chat template, hash, one Redis lookup, choose, one HTTP hop to a node,
stream parsing, OpenAI response) and no model time. The echo node is part of this benchmark only, never of
the product.

`--prompt-tokens N` measures instead the router's own time to first token for one long token-id prompt
(as benchmarks/prefix_reuse.py --router sends its 16k-token prompts): the echo node publishes the prompt's
blocks, so the lookup walks the whole prefix; one streamed /v1/completions at a time against the same
NodeGenerateRequest sent straight to the echo node (as the router would send it), medians of `--runs`.
With `--requests` too, it sends `--requests` such streamed completions from `--concurrency` clients at once
(closed loop) and reports requests/s and the CPU seconds the router and the echo node spent per request
(their user + system time over the run, from /proc), which is what queues a burst's tail.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import httpx2
import psutil
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pdserve.cli.redis_launch import LocalRedis, free_port
from pdserve.shared.cli.default_model import default_model_path
from pdserve.shared.engine.block_hash import hash_blocks, hash_seed, model_fingerprint
from pdserve.shared.engine.block_pool import BlockStored
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import NodeInfo, NodeLoad, RedisConfig
from pdserve.shared.model.gguf_loader import read_gguf
from pdserve.shared.node.node_auth import credential_digest
from pdserve.shared.node.node_protocol import (
    PROTOCOL_VERSION,
    ChallengeReply,
    ChallengeRequest,
    NodeGenerateRequest,
    StepOutput,
)
from pdserve.shared.node.node_sign import ClusterKeys
from pdserve.shared.types import KVLayout, NodeId, RequestId

TOKEN = "echo-node"
JSON = {"content-type": "application/json"}
CRED = credential_digest(TOKEN)
KEYS = ClusterKeys(TOKEN)
LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")


def long_prompt(tokens: int) -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(1, 30000) for _ in range(tokens)]


def fingerprint(model: str) -> str:
    """The model fingerprint a real node of `model` registers (router/model_check.py checks it)."""
    config, _, identity = read_gguf(model)
    return model_fingerprint(config.to_dict(), identity, LAYOUT.dtype, LAYOUT.block_size).hex()


def echo_node(port: int, redis_url: str, prompt_tokens: int, model: str) -> None:
    from fastapi.responses import StreamingResponse

    app = FastAPI()
    node = NodeId("echo-0")
    epochs: list[int] = []

    async def register() -> None:
        index = BlockIndex(RedisConfig(url=redis_url, heartbeat_ttl_s=3600, records_ttl_s=7200), KEYS)
        info = NodeInfo(
            node, "single", f"http://127.0.0.1:{port}", "", fingerprint(model), LAYOUT, PROTOCOL_VERSION,
            100_000, CRED, max(8192, prompt_tokens + 64),
        )  # fmt: skip
        epoch = await index.register(info, NodeLoad(0, 0, 0, 100_000, 0))
        epochs.append(epoch)
        if prompt_tokens:  # the long prompt's prefix is held here: the router's lookup walks all of it
            seed = hash_seed(bytes.fromhex(info.model_fingerprint), None)
            hashes = hash_blocks(long_prompt(prompt_tokens), LAYOUT.block_size, seed)
            await index.publish(node, epoch, [BlockStored(tuple(hashes), None)])

    @app.post("/internal/generate")
    async def generate(request: Request) -> StreamingResponse:
        gen = NodeGenerateRequest.from_json(await request.body())
        line = StepOutput(
            gen.request_id, (42,), " ok", None, "length", len(gen.prompt_token_ids), 1, 0
        ).to_line()

        async def body() -> AsyncIterator[bytes]:
            yield line

        return StreamingResponse(body(), media_type="application/x-ndjson")

    @app.post("/internal/challenge")
    async def challenge(request: Request) -> StreamingResponse:
        nonce = ChallengeRequest.from_json(await request.body()).nonce
        reply = ChallengeReply(node, epochs[-1], KEYS.challenge_answer(nonce, node, epochs[-1]))

        async def body() -> AsyncIterator[bytes]:
            yield reply.to_json()

        return StreamingResponse(body(), media_type="application/json")

    @app.post("/internal/abort")
    async def abort() -> dict[str, bool]:
        return {"ok": True}

    app.router.on_startup.append(register)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


async def load(base: str, model: str, requests: int, concurrency: int) -> tuple[float, list[float], int]:
    prompt = "Summarize the history of the printing press in Europe. " * 8
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    latencies: list[float] = []
    errors = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx2.AsyncClient(base_url=base, limits=limits, timeout=60) as client:

        async def worker() -> None:
            nonlocal errors
            while not queue.empty():
                queue.get_nowait()
                t0 = time.perf_counter()
                r = await client.post("/v1/chat/completions", json=body)
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors += 1
                    if errors == 1:
                        print(f"first error: {r.status_code} {r.text[:300]}", file=sys.stderr)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0, latencies, errors


async def first_token(client: httpx2.AsyncClient, method_url: str, **kwargs: object) -> float:
    """Seconds from sending a streamed request to its first token (an SSE text chunk or an NDJSON step); the
    stream is read to its end, so the connection is kept for the next request."""
    t0 = time.perf_counter()
    first = 0.0
    async with client.stream("POST", method_url, **kwargs) as resp:  # type: ignore[arg-type]
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if first:
                continue
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                first = time.perf_counter() - t0
            if line.startswith("{") and StepOutput.from_line(line).token_ids:
                first = time.perf_counter() - t0
    assert first, f"{method_url}: no token came"
    return first


async def latency(base: str, node: str, model: str, tokens: int, runs: int) -> dict[str, list[float]]:
    """Time to first token of one long token-id prompt, through the router and straight to the echo node."""
    prompt = long_prompt(tokens)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True})
    params = SamplingParams(max_tokens=1, temperature=0.0)
    out: dict[str, list[float]] = {"router": [], "straight": []}
    async with httpx2.AsyncClient(timeout=60) as client:
        for i in range(runs + 2):  # two warm-ups
            routed = await first_token(client, f"{base}/v1/completions", content=body, headers=JSON)
            gen = NodeGenerateRequest(RequestId(f"s{i}"), tuple(prompt), params, None, time.time() + 60)
            t0 = time.perf_counter()
            data = gen.to_json()  # the router's encoding: timed on both sides
            encode = time.perf_counter() - t0
            straight = encode + await first_token(client, f"{node}/internal/generate", content=data)
            if i >= 2:
                out["router"].append(routed)
                out["straight"].append(straight)
    return out


async def stream_load(
    base: str, model: str, tokens: int, requests: int, concurrency: int
) -> tuple[float, list[float]]:
    """Wall seconds and per-request latencies of `requests` streamed token-id completions, `concurrency` at
    a time; every stream is read to its end and must carry its token."""
    body = json.dumps({"model": model, "prompt": long_prompt(tokens), "max_tokens": 1, "stream": True})
    latencies: list[float] = []
    left = list(range(requests))
    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx2.AsyncClient(base_url=base, limits=limits, timeout=60) as client:

        async def worker() -> None:
            while left:
                left.pop()
                latencies.append(await first_token(client, "/v1/completions", content=body, headers=JSON))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0, latencies


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests (default 2000; with --prompt-tokens: "
        "send this many at --concurrency instead of timing one at a time)",
    )
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--model", default=None, help="tokenizer source (default SmolLM2's GGUF)")
    p.add_argument("--prompt-tokens", type=int, default=0, help="time to first token of one such prompt")
    p.add_argument("--runs", type=int, default=20, help="with --prompt-tokens: requests measured")
    p.add_argument("--echo-node", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--redis", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    model = args.model or default_model_path()
    if args.echo_node:
        echo_node(args.echo_node, args.redis, args.prompt_tokens, model)
        return 0
    procs: list[subprocess.Popen[bytes]] = []
    with LocalRedis() as redis:
        try:
            node_port, router_port = free_port(), free_port()
            procs.append(
                subprocess.Popen(
                    [
                        *(sys.executable, __file__, "--echo-node", str(node_port), "--redis", redis.url),
                        *("--prompt-tokens", str(args.prompt_tokens), "--model", model),
                    ]
                )
            )
            router = [sys.executable, "-m", "pdserve.router", "--model", model, "--redis", redis.url]
            env = os.environ | {
                "PDSERVE_AUTH_TOKEN": TOKEN
            }  # the echo node answers challenges, checks no signature
            procs.append(subprocess.Popen([*router, "--port", str(router_port)], env=env))
            base = f"http://127.0.0.1:{router_port}"
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx2.HTTPError):
                    if httpx2.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                time.sleep(0.3)
            name = httpx2.get(f"{base}/v1/models").json()["data"][0]["id"]
            if args.prompt_tokens and args.requests:
                asyncio.run(stream_load(base, name, args.prompt_tokens, 50, 8))  # warm-up
                pids = [proc.pid for proc in procs]
                cpu0 = [cpu_s(pid) for pid in pids]
                wall, lat = asyncio.run(
                    stream_load(base, name, args.prompt_tokens, args.requests, args.concurrency)
                )
                node_cpu, router_cpu = (cpu_s(pid) - c for pid, c in zip(pids, cpu0, strict=True))
            elif args.prompt_tokens:
                node = f"http://127.0.0.1:{node_port}"
                times = asyncio.run(latency(base, node, name, args.prompt_tokens, args.runs))
            else:
                asyncio.run(load(base, name, 100, 8))  # warm-up: connections, tokenizer, node list
                wall, lat, errors = asyncio.run(load(base, name, args.requests or 2000, args.concurrency))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=10)
    if args.prompt_tokens and args.requests:
        q = statistics.quantiles(lat, n=100)
        print(f"| {args.prompt_tokens}-token id prompt, streamed, {len(lat)} requests | value |\n|---|---:|")
        print(f"| requests/s at concurrency {args.concurrency} (2 cores: client, router, echo node) "
              f"| {len(lat) / wall:,.0f} |")  # fmt: skip
        print(f"| router CPU per request (ms) | {router_cpu / len(lat) * 1e3:.2f} |")
        print(f"| echo node CPU per request (ms) | {node_cpu / len(lat) * 1e3:.2f} |")
        print(f"| time to first token p50 / p99 (ms) | {q[49] * 1e3:.1f} / {q[98] * 1e3:.1f} |")
        return 0
    if args.prompt_tokens:
        routed, straight = (statistics.median(times[k]) * 1e3 for k in ("router", "straight"))
        own = statistics.median(r - s for r, s in zip(times["router"], times["straight"], strict=True)) * 1e3
        print(f"| {args.prompt_tokens}-token id prompt, median of {args.runs} | ms |\n|---|---:|")
        print(f"| time to first token through the router | {routed:.1f} |")
        print(f"| the same request straight to the echo node (encode, send, node decode) | {straight:.1f} |")
        print(f"| the router's own time (median of the paired differences) | {own:.1f} |")
        return 0
    q = statistics.quantiles(lat, n=100)
    print("| measurement | value |\n|---|---:|")
    print(f"| router HTTP requests/s (chat, ~100-token prompt, echo node) | {len(lat) / wall:,.0f} |")
    print(f"| latency p50 / p99 (ms) | {q[49] * 1e3:.1f} / {q[98] * 1e3:.1f} |")
    print(f"| requests / concurrency / errors | {len(lat)} / {args.concurrency} / {errors} |")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
