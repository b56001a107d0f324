"""The Redis block index against a real redis-server: registry, epochs, expiry, lookup, AUTH, errors."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import socket
import subprocess
import time
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar, cast

import pytest
import redis.asyncio
import redis.exceptions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pdserve.cli import redis_launch as block_index_server
from pdserve.cli.redis_launch import LocalRedis, free_port
from pdserve.shared.engine.block_hash import hash_blocks, hash_seed
from pdserve.shared.engine.block_pool import BlockPool, BlockRemoved, BlockStored, BlockTiered
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import (
    BlocksDigest,
    IncompatibleNode,
    IndexAuthError,
    IndexUnavailable,
    NodeInfo,
    NodeLoad,
    NodeNotRegistered,
    RedisConfig,
    StaleEpoch,
)
from pdserve.shared.node.node_auth import credential_digest
from pdserve.shared.node.node_sign import ClusterKeys
from pdserve.shared.types import BlockHash, BlockId, KVLayout, NodeId, Role

T = TypeVar("T")
FP = "ab" * 32
CRED = credential_digest("test-cluster-token")
KEYS = ClusterKeys("test-cluster-token")
IDLE = NodeLoad(0, 0, 0, 10, 0)
DRAINING = NodeLoad(0, 0, 0, 10, 0, draining=True)
LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
_clusters = itertools.count()


def run(coro: Awaitable[T]) -> T:
    async def wrapped() -> T:
        return await coro

    return asyncio.run(wrapped())


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    with LocalRedis() as server:
        yield server


def make_index(server: LocalRedis, **kw: Any) -> BlockIndex:
    """A client on a fresh cluster name, so tests share the server but no keys."""
    return BlockIndex(RedisConfig(url=server.url, cluster=f"t{next(_clusters)}", **kw), KEYS)


def node(
    name: str,
    role: Role = "prefill",
    fingerprint: str = FP,
    protocol: int = 1,
    credential: str = CRED,
    **layout: Any,
) -> NodeInfo:
    return NodeInfo(NodeId(name), role, f"http://127.0.0.1:1/{name}", "127.0.0.1:2", fingerprint,
                    dataclasses.replace(LAYOUT, **layout), protocol, 1000, credential, 8192)  # fmt: skip


def hashes(n: int) -> list[BlockHash]:
    return [BlockHash(os.urandom(32)) for _ in range(n)]


def test_register_gives_new_epochs_and_drops_old_records(redis_server: LocalRedis) -> None:
    async def body() -> None:
        async with make_index(redis_server) as index:
            chain = hashes(8)
            first = await index.register(node("p0"), IDLE)
            await index.publish(NodeId("p0"), first, [BlockStored(tuple(chain), None)])
            assert await index.lookup(chain) == {"p0": 8}
            second = await index.register(node("p0"), IDLE)  # the node restarted: its old cache is gone
            assert second == first + 1
            assert await index.lookup(chain) == {}
            with pytest.raises(StaleEpoch, match=f"epoch {first} is stale, the current epoch is {second}"):
                await index.publish(NodeId("p0"), first, [BlockStored(tuple(chain), None)])
            with pytest.raises(StaleEpoch):
                await index.heartbeat(node("p0"), NodeLoad(0, 0, 0, 10, 0), first)
            [status] = await index.nodes()
            assert status.info.epoch == second and status.blocks_indexed == 0
            assert await index._redis.exists(f"{index.config.prefix}blk:p0:{first}") == 0

    run(body())


@pytest.mark.parametrize(
    ("other", "field", "mine", "recorded"),
    [
        (node("x", fingerprint="cd" * 32), "model_fingerprint", "cd" * 32, FP),
        (node("x", head_dim=128), "kv_layout.head_dim", "128", "64"),
        (node("x", dtype="bfloat16"), "kv_layout.dtype", "bfloat16", "float32"),
        (node("x", protocol=2), "protocol_version", "2", "1"),
    ],
)
def test_incompatible_node_is_refused_naming_the_field(
    redis_server: LocalRedis, other: NodeInfo, field: str, mine: str, recorded: str
) -> None:
    async def body() -> None:
        async with make_index(redis_server) as index:
            await index.register(node("p0"), IDLE)
            with pytest.raises(IncompatibleNode) as err:
                await index.register(other, IDLE)
            assert f"{field} is {mine} on the node but {recorded}" in str(err.value)
            if field.startswith("kv_layout."):  # one line naming both layouts
                assert "\n" not in str(err.value)
                assert f"node: {other.kv_layout.describe()}; live nodes: {LAYOUT.describe()}" in str(
                    err.value
                )
            assert [s.info.node_id for s in await index.nodes()] == ["p0"]

    run(body())


def test_nodes_of_other_tensor_parallel_sizes_join_one_cluster(redis_server: LocalRedis) -> None:
    """Blocks travel in the model's full head layout, so the TP size is stated, not compared."""

    async def body() -> None:
        async with make_index(redis_server) as index:
            await index.register(node("p0"), IDLE)
            await index.register(node("d0", "decode", tp_size=3), IDLE)
            sizes = {s.info.node_id: s.info.kv_layout.tp_size for s in await index.nodes()}
            assert sizes == {"p0": 1, "d0": 3}

    run(body())


