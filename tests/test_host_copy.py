"""The host tier's copier (shared/engine/host_copy.py) batches queued copies; whatever the order and overlap
of the ops, the device cache and the host slots end as if each copy ran alone, in queue order; with the KV
heads split over tensor-parallel ranks (or replicated on several), each rank's pool ends holding its heads
of that same cache, and the host slots hold whole blocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pdserve.kernels.ops import get_ops
from pdserve.shared.engine.block_pool import CopyOp
from pdserve.shared.engine.host_copy import HostTierCopier
from pdserve.shared.engine.parallel.kv_pools import KVPools, RankPool
from pdserve.shared.types import BlockId

NUM_BLOCKS, NUM_SLOTS = 6, 5
OPS = st.lists(
    st.builds(
        CopyOp, st.booleans(), st.integers(0, NUM_BLOCKS - 1).map(BlockId), st.integers(0, NUM_SLOTS - 1)
    ),
    max_size=30,
)


HEADS = 2
SPLITS = {"tp1": [0], "tp2": [0, 1], "tp4-replicated": [0, 0, 1, 1]}
"""Each rank's first KV head (of HEADS) at tensor-parallel sizes 1, 2 and 4."""


@pytest.mark.parametrize("starts", SPLITS.values(), ids=SPLITS.keys())
@settings(max_examples=100, deadline=None)
@given(ops=OPS)
def test_batched_copies_equal_one_by_one_copies(starts: list[int], ops: list[CopyOp]) -> None:
    kv = torch.randn(3, 2, NUM_BLOCKS, 2, HEADS, 4)  # [L, 2, N, B, H, D]
    width = HEADS // len(set(starts))
    parts = [RankPool(kv[:, :, :, :, s : s + width].clone(), s) for s in starts]
    copier = HostTierCopier(KVPools(parts, HEADS, get_ops(kv.device)), NUM_SLOTS)
    copier.host.copy_(torch.randn_like(copier.host))
    want_kv, want_host = kv.clone(), copier.host.clone()  # host: [slots, L, 2, B, H, D]
    for op in ops:
        if op.to_host:
            want_host[op.slot] = want_kv[:, :, op.block_id]
        else:
            want_kv[:, :, op.block_id] = want_host[op.slot]
    copier.run(ops)
    for part in parts:
        assert torch.equal(part.kv, want_kv[:, :, :, :, part.head_start : part.head_start + width])
    assert torch.equal(copier.host, want_host)
    assert copier.offloaded + copier.restored == len(ops)
