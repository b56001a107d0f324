"""The host tier's copier (shared/engine/host_copy.py) batches queued copies; whatever the order and overlap
of the ops, the device cache and the host slots end as if each copy ran alone, in queue order."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pdserve.shared.engine.block_pool import CopyOp
from pdserve.shared.engine.host_copy import HostTierCopier
from pdserve.shared.types import BlockId

NUM_BLOCKS, NUM_SLOTS = 6, 5
OPS = st.lists(
    st.builds(
        CopyOp, st.booleans(), st.integers(0, NUM_BLOCKS - 1).map(BlockId), st.integers(0, NUM_SLOTS - 1)
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_batched_copies_equal_one_by_one_copies(ops: list[CopyOp]) -> None:
    kv = torch.randn(3, 2, NUM_BLOCKS, 2, 1, 4)  # [L, 2, N, B, Hkv, D]
    copier = HostTierCopier(kv.clone(), NUM_SLOTS)
    copier.host.copy_(torch.randn_like(copier.host))
    want_kv, want_host = kv.clone(), copier.host.clone()  # host: [slots, L, 2, B, Hkv, D]
    for op in ops:
        if op.to_host:
            want_host[op.slot] = want_kv[:, :, op.block_id]
        else:
            want_kv[:, :, op.block_id] = want_host[op.slot]
    copier.kv.copy_(kv)
    copier.run(ops)
    assert torch.equal(copier.kv, want_kv) and torch.equal(copier.host, want_host)
    assert copier.offloaded + copier.restored == len(ops)