def test_node_with_another_credential_is_refused_without_showing_the_token(redis_server: LocalRedis) -> None:
    async def body() -> None:
        async with make_index(redis_server) as index:
            await index.register(node("p0"), IDLE)
            other = credential_digest("another-token")
            with pytest.raises(IncompatibleNode) as err:
                await index.register(node("d0", "decode", credential=other), IDLE)
            message = str(err.value)
            assert "credential mismatch" in message and other[:12] in message and CRED[:12] in message
            assert other not in message and "another-token" not in message
            assert [s.info.node_id for s in await index.nodes()] == ["p0"]

    run(body())


def test_registering_again_gives_a_newer_epoch_and_keeps_draining(redis_server: LocalRedis) -> None:
    """What a node does when Redis restarted empty: its epoch counter is gone, so the node names the epoch
    it had; a draining node registers as draining in the same step (its first, signed heartbeat)."""

    async def body() -> None:
        async with make_index(redis_server) as index:
            assert await index.register(node("d0", "decode"), IDLE, after_epoch=7) == 8
            assert await index.register(node("d0", "decode"), DRAINING, after_epoch=3) == 9
            (status,) = await index.nodes()
            assert status.draining and status.info.epoch == 9

    run(body())


def test_a_node_with_another_tokenizer_is_refused(redis_server: LocalRedis) -> None:
    async def body() -> None:
        async with make_index(redis_server) as index:
            await index.register(dataclasses.replace(node("p0"), tokenizer_fingerprint="11" * 32), IDLE)
            with pytest.raises(IncompatibleNode) as err:
                await index.register(dataclasses.replace(node("p1"), tokenizer_fingerprint="22" * 32), IDLE)
            assert f"tokenizer_fingerprint is {'22' * 32} on the node but {'11' * 32}" in str(err.value)
            await index.register(
                node("p2"), IDLE
            )  # a node that predates tokenizer fingerprints is not compared on it
            assert [s.info.node_id for s in await index.nodes()] == ["p0", "p2"]

    run(body())


def test_cluster_record_is_rebound_once_no_node_is_live(redis_server: LocalRedis) -> None:
    async def body() -> None:
        async with make_index(redis_server, heartbeat_ttl_s=0.2) as index:
            await index.register(node("p0"), IDLE)
            with pytest.raises(IncompatibleNode):
                await index.register(node("p1", head_dim=128), IDLE)
            await asyncio.sleep(0.3)
            await index.register(node("p1", head_dim=128), IDLE)
            assert (await index.cluster_record())["kv_layout.head_dim"] == "128"

    run(body())


