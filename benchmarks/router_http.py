"""HTTP requests per second of one router process, with the model taken out of the measurement.

Starts a real redis-server, a real router process (`python -m pdserve.router`) and an *echo node*: a real
node process that registers in the index as a `single` node and answers every `/internal/generate` at once
with one token. So each request pays everything the router does (parse, validate, tokenize with the chat
template, hash, one Redis lookup, choose, one HTTP hop to a node, stream parsing, OpenAI response) and no
model time. The echo node is part of this benchmark only, never of the product.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pdserve.cli import default_model_path
from pdserve.redis_launch import LocalRedis, free_port
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import NodeInfo, NodeLoad, RedisConfig
from pdserve.shared.node.node_auth import credential_digest
from pdserve.shared.node.node_protocol import NodeGenerateRequest, StepOutput
from pdserve.shared.types import KVLayout, NodeId

CRED = credential_digest("bench")
FINGERPRINT_HEX = "ab" * 32
LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")


def echo_node(port: int, redis_url: str) -> None:
    from fastapi.responses import StreamingResponse

    app = FastAPI()
    node = NodeId("echo-0")

    async def register() -> None:
        index = BlockIndex(RedisConfig(url=redis_url, heartbeat_ttl_s=3600, records_ttl_s=7200))
        info = NodeInfo(
            node, "single", f"http://127.0.0.1:{port}", "", FINGERPRINT_HEX, LAYOUT, 1, 100_000, CRED, 8192
        )
        await index.register(info)
        await index.heartbeat(node, NodeLoad(0, 0, 0, 100_000, 0))

    @app.post("/internal/generate")
    async def generate(request: Request) -> StreamingResponse:
        gen = NodeGenerateRequest.from_json(await request.body())
        line = StepOutput(
            gen.request_id, (42,), " ok", None, "length", len(gen.prompt_token_ids), 1, 0
        ).to_line()

        async def body() -> AsyncIterator[bytes]:
            yield line

        return StreamingResponse(body(), media_type="application/x-ndjson")

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
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as client:

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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--model", default=None, help="tokenizer source (default SmolLM2's GGUF)")
    p.add_argument("--echo-node", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--redis", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.echo_node:
        echo_node(args.echo_node, args.redis)
        return 0
    model = args.model or default_model_path()
    procs: list[subprocess.Popen[bytes]] = []
    with LocalRedis() as redis:
        try:
            node_port, router_port = free_port(), free_port()
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--echo-node", str(node_port), "--redis", redis.url]
                )
            )
            router = [sys.executable, "-m", "pdserve.router", "--model", model, "--redis", redis.url]
            env = os.environ | {"PDSERVE_AUTH_TOKEN": "echo-node"}  # the echo node asks for no credential
            procs.append(subprocess.Popen([*router, "--port", str(router_port)], env=env))
            base = f"http://127.0.0.1:{router_port}"
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                time.sleep(0.3)
            name = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
            asyncio.run(load(base, name, 100, 8))  # warm-up: connections, tokenizer, node list
            wall, lat, errors = asyncio.run(load(base, name, args.requests, args.concurrency))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=10)
    q = statistics.quantiles(lat, n=100)
    print("| measurement | value |\n|---|---:|")
    print(f"| router HTTP requests/s (chat, ~100-token prompt, echo node) | {len(lat) / wall:,.0f} |")
    print(f"| latency p50 / p99 (ms) | {q[49] * 1e3:.1f} / {q[98] * 1e3:.1f} |")
    print(f"| requests / concurrency / errors | {len(lat)} / {args.concurrency} / {errors} |")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
