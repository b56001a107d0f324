"""Plain data and errors of the KV-transfer protocol, shared by the wire codec, the connectors and the nodes.

Invariants: every value here is immutable and validated at construction, so a decoded peer message that
builds one is already range-checked. Block index i of a transfer is the i-th block of the prompt; blocks
0..num_held_blocks-1 are the ones D already held, block i >= num_held_blocks lands in
dst_block_ids[i - num_held_blocks].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pdserve.shared.types import BlockId, KVLayout, NodeId, RequestId

DTYPES: dict[str, torch.dtype] = {  # the torch dtype of each of KV_DTYPE_BYTES's names
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class PeerIdentity:
    """What one end states in the handshake: who it is, which model, which cache layout."""

    node_id: NodeId
    fingerprint: bytes
    layout: KVLayout


@dataclass(frozen=True)
class OpenReply:
    """D's answer to OPEN: it holds the first `num_held_blocks` blocks; the rest go to `dst_block_ids`."""

    num_held_blocks: int
    dst_block_ids: tuple[BlockId, ...]

    def __post_init__(self) -> None:
        if self.num_held_blocks < 0:
            raise ValueError(f"num_held_blocks must be >= 0, got {self.num_held_blocks}")
        if len(set(self.dst_block_ids)) != len(self.dst_block_ids):
            raise ValueError(f"dst_block_ids has duplicates: {self.dst_block_ids}")
        if any(b < 0 for b in self.dst_block_ids):
            raise ValueError(f"dst_block_ids must be >= 0, got {self.dst_block_ids}")

    @property
    def num_blocks(self) -> int:
        return self.num_held_blocks + len(self.dst_block_ids)

    def columns(self, indices: tuple[int, ...], dst: tuple[int, ...]) -> slice | list[int]:
        """Where a frame's blocks (transfer blocks `indices`, going to D's blocks `dst`) sit among the
        reserved ones (`dst_block_ids`): P checks its DATA against this before sending, D the DATA it got.
        Raises ValueError naming the first block the reservation does not have there."""
        n, reserved = len(indices), self.dst_block_ids
        j0 = indices[0] - self.num_held_blocks if n else -1
        # The usual frame names a run of consecutive blocks: one slice comparison checks it (reserved ids are
        # distinct, so equal destinations pin every index), and its columns are a slice.
        if j0 >= 0 and dst == reserved[j0 : j0 + n] and indices == tuple(range(indices[0], indices[0] + n)):
            return slice(j0, j0 + n)
        cols = []
        for index, d in zip(indices, dst, strict=True):
            j = index - self.num_held_blocks
            if not 0 <= j < len(reserved) or reserved[j] != d:
                raise ValueError(f"block {index} -> {d} is not in the reservation")
            cols.append(j)
        return cols


def check_layers(layer_start: int, num_layers: int, layout: KVLayout) -> None:
    """Raises ValueError unless layers [layer_start, layer_start + num_layers) are layers of the model."""
    if not 0 <= layer_start < layer_start + num_layers <= layout.num_layers:
        raise ValueError(f"layers {layer_start}+{num_layers} outside [0, {layout.num_layers})")


@dataclass(frozen=True)
class FrameBlocks:
    """The blocks of one DATA frame, as three columns (one object per frame, not one per block: a frame of a
    long prompt names thousands of blocks): block j of the frame's buffer is block `indices[j]` of the
    transfer (its position in the prompt), block `src[j]` of P's cache and block `dst[j]` of D's."""

    indices: tuple[int, ...]
    src: tuple[BlockId, ...]
    dst: tuple[BlockId, ...]

    def __post_init__(self) -> None:
        if not len(self.indices) == len(self.src) == len(self.dst):
            raise ValueError(
                f"FrameBlocks columns differ in length: {len(self.indices)}, {len(self.src)}, {len(self.dst)}"
            )

    def __len__(self) -> int:
        return len(self.indices)

    @classmethod
    def run(cls, reply: OpenReply, first: int, src: Sequence[BlockId]) -> FrameBlocks:
        """Blocks first, first + 1, ... of the transfer (none of them held by D), held on P at `src`, going
        to the blocks D reserved for them."""
        j = first - reply.num_held_blocks
        if j < 0 or j + len(src) > len(reply.dst_block_ids):
            raise ValueError(f"blocks {first}+{len(src)} are not all reserved by {reply}")
        return cls(tuple(range(first, first + len(src))), tuple(src), reply.dst_block_ids[j : j + len(src)])


@dataclass(frozen=True)
class TransferStats:
    """What P measured for one finished transfer; seconds run from the first DATA send to D's ACK."""

    transfer_id: RequestId
    payload_bytes: int
    seconds: float


class KVTransferError(Exception):
    """Base of every error this package raises."""


class HandshakeError(KVTransferError):
    """Connection refused; `code`: version|fingerprint|layout|auth|protocol|timeout; `detail`: why."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"handshake refused ({code}): {detail}")
        self.code = code
        self.detail = detail


class _TransferFailed(KVTransferError):
    """One transfer failed (`transfer_id`); `reason` says why, `outcome` how."""

    outcome = "failed"

    def __init__(self, transfer_id: str, reason: str) -> None:
        super().__init__(f"transfer {transfer_id!r} {self.outcome}: {reason}")
        self.transfer_id = transfer_id
        self.reason = reason


class TransferRefused(_TransferFailed):
    """D declined OPEN (no free blocks, unknown request, past deadline...); nothing is reserved."""

    outcome = "refused"


class TransferAborted(_TransferFailed):
    """The transfer ended without ACK; D has released (or will release) its reservation."""

    outcome = "aborted"


class OpenRefused(KVTransferError):
    """Raised by `TransferHandler.on_open` to refuse a transfer; `reason` goes back to P."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ProtocolError(KVTransferError):
    """The peer broke the wire protocol (bad frame, bad field, wrong state); the connection is closed."""


class ChecksumError(ProtocolError):
    """A frame's CRC32 did not match; `transfer_id` is the frame's transfer when its header still decodes."""

    def __init__(self, detail: str, transfer_id: str | None) -> None:
        super().__init__(detail)
        self.transfer_id = transfer_id


class ConnectionLost(KVTransferError):
    """The transport closed or failed under us."""