def test_heartbeat_expiry_makes_a_node_stop_counting(redis_server: LocalRedis) -> None:
    async def body() -> None:
        async with make_index(redis_server, heartbeat_ttl_s=0.3) as index:
            chain = hashes(4)
            epochs = {n: await index.register(node(n), IDLE) for n in ("a", "b")}
            for n, e in epochs.items():
                await index.publish(NodeId(n), e, [BlockStored(tuple(chain), None)])
            load = NodeLoad(running=2, waiting=1, kv_used_blocks=5, kv_total_blocks=100, blocks_held=4)
            for _ in range(3):  # b keeps beating, a goes silent
                await asyncio.sleep(0.15)
                await index.heartbeat(node("b"), load, epochs["b"])
            assert await index.lookup(chain) == {"b": 4}
            [status] = await index.nodes()
            assert status.info.node_id == "b" and status.load == load and status.heartbeat_age_s < 0.2
            await index.heartbeat(
                node("a"), load, epochs["a"]
            )  # a came back without restarting: its records count again
            assert await index.lookup(chain) == {"a": 4, "b": 4}

    run(body())


def test_lookup_longest_contiguous_prefix_per_node(redis_server: LocalRedis) -> None:
    async def body() -> None:
        async with make_index(redis_server) as index:
            chain = hashes(3000)  # longer than the script's largest chunk (1024)
            roles: dict[str, Role] = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
            e = {n: await index.register(node(n, role), IDLE) for n, role in roles.items()}
            await index.publish(NodeId("p0"), e["p0"], [BlockStored(tuple(chain), None)])
            # a hole at block 5, held again after it: only blocks 0..4 count
            await index.publish(NodeId("p1"), e["p1"], [BlockStored(tuple(chain[:5] + chain[6:40]), None)])
            # stored then removed in one batch, in order: blocks 0..99 stored, 17 removed
            await index.publish(NodeId("d0"), e["d0"], [BlockStored(tuple(chain[:100]), None),
                                                        BlockRemoved((chain[17],))])  # fmt: skip
            await index.publish(NodeId("d1"), e["d1"], [BlockStored(tuple(chain[1:50]), None)])  # no block 0
            assert await index.lookup(chain) == {"p0": 3000, "p1": 5, "d0": 17}
            assert await index.lookup(chain[:1]) == {"p0": 1, "p1": 1, "d0": 1}
            assert await index.lookup(chain[1:]) == {"p0": 2999, "p1": 4, "d0": 16, "d1": 49}
            assert await index.lookup(hashes(3)) == {}
            assert await index.lookup([]) == {}
            await index.publish(NodeId("p0"), e["p0"], [BlockRemoved(tuple(chain[1024:1025]))])
            assert (await index.lookup(chain))[NodeId("p0")] == 1024
            blocks = await index.blocks(limit=3)
            assert {n: b.count for n, b in blocks.items()} == {"p0": 2999, "p1": 39, "d0": 99, "d1": 49}
            assert len(blocks[NodeId("p0")].hashes) == 3 and set(blocks[NodeId("p0")].hashes) <= set(chain)

    run(body())


def test_lookup_is_one_evalsha_whatever_the_prompt_length(redis_server: LocalRedis) -> None:
    async def body() -> None:
        async with make_index(redis_server) as index:
            chain = hashes(512)
            for n in ("p0", "p1", "d0"):
                epoch = await index.register(node(n), IDLE)
                await index.publish(NodeId(n), epoch, [BlockStored(tuple(chain[:300]), None)])
            await index.lookup(chain)  # loads the script
            await index._redis.config_resetstat()
            assert await index.lookup(chain) == {"p0": 300, "p1": 300, "d0": 300}
            stats = await index._redis.info("commandstats")
            # commandstats also counts the commands the script runs inside Redis: only those may appear
            inside = {"cmdstat_smembers", "cmdstat_mget", "cmdstat_sismember", "cmdstat_smismember"}
            assert set(stats) - inside == {"cmdstat_evalsha", "cmdstat_config|resetstat"}
            assert stats["cmdstat_evalsha"]["calls"] == 1 and stats["cmdstat_smembers"]["calls"] == 1

    run(body())


