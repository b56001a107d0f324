"""The bytes of the host-memory KV tier: one host tensor shaped like the device cache (pinned memory when the
cache is on a GPU, so copies run at the link's speed; plain memory on the CPU build, a second, slower pool)
and the copies the block pool queues (block_pool.CopyOp), run in queue order.

Invariant: `run` finishes every copy before it returns (device reads are complete when the next forward or
transfer writes those blocks, and a host slot is written only by copies queued after its last read).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pdserve.shared.engine.block_pool import CopyOp


class HostTierCopier:
    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        # kv_cache: [L, 2, N, B, Hkv, D]; host: [L, 2, num_slots, B, Hkv, D]
        self.kv = kv_cache
        shape = (*kv_cache.shape[:2], num_slots, *kv_cache.shape[3:])
        self.host = torch.empty(shape, dtype=kv_cache.dtype, pin_memory=kv_cache.is_cuda)
        self.offloaded = 0
        self.restored = 0

    def run(self, ops: Sequence[CopyOp]) -> None:
        """Runs `ops` in order, batching consecutive copies of one direction that touch distinct blocks
        and slots (a slot or block seen twice starts a new batch, so the later copy wins)."""
        batch: list[CopyOp] = []
        for op in ops:
            if batch and (
                op.to_host != batch[0].to_host
                or any(op.slot == b.slot or op.block_id == b.block_id for b in batch)
            ):
                self._copy(batch)
                batch = []
            batch.append(op)
        if batch:
            self._copy(batch)

    def _copy(self, batch: list[CopyOp]) -> None:
        slots = torch.tensor([op.slot for op in batch], dtype=torch.int64)
        ids = torch.tensor([op.block_id for op in batch], dtype=torch.int64, device=self.kv.device)
        if batch[0].to_host:
            # [L, 2, n, B, Hkv, D] gathered on the device, then one copy to the host
            self.host.index_copy_(2, slots, self.kv.index_select(2, ids).to("cpu"))
            self.offloaded += len(batch)
        else:
            src = self.host.index_select(2, slots)
            if self.kv.is_cuda:
                src = src.pin_memory()
            self.kv.index_copy_(2, ids, src.to(self.kv.device, non_blocking=True))
            if self.kv.is_cuda:
                torch.cuda.current_stream(self.kv.device).synchronize()
            self.restored += len(batch)
