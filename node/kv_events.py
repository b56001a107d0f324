"""KV events in vLLM's wire format, for indexers that read vLLM nodes (llm-d, Dynamo): the block pool's
Stored/Removed events as msgpack `KVEventBatch`es on a ZMQ PUB socket, and a ROUTER socket that resends
the batches a late or lossy subscriber missed.

Wire (vLLM's `vllm/distributed/kv_events.py`, array form): each batch is the multipart message
[topic, seq, payload]: topic b"" by default, seq an 8-byte big-endian counter from 0, payload msgpack of
`[ts, events, data_parallel_rank]` with each event a tagged array: `["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]`, `["BlockRemoved", block_hashes,
medium]`, `["AllBlocksCleared"]`. Replay: a DEALER/REQ sends [b"", start seq (8 bytes big-endian)] and gets
[b"", seq, payload] for every buffered batch from start on, then [b"", -1 (8 bytes, signed), b""].
Block hashes: pdserve's are 32-byte SHA-256 chained hashes; "int64" (the default) sends each as its first 8
bytes read as a big-endian signed int64 (what 64-bit-hash indexers store), "bytes" sends the 32 bytes.

Invariants: sequence numbers are consecutive from 0 in publishing order and a batch is published once; the
first batch is AllBlocksCleared, so a subscriber drops what an earlier incarnation of the node told it; the
replay buffer holds the last `buffer_batches` batches; the sockets are used from the node's event loop only
and closed by `close()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgpack
import zmq
import zmq.asyncio
from pdserve.shared.engine.block_pool import BlockEvent, BlockRemoved, BlockStored
from pdserve.shared.types import BlockHash

log = logging.getLogger(__name__)

HashForm = Literal["int64", "bytes"]
MEDIUM = "GPU"
"""vLLM's medium of device blocks; pdserve publishes a hash held in either tier as held by the node."""
_END = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    endpoint: str
    """PUB address: bound when it has a wildcard (`tcp://*:5557`) or is ipc/inproc, else connected."""
    replay_endpoint: str | None = None
    """ROUTER address that replays missed batches (None: no replay)."""
    hash_form: HashForm = "int64"
    topic: str = ""
    buffer_batches: int = 10_000
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        if self.hash_form not in ("int64", "bytes"):
            raise ValueError(f"hash_form must be int64 or bytes, got {self.hash_form!r}")
        if self.buffer_batches < 1:
            raise ValueError(f"buffer_batches must be >= 1, got {self.buffer_batches}")


def external_hash(block_hash: BlockHash, form: HashForm) -> int | bytes:
    """A block hash as the events carry it (see the module docstring)."""
    return int.from_bytes(block_hash[:8], "big", signed=True) if form == "int64" else bytes(block_hash)


def encode_batch(
    events: Sequence[BlockEvent], block_size: int, form: HashForm, ts: float, rank: int, cleared: bool = False
) -> bytes | None:
    """One KVEventBatch payload (None when no event has a vLLM form: tier moves are not published)."""
    out: list[list[object]] = [["AllBlocksCleared"]] if cleared else []
    for event in events:
        if isinstance(event, BlockStored):
            hashes = [external_hash(h, form) for h in event.block_hashes]
            parent = None if event.parent_hash is None else external_hash(event.parent_hash, form)
            tokens = list(event.token_ids)
            out.append(["BlockStored", hashes, parent, tokens, block_size, None, MEDIUM, None])
        elif isinstance(event, BlockRemoved):
            out.append(["BlockRemoved", [external_hash(h, form) for h in event.block_hashes], MEDIUM])
    if not out:
        return None
    payload: bytes = msgpack.packb([ts, out, rank], use_bin_type=True)
    return payload


class KVEventsPublisher:
    """The node's publisher: `start()` in the event loop, `publish()` each drained batch, `close()`."""

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.asyncio.Socket | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_batches)
        self._seq = 0
        self._topic = config.topic.encode()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Binds (or connects) the sockets and publishes AllBlocksCleared; zmq.ZMQError when an address is
        taken or malformed."""
        endpoint = self.config.endpoint
        if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        if self.config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(self.config.replay_endpoint)
            self._task = asyncio.create_task(self._serve_replay(self._replay))
        self.publish([], cleared=True)

    def publish(self, events: Sequence[BlockEvent], cleared: bool = False) -> None:
        """Sends the events as one batch with the next sequence number (nothing when none has a vLLM form).
        Never blocks: past the PUB socket's high-water mark ZMQ drops, and the replay buffer still has it."""
        c = self.config
        payload = encode_batch(
            events, self.block_size, c.hash_form, time.time(), c.data_parallel_rank, cleared
        )
        if payload is None:
            return
        seq, self._seq = self._seq, self._seq + 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)

    async def _serve_replay(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events replay: malformed request of %d frames, ignored", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await sock.send_multipart((client, b"", _END, b""))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