def test_block_pool_events_feed_the_index(redis_server: LocalRedis) -> None:
    """The real pool's Stored/Removed events, published as drained, keep the index equal to the pool."""

    async def body() -> None:
        async with make_index(redis_server) as index:
            epoch = await index.register(node("p0"), IDLE)
            pool = BlockPool(num_blocks=6, block_size=4)
            seed = hash_seed(bytes.fromhex(FP), None)
            tokens_a, tokens_b = list(range(16)), list(range(100, 116))
            for tokens in (tokens_a, tokens_b):  # the second prompt evicts the first one's blocks
                chain = hash_blocks(tokens, 4, seed)
                ids = pool.allocate(4)
                parent = None
                for block_id, h in zip(ids, chain, strict=True):
                    pool.commit(BlockId(block_id), h, parent)
                    parent = h
                pool.release(ids[::-1])
                await index.publish(NodeId("p0"), epoch, pool.drain_events())
            chain_a, chain_b = hash_blocks(tokens_a, 4, seed), hash_blocks(tokens_b, 4, seed)
            assert await index.lookup(chain_b) == {"p0": 4}
            assert await index.lookup(chain_a) == {"p0": len(pool.match_prefix(chain_a))}
            assert sorted((await index.blocks(limit=100))[NodeId("p0")].hashes) == sorted(pool.held_hashes())
            pool.evict(None)
            await index.publish(NodeId("p0"), epoch, pool.drain_events())
            assert await index.lookup(chain_b) == {}

    run(body())


def test_a_pool_with_a_host_tier_feeds_the_index_its_tiers(redis_server: LocalRedis) -> None:
    """Evicted blocks that move to the host tier stay the node's records and join its host list; restored
    ones leave the list; blocks the tier drops leave both; a resync lists both tiers."""

    async def body() -> None:
        async with make_index(redis_server) as index:
            epoch = await index.register(node("p9"), IDLE)
            pool = BlockPool(num_blocks=4, block_size=4, host_blocks=3)
            seed = hash_seed(bytes.fromhex(FP), None)
            chains = [hash_blocks(list(range(k, k + 16)), 4, seed) for k in (0, 100, 200)]
            for chain in chains:  # each prompt pushes the previous one to the host tier
                ids = pool.allocate(4)
                for i, (block_id, h) in enumerate(zip(ids, chain, strict=True)):
                    pool.commit(BlockId(block_id), h, chain[i - 1] if i else None)
                pool.release(ids[::-1])
                pool.take_copies()
                await index.publish(NodeId("p9"), epoch, pool.drain_events())
            host = set(pool.host_hashes())
            assert len(host) == 3 and await index.lookup(chains[2]) == {"p9": 4}
            recorded = (await index.blocks(NodeId("p9"), limit=100))[NodeId("p9")]
            assert set(recorded.hashes) == set(pool.held_hashes()) and recorded.host == 3
            flags = await index.host_tier(NodeId("p9"), epoch, chains[1])
            assert flags == [h in host for h in chains[1]]
            restored = pool.restore(chains[1])
            pool.take_copies()
            await index.publish(NodeId("p9"), epoch, pool.drain_events())
            assert restored > 0 and (await index.blocks(NodeId("p9")))[NodeId("p9")].host == len(
                pool.host_hashes()
            )
            await index.resync(NodeId("p9"), epoch, pool.held_hashes(), pool.host_hashes())
            assert sum(await index.host_tier(NodeId("p9"), epoch, pool.held_hashes())) == len(
                pool.host_hashes()
            )

    run(body())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(held=st.lists(st.sets(st.integers(0, 39), max_size=40), min_size=1, max_size=4))
def test_lookup_matches_a_reference_walk(redis_server: LocalRedis, held: list[set[int]]) -> None:
    async def body() -> None:
        async with make_index(redis_server) as index:
            chain = hashes(40)
            expected = {}
            for i, blocks in enumerate(held):
                epoch = await index.register(node(f"n{i}"), IDLE)
                stored = tuple(chain[b] for b in sorted(blocks))
                await index.publish(NodeId(f"n{i}"), epoch, [BlockStored(stored, None)] if stored else [])
                run_length = next(k for k in range(41) if k == 40 or k not in blocks)
                if run_length:
                    expected[f"n{i}"] = run_length
            assert await index.lookup(chain) == expected

    run(body())


