"""KV events in vLLM's format from a real prefill node: a subscriber decoding with msgspec structs written
from vLLM's published schema (vllm/distributed/kv_events.py, array form) receives the blocks one request
stored and the ones a second request evicted, in order, under consecutive sequence numbers; the replay
socket refills a subscriber that joins late, from sequence 0 (the node's AllBlocksCleared) on."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import msgspec
import pytest
import zmq
from pdserve.shared.engine.block_hash import hash_blocks, hash_seed
from pdserve.shared.node.node_sign import signed
from pdserve.tests.harness.cluster_fixture import LiveCluster, served_model_name, up_config

pytestmark = pytest.mark.slow

ExternalBlockHash = bytes | int  # vLLM's alias


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
BLOCK = 16
POOL_BLOCKS = 12


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[LiveCluster, str, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        pub, replay = f"ipc://{os.path.join(tmp, 'kv')}", f"ipc://{os.path.join(tmp, 'replay')}"
        flags = ("--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay)
        small = ("--num-kv-blocks", str(POOL_BLOCKS), "--max-model-len", "176")
        with LiveCluster.start(
            up_config(extra_node_args=small, role_node_args=(("prefill", flags),))
        ) as live:
            yield live, pub, replay


def _complete(live: LiveCluster, prompt: list[int]) -> None:
    body = {"model": served_model_name(), "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx2.post(f"{live.base}/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text


def _int64(h: bytes) -> int:
    return int.from_bytes(h[:8], "big", signed=True)


def _receive(sub: zmq.Socket[bytes], until: int, timeout_s: float = 30.0) -> list[tuple[int, KVEventBatch]]:
    """Batches off the SUB socket until `until` BlockRemoved hashes came (or timeout_s passed)."""
    got: list[tuple[int, KVEventBatch]] = []
    deadline = time.monotonic() + timeout_s
    removed = 0
    while removed < until and time.monotonic() < deadline:
        if not sub.poll(100):
            continue
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"" and len(seq) == 8
        batch = DECODER.decode(payload)
        got.append((int.from_bytes(seq, "big"), batch))
        removed += sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockRemoved))
    return got


def test_stored_and_evicted_blocks_arrive_in_order_and_replay_refills(
    node: tuple[LiveCluster, str, str],
) -> None:
    live, pub, replay = node
    prefill = next(n for n in live.nodes if n.startswith("prefill"))
    reg = httpx2.get(
        f"{live.nodes[prefill].url}/internal/registration", auth=signed(live.auth_token), timeout=10
    )
    seed = hash_seed(bytes.fromhex(reg.json()["model_fingerprint"]), None)
    a = [100 + i for i in range(4 * BLOCK + 3)]  # 4 full blocks
    b = [5000 + i for i in range(9 * BLOCK + 6)]  # 10 blocks: the pool must evict 2 of a's 4
    a_hashes = hash_blocks(a, BLOCK, seed)
    b_hashes = hash_blocks(b, BLOCK, seed)

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub)
        time.sleep(0.5)  # a SUB misses what is published before its subscription reaches the PUB
        _complete(live, a)
        _complete(live, b)
        got = _receive(sub, until=2)
        seqs = [seq for seq, _ in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"sequence numbers not consecutive: {seqs}"
        events = [e for _, batch in got for e in batch.events]
        stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
        assert stored == [_int64(h) for h in a_hashes + b_hashes], "a's blocks, then b's, each once"
        first = next(e for e in events if isinstance(e, BlockStored))
        assert first.parent_block_hash is None and first.block_size == BLOCK and first.medium == "GPU"
        stored_tokens = [t for e in events if isinstance(e, BlockStored) for t in e.token_ids]
        assert stored_tokens == a[: 4 * BLOCK] + b[: 9 * BLOCK]
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert removed == [_int64(a_hashes[3]), _int64(a_hashes[2])], "a's chain tail is evicted first"
        kinds = [type(e).__name__ for e in events]
        assert kinds.index("BlockRemoved") > kinds.index("BlockStored"), kinds
        assert all(batch.data_parallel_rank == 0 for _, batch in got)

        late = ctx.socket(zmq.DEALER)
        late.connect(replay)
        late.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed: list[tuple[int, KVEventBatch]] = []
        while True:
            assert late.poll(10_000), "the replay socket did not answer"
            _, seq, payload = late.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            replayed.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        late.close(linger=0)
        assert [s for s, _ in replayed] == list(range(len(replayed)))
        assert isinstance(replayed[0][1].events[0], AllBlocksCleared), "the node's first batch clears"
        assert [(s, b.events) for s, b in replayed if s >= seqs[0]][: len(got)] == [
            (s, b.events) for s, b in got
        ], "the replay resends what the live subscriber got"
    finally:
        sub.close(linger=0)
        ctx.term()
