"""The bytes of the host-memory KV tier: one host tensor of slots (pinned memory when the cache is on a GPU,
so copies are DMA at the link's speed; plain memory on the CPU build, a second, slower pool) and the copies
the block pool queues (block_pool.CopyOp), run in queue order.

Layout: slot-major, `[num_slots, L, 2, B, H, D]` with every KV head of the model (a tensor-parallel node's
tier holds whole blocks, gathered from and scattered to every rank's pool through `KVPools`), so a run of
consecutive slots is one contiguous host range: a batch gathers its blocks on each rank's device and moves
them with one copy per distinct head range.
Invariant: copies are queued in order on the cache device's current stream, the stream every later forward
and fill of those blocks runs on (so a device block is read before it is overwritten, and a host slot is
written by a copy out only after the copies in queued before it have read it); the host bytes are read by
nothing but these copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pdserve.shared.engine.block_pool import CopyOp
from pdserve.shared.engine.parallel.kv_pools import KVPools


class HostTierCopier:
    def __init__(self, pools: KVPools, num_slots: int) -> None:
        # host: [num_slots, L, 2, B, H, D]
        self.pools = pools
        self.cuda = pools.device.type == "cuda"
        shape = (num_slots, pools.num_layers, 2, *pools.block_shape)
        self.host = torch.empty(shape, dtype=pools.dtype, pin_memory=self.cuda)
        self.offloaded = 0
        self.restored = 0

    def run(self, ops: Sequence[CopyOp]) -> None:
        """Runs `ops` in order, batching consecutive copies of one direction (a block or slot seen twice
        starts a new batch, so the later copy wins); a batch moves each run of consecutive slots at once."""
        batch: list[CopyOp] = []
        blocks: set[int] = set()
        slots: set[int] = set()
        for op in ops:
            if batch and (op.to_host != batch[0].to_host or op.block_id in blocks or op.slot in slots):
                self._copy(batch)
                batch, blocks, slots = [], set(), set()
            batch.append(op)
            blocks.add(op.block_id)
            slots.add(op.slot)
        if batch:
            self._copy(batch)

    def _copy(self, batch: list[CopyOp]) -> None:
        ordered = sorted(batch, key=lambda op: op.slot)  # distinct blocks and slots: order is free
        start = 0
        for i in range(1, len(ordered) + 1):
            if i == len(ordered) or ordered[i].slot != ordered[i - 1].slot + 1:
                self._copy_run(ordered[start:i])
                start = i

    def _copy_run(self, run: list[CopyOp]) -> None:
        s0, n = run[0].slot, len(run)
        ids = torch.tensor([op.block_id for op in run], dtype=torch.int64)
        host = self.host[s0 : s0 + n]  # [n, L, 2, B, H, D], contiguous
        if run[0].to_host:
            # gathered on each device into the host's layout, then one copy per rank (DMA from pinned memory)
            self.pools.read_blocks(ids, host)
            self.offloaded += n
        else:
            self.pools.write_blocks(ids, host)
            self.restored += n