def test_draining_deregister_resync_and_evict_records(redis_server: LocalRedis) -> None:
    async def body() -> None:
        async with make_index(redis_server) as index:
            chain = hashes(10)
            epoch = await index.register(node("d0", "decode"), IDLE)
            await index.publish(NodeId("d0"), epoch, [BlockStored(tuple(chain), None)])
            await index.heartbeat(node("d0", "decode"), DRAINING, epoch)  # the node's own, signed
            assert [s.draining for s in await index.nodes()] == [True]
            with pytest.raises(NodeNotRegistered, match="'ghost'"):
                await index.heartbeat(node("ghost"), IDLE, 1)
            assert await index.evict_records(NodeId("d0"), chain[3:4]) == 1
            assert await index.lookup(chain) == {"d0": 3}
            assert await index.resync(NodeId("d0"), epoch, chain[:7]) == 7
            assert await index.lookup(chain) == {"d0": 7}
            assert await index.evict_records(NodeId("d0")) == 7
            assert await index.lookup(chain) == {}
            assert await index.deregister(NodeId("d0")) is True
            assert await index.nodes() == [] and await index.deregister(NodeId("d0")) is False
            with pytest.raises(NodeNotRegistered):
                await index.heartbeat(node("d0", "decode"), NodeLoad(0, 0, 0, 1, 0), epoch)
            with pytest.raises(NodeNotRegistered):
                await index.publish(NodeId("d0"), epoch, [])

    run(body())


def test_hit_stats_accumulate_per_node(redis_server: LocalRedis) -> None:
    async def body() -> None:
        async with make_index(redis_server) as index:
            await index.record_hits(NodeId("p0"), 32, 0, 100)
            await index.record_hits(NodeId("p0"), 16, 64, 4)
            await index.record_hits(NodeId("p1"), 0, 0, 7)
            stats = await index.stats()
            assert (stats[NodeId("p0")].local_tokens, stats[NodeId("p0")].remote_tokens) == (48, 64)
            assert stats[NodeId("p0")].miss_tokens == 104 and stats[NodeId("p1")].total_tokens == 7

    run(body())


def test_auth_wrong_or_missing_password_fails_clearly() -> None:
    async def body(server: LocalRedis) -> None:
        async with BlockIndex(RedisConfig(url=server.url, password="s3cret"), KEYS) as index:
            assert await index.register(node("p0"), IDLE) == 1
        async with BlockIndex(RedisConfig(url=f"redis://:s3cret@127.0.0.1:{server.port}/0"), KEYS) as index:
            assert [s.info.node_id for s in await index.nodes()] == ["p0"]
        for password in ("wrong", None):
            async with BlockIndex(RedisConfig(url=server.url, password=password), KEYS) as index:
                with pytest.raises(
                    IndexAuthError, match=f"Redis at redis://127.0.0.1:{server.port}/0 refused"
                ):
                    await index.lookup(hashes(2))

    with LocalRedis(password="s3cret") as server:
        run(body(server))


def test_free_port_is_below_the_ephemeral_range_and_never_repeats() -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(10000 <= p < low for p in ports), ports


