"""The fleet's admission ledger (router/ledger_redis.py, `--admission redis`) against a real redis-server.

A program, not a test: `python benchmarks/fleet_ledger.py [--routers N] [--nodes N] [--placements N]` prints
a table. It starts redis-server on a free port and runs N router ledgers in one process, each placing P/D
bookings (acquire, prefill_done, release: what one request costs the ledger) as fast as it can on random node
pairs under no cap, then under a cap that keeps the queue busy; beside it, a Redis PING round trip (the
floor of any call). It reports the client's p50/p99 per acquire and Redis's own time per script call
(INFO commandstats, usec_per_call of evalsha), which every router of a fleet shares.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Sequence

import redis.asyncio as aioredis
from pdserve.cli.redis_launch import LocalRedis
from pdserve.router.admission import AdmissionConfig, NodeFull
from pdserve.router.background import Background
from pdserve.router.ledger_redis import RedisLedger
from pdserve.router.metrics import RouterMetrics
from pdserve.shared.index.block_index_types import RedisConfig
from pdserve.shared.index.lease_table import LeaseTable
from pdserve.shared.types import NodeId


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


async def phase(
    url: str, routers: int, nodes: int, placements: int, cap: int, tag: str
) -> tuple[list[float], int]:
    """Each router places `placements` requests at once (acquire, prefill done, release); the time of every
    acquire call (s), and how many were refused (a full node, or another placement's turn)."""
    config = AdmissionConfig(max_requests_per_node=cap, fleet=True)
    ledgers = [
        RedisLedger(config, LeaseTable(RedisConfig(url=url, cluster=tag)), RouterMetrics(), Background())
        for _ in range(routers)
    ]
    decode = [NodeId(f"d{i}") for i in range(nodes)]
    prefill = [NodeId(f"p{i}") for i in range(nodes)]
    samples: list[float] = []
    refused = [0]

    async def one(ledger: RedisLedger) -> None:
        with ledger.turn() as turn:
            while True:
                node_pair = (random.choice(decode), random.choice(prefill))
                started = time.perf_counter()
                try:
                    (booking,) = await ledger.acquire(*node_pair, 512, 1, turn)
                    break
                except NodeFull:
                    refused[0] += 1
                    await ledger.wait_for_room(time.time() + 60, turn)
                finally:
                    samples.append(time.perf_counter() - started)
        await asyncio.sleep(0.001)
        booking.prefill_done()
        await asyncio.sleep(0.001)
        booking.release()

    async def router(ledger: RedisLedger) -> None:
        await ledger.start()
        await asyncio.gather(*(one(ledger) for _ in range(placements)))
        await ledger._background.drain()
        await ledger.close()

    await asyncio.gather(*(router(ledger) for ledger in ledgers))
    return samples, refused[0]


async def main(args: argparse.Namespace) -> None:
    with LocalRedis() as server:
        client = aioredis.Redis.from_url(server.url)
        pings = []
        for _ in range(500):
            started = time.perf_counter()
            await client.ping()
            pings.append(time.perf_counter() - started)
        print(f"redis-server {server.url}; {args.routers} routers, {args.nodes} P + {args.nodes} D nodes")
        print("| phase | acquire calls (refused) | client p50 ms | client p99 ms | Redis evalsha us/call |")
        print("|---|---|---|---|---|")
        print(f"| PING round trip | 500 | {pct(pings, 0.5):.3f} | {pct(pings, 0.99):.3f} | - |")
        for cap, tag in ((0, "nocap"), (args.cap, "capped")):
            await client.config_resetstat()
            samples, refused = await phase(server.url, args.routers, args.nodes, args.placements, cap, tag)
            stats = await client.info("commandstats")
            usec = stats.get("cmdstat_evalsha", {}).get("usec_per_call", 0.0)
            name = "no cap" if cap == 0 else f"cap {cap} per node (placements queue)"
            p50, p99 = pct(samples, 0.5), pct(samples, 0.99)
            print(f"| {name} | {len(samples)} ({refused}) | {p50:.3f} | {p99:.3f} | {usec:.1f} |")
        await client.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routers", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--placements", type=int, default=500, help="per router, all in flight at once")
    parser.add_argument("--cap", type=int, default=8)
    asyncio.run(main(parser.parse_args()))
