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


SPLITS = {
    "tp1": (2, [0]),
    "tp2": (2, [0, 1]),
    "tp4-replicated": (2, [0, 0, 1, 1]),
    "tp2-one-head": (1, [0, 0]),
}
"""(the model's KV heads, each rank's first KV head) of each tensor-parallel split."""


def split(kv: torch.Tensor, starts: list[int]) -> tuple[list[RankPool], int]:
    """Each rank's pool holding its heads of kv [L, 2, N, B, H, D]; the heads per rank."""
    width = kv.shape[4] // len(set(starts))
    return [RankPool(kv[:, :, :, :, s : s + width].clone(), s) for s in starts], width


@pytest.mark.parametrize(("heads", "starts"), SPLITS.values(), ids=SPLITS.keys())
@settings(max_examples=100, deadline=None)
@given(ops=OPS)
def test_batched_copies_equal_one_by_one_copies(heads: int, starts: list[int], ops: list[CopyOp]) -> None:
    kv = torch.randn(3, 2, NUM_BLOCKS, 2, heads, 4)  # [L, 2, N, B, H, D]
    parts, width = split(kv, starts)
    copier = HostTierCopier(KVPools(parts, heads, get_ops(kv.device)), NUM_SLOTS)
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


@pytest.mark.parametrize(("heads", "starts"), SPLITS.values(), ids=SPLITS.keys())
def test_export_and_import_move_every_head_of_every_rank(heads: int, starts: list[int]) -> None:
    """The remote-KV port's copies (frames hold the model's heads in order) over split or replicated pools."""
    kv = torch.randn(3, 2, NUM_BLOCKS, 2, heads, 4)
    parts, width = split(kv, starts)
    pools = KVPools(parts, heads, get_ops(kv.device))
    ids = torch.tensor([4, 1, 3])
    out = torch.empty(2, 3, 2, heads, 4)  # [2, n, B, H, D]
    pools.gather(1, ids, out)
    assert torch.equal(out, kv[1][:, ids])
    frame = torch.randn(2, *out.shape)  # layers 1 and 2: [nl, 2, n, B, H, D]
    pools.scatter_layers(1, ids, frame)
    kv[1:3, :, ids] = frame
    for part in parts:  # every replica of a head got it
        assert torch.equal(part.kv, kv[:, :, :, :, part.head_start : part.head_start + width])