def test_local_redis_moves_to_a_fresh_port_when_its_free_port_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """free_port() can race with another socket; a listener that is not Redis never counts as started."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken, free_port()])
        monkeypatch.setattr(block_index_server, "free_port", lambda: next(ports))
        with LocalRedis() as server:
            assert server.port != taken
            assert (
                subprocess.run(
                    ["redis-cli", "-p", str(server.port), "ping"], capture_output=True
                ).stdout.strip()
                == b"PONG"
            )
        with pytest.raises(RuntimeError, match=f"port {taken} exited at start: .*in use"):
            LocalRedis(port=taken).start()


def test_unreachable_redis_raises_index_unavailable_fast() -> None:
    async def body() -> None:
        async with BlockIndex(RedisConfig(host="127.0.0.1", port=free_port()), KEYS) as index:
            started = time.monotonic()
            with pytest.raises(IndexUnavailable, match="is unreachable during lookup"):
                await index.lookup(hashes(2))
            assert time.monotonic() - started < 2.0

    run(body())


def test_tls_with_the_servers_ca_works_and_without_it_fails(tmp_path: Any) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    openssl = [
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(cert),
    ]
    openssl += ["-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(openssl, check=True, capture_output=True)

    async def body(url: str, port: int) -> None:
        async with BlockIndex(RedisConfig(url=url, tls_ca_file=str(cert)), KEYS) as index:
            assert await index.register(node("p0"), IDLE) == 1
        async with BlockIndex(RedisConfig(port=port, tls=True, tls_ca_file=str(cert)), KEYS) as index:
            assert [s.info.node_id for s in await index.nodes()] == ["p0"]
        async with BlockIndex(
            RedisConfig(url=url), KEYS
        ) as index:  # system CAs only: the self-signed cert fails
            with pytest.raises(IndexUnavailable, match="certificate verify failed"):
                await index.nodes()

    with LocalRedis(tls_cert_file=str(cert), tls_key_file=str(key)) as server:
        assert server.url.startswith("rediss://")
        run(body(server.url, server.port))


_POOL = [BlockHash(bytes([i]) * 32) for i in range(12)]
_OPS = st.lists(
    st.tuples(st.sampled_from("SRCE"), st.lists(st.sampled_from(_POOL), max_size=6)), min_size=1, max_size=12
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_digest_follows_every_write_of_the_records(redis_server: LocalRedis, ops: list[Any]) -> None:
    """Stored (repeats included), Removed (absent hashes included), a resync's clear, evict_records: after
    each, the index's digest is the digest of its records, and equals the node's fold of the same set."""

    async def body() -> None:
        async with make_index(redis_server) as index:
            nid = NodeId("n0")
            epoch = await index.register(node("n0"), IDLE)
            truth: set[BlockHash] = set()
            for op, chosen in ops:
                if op == "S":
                    await index.publish(nid, epoch, [BlockStored(tuple(chosen), None)])
                    truth |= set(chosen)
                elif op == "R":
                    await index.publish(nid, epoch, [BlockRemoved(tuple(chosen))])
                    truth -= set(chosen)
                elif op == "C":
                    await index.resync(nid, epoch, chosen)
                    truth = set(chosen)
                else:
                    await index.evict_records(nid, chosen or None)
                    truth = truth - set(chosen) if chosen else set()
                assert await index.records(nid, epoch) == truth
                assert await index.digest(nid, epoch) == BlocksDigest.of(sorted(truth))
            await index.rebuild_digest(nid, epoch)
            assert await index.digest(nid, epoch) == BlocksDigest.of(list(truth))

    run(body())


def test_a_cancelled_call_is_never_left_running(redis_server: LocalRedis) -> None:
    """A task cancelled while the index talks to Redis ends with CancelledError, whenever the cancel lands
    (redis-py's send path loses one that lands as the send completes, on Python 3.11; the router's stop
    then waited for its refresh loop forever)."""

    async def scenario() -> None:
        index = make_index(redis_server)

        async def poll() -> None:
            while True:
                await index.nodes()

        try:
            for i in range(200):
                task = asyncio.ensure_future(poll())
                await asyncio.sleep((i % 20) * 0.0005)
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=5)
                assert done, f"round {i}: the cancelled task still runs"
                assert task.cancelled()
        finally:
            await index.close()

    run(scenario())


def test_records_that_do_not_verify_are_listed_as_invalid_never_raised(redis_server: LocalRedis) -> None:
    """Issue 32: a copy of a node's record under another id, a malformed record, an unsigned drain flag and a
    forged load: `listing()` keeps the signed node, lists the rest as invalid, and raises for none."""

    async def body() -> None:
        async with make_index(redis_server) as index:
            epoch = await index.register(node("d0", "decode"), IDLE)
            r, p = index._redis, index.config.prefix
            real = cast(dict[bytes, bytes], await r.hgetall(f"{p}node:d0"))
            copy = {**real, b"info": real[b"info"].replace(b'"d0"', b'"d9"')}
            for field_name, value in copy.items():
                await r.hset(f"{p}node:d9", field_name, value)
            await r.hset(f"{p}node:bad", mapping={"info": "{", "epoch": "1", "load": "", "sig": "zz"})
            for rogue, e in (("d9", epoch), ("bad", 1)):
                await r.sadd(f"{p}nodes", rogue)
                await r.set(f"{p}alive:{rogue}", e)
            await r.hset(f"{p}node:d0", "draining", "1")  # unsigned: never read
            listing = await index.listing()
            assert [(s.info.node_id, s.draining) for s in listing.live] == [("d0", False)]
            assert [(bad.node_id, "signature" in bad.reason or "missing" in bad.reason)
                    for bad in listing.invalid] == [("bad", True), ("d9", True)]  # fmt: skip
            await r.hset(f"{p}node:d0", "load", DRAINING.to_json())  # a forged load: invalid until a beat
            assert [bad.node_id for bad in (await index.listing()).invalid] == ["bad", "d0", "d9"]
            await index.heartbeat(node("d0", "decode"), IDLE, epoch)  # the node's next beat restores it
            assert [s.draining for s in await index.nodes()] == [False]
            other = BlockIndex(index.config, ClusterKeys("another-token"))
            assert [bad.node_id for bad in (await other.listing()).invalid] == ["bad", "d0", "d9"]
            await other.close()

    run(body())


def test_the_documented_least_privilege_acl_user_runs_the_index(redis_server: LocalRedis) -> None:
    """docs/deploy.md's ACL user (its command list read from the doc) is enough for everything the nodes,
    routers and kvctl do, and is refused outside the cluster's keys."""
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "deploy.md")) as f:
        doc = f.read()
    acl = doc.split("ACL SETUSER ", 1)[1].split("\n```", 1)[0].replace("\\\n", " ").split()
    cluster = f"acl{next(_clusters)}"
    rules = [
        r.replace("{default}", "{" + cluster + "}").replace("${PDSERVE_REDIS_PASSWORD}", "pw") for r in acl
    ]

    async def body() -> None:
        admin = redis.asyncio.Redis.from_url(redis_server.url)
        await admin.execute_command("ACL", "SETUSER", *rules)
        config = RedisConfig(url=redis_server.url, cluster=cluster, username="pdserve", password="pw")
        async with BlockIndex(config, KEYS) as index:
            chain = hashes(4)
            epoch = await index.register(node("p0"), IDLE)
            await index.publish(NodeId("p0"), epoch, [BlockStored(tuple(chain), None)])
            await index.publish(NodeId("p0"), epoch, [BlockTiered(tuple(chain[:1]), "host")])
            await index.heartbeat(node("p0"), IDLE, epoch)
            assert await index.lookup(chain) == {"p0": 4}
            assert (await index.blocks())[NodeId("p0")].count == 4
            assert await index.resync(NodeId("p0"), epoch, chain[:2], chain[:1]) == 2
            assert (await index.digest(NodeId("p0"), epoch)).count == 2
            await index.record_hits(NodeId("p0"), 1, 2, 3)
            assert (await index.stats())[NodeId("p0")].total_tokens == 6
            assert await index.evict_records(NodeId("p0")) == 2
            assert await index.deregister(NodeId("p0"))
            with pytest.raises(redis.exceptions.NoPermissionError):
                await index._redis.get("not-the-cluster's-key")
        await admin.aclose()

    run(body())


def test_more_calls_at_once_than_connections_wait_for_one(redis_server: LocalRedis) -> None:
    """redis-py's pool fails a call at once ("Too many connections") when every connection is busy; a burst
    of lookups larger than the pool must wait for a connection, not report the index unavailable (the
    router would route load-only)."""

    async def scenario() -> None:
        async with make_index(redis_server, max_connections=2) as index:
            hashes = [BlockHash(bytes([i]) * 32) for i in range(64)]
            answers = await asyncio.gather(*(index.lookup(hashes) for _ in range(50)))
            assert answers == [{}] * 50

    asyncio.run(scenario())
