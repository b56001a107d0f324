"""Rank 0's reach into every rank's KV pool, so that a node exports and imports blocks in the model's full
KV-head layout (the wire's: heads in the model's order) whatever its tensor-parallel size, and its host tier
holds whole blocks.

How the pools are shared: on the CPU rank 0 creates one memfd per worker before starting it; the worker
maps its pool from it (both ends size it to the agreed block count), so rank 0 maps the same pages. On CUDA
a worker allocates its pool on its own GPU and publishes the allocation's IPC handle in rank 0's store;
rank 0 opens it in its own GPU's context, which maps the worker's memory there with peer access (NVLink), so
the pool is a tensor of rank 0's device and a gather or scatter of a worker's heads is a kernel on rank 0's
GPU reading or writing the peer's memory. Nothing is launched on a worker's GPU from rank 0's process: two
processes' work on one GPU time-slices (no MPS), and with each layer's export there a P at TP=2 took ~300 ms
to prefill 4k tokens instead of ~75. Only GPUs without peer access open the pool as the worker's GPU memory
and move its heads with kernels and copies there.
Invariants: `parts` covers every KV head of the model; a head replicated on several ranks (fewer KV heads
than ranks) is read from the first rank that holds it and written to every rank that holds it; rank 0 only
reads blocks whose KV every rank has written (a layer hook runs after the layer's all-reduce, which no rank
reaches before writing that layer's KV) and only writes blocks no step reads (reserved blocks, or blocks a
host-tier copy brings back before the step that reads them is broadcast). A peer read is safe because it is
queued on rank 0's stream after that all-reduce, which completes on rank 0's GPU only after the worker's
stream has passed its KV write (stream order), and peer accesses are served by the owning GPU's memory
system, which holds those writes; writes into a worker's pool are waited for on the host before the call
returns, since that worker reads them on its own stream, which nothing in this process can order.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from pdserve.kernels.ops import AttentionOps


@dataclass(frozen=True)
class RankPool:
    """One rank's KV pool as rank 0 sees it: kv [L, 2, N, B, Hkv_r, D] holding the model's KV heads
    [head_start, head_start + Hkv_r)."""

    kv: torch.Tensor
    head_start: int

    @property
    def heads(self) -> int:
        return int(self.kv.shape[4])


class KVPools:
    """Every rank's pool, read and written in the full head layout: [2, n, B, H, D] per layer."""

    def __init__(self, parts: Sequence[RankPool], num_kv_heads: int, ops: AttentionOps) -> None:
        covered = sorted({(p.head_start, p.heads) for p in parts})
        starts = [s for s, _ in covered]
        assert starts == list(range(0, num_kv_heads, covered[0][1])), (covered, num_kv_heads)
        self.parts = tuple(parts)
        self.num_kv_heads = num_kv_heads
        self.ops = ops
        first: dict[int, RankPool] = {}
        for p in self.parts:
            first.setdefault(p.head_start, p)
        self._readers = tuple(first.values())  # one rank per distinct head range
        self.device = parts[0].kv.device
        self.dtype = parts[0].kv.dtype
        self.num_layers = int(parts[0].kv.shape[0])
        self.block_shape = (*parts[0].kv.shape[3:4], num_kv_heads, *parts[0].kv.shape[5:])  # (B, H, D)

    @property
    def whole(self) -> bool:
        """One pool (TP=1): the plain kernels copy straight between it and the buffer."""
        return len(self.parts) == 1

    def gather(self, layer: int, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copies `layer`'s KV of `block_ids` into out [2, n, B, H, D] (on rank 0's device)."""
        if self.whole:
            self.ops.gather_blocks(self._readers[0].kv[layer], block_ids, out)
            return
        for p in self._readers:
            # [2, N, B, Hkv_r, D words], [2, n, B, Hkv_r, D words]
            src, dst = _words(p.kv[layer], out[:, :, :, p.head_start : p.head_start + p.heads])
            _follow(out.device, src.device)
            dst.copy_(src.index_select(1, block_ids.to(src.device, torch.int64)), non_blocking=True)

    def scatter_layers(self, layer_start: int, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        """Writes src [nl, 2, n, B, H, D] (host or device; a transfer frame) into layers layer_start.. of
        blocks `block_ids` of every rank: one copy per rank for the whole frame, and one wait for the other
        ranks' GPUs, not one per layer."""
        layers = slice(layer_start, layer_start + int(src.shape[0]))
        if self.whole:
            kv = self._readers[0].kv
            self.ops.scatter_layers(src.to(kv.device), kv[layers], block_ids.to(kv.device))
            return
        for p in self.parts:
            heads = src[:, :, :, :, p.head_start : p.head_start + p.heads].to(p.kv.device, p.kv.dtype)
            dst, part = _words(p.kv[layers], heads)  # [nl, 2, N, B, Hkv_r, D words], [nl, 2, n, ...]
            dst.index_copy_(2, block_ids.to(dst.device, torch.int64), part)
        self._landed()

    def read_blocks(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Every layer of `block_ids` into out [n, L, 2, B, H, D] (the host tier's slot layout)."""
        for p in self._readers:
            _follow(self.device, p.kv.device)
            kv, heads = _words(p.kv, out[:, :, :, :, p.head_start : p.head_start + p.heads])
            src = kv.index_select(2, block_ids.to(p.kv.device, torch.int64))  # [L, 2, n, B, h, D words]
            heads.copy_(src.permute(2, 0, 1, 3, 4, 5), non_blocking=True)

    def write_blocks(self, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        """The inverse of read_blocks: src [n, L, 2, B, H, D] into every rank's blocks `block_ids`."""
        for p in self.parts:
            kv, heads = _words(p.kv, src[:, :, :, :, p.head_start : p.head_start + p.heads])
            dev = heads.to(p.kv.device, non_blocking=True).permute(1, 2, 0, 3, 4, 5)
            kv.index_copy_(2, block_ids.to(p.kv.device, torch.int64), dev)
        self._landed()

    def _landed(self) -> None:
        """Waits until the writes queued into the other ranks' pools are done: those ranks read the blocks on
        their own streams, which nothing in this process can order after ours (rank 0's own writes are
        ordered on its stream, as at TP=1). A peer-mapped pool's writes are on rank 0's stream."""
        for device in {p.kv.device for p in self.parts[1:] if p.kv.device.type == "cuda"}:
            torch.cuda.current_stream(device).synchronize()


def _words(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """`tensors` as one integer dtype (the last dim in words): the copies move bytes whatever the KV dtype
    (torch's CPU index_copy_ / index_select have no float8 kernels), as the widest word that every tensor's
    rows, offset and strides allow, so a GPU index kernel walks 8x fewer elements than bytes (int64 for
    any head of 8 bytes' multiple)."""
    raw = [t.view(torch.uint8) for t in tensors]
    for word in (torch.int64, torch.int32, torch.int16):
        size = word.itemsize
        if all(
            r.shape[-1] % size == 0
            and r.storage_offset() % size == 0
            and all(n % size == 0 for n in r.stride()[:-1])
            for r in raw
        ):
            return [r.view(word) for r in raw]
    return raw


def _follow(first: torch.device, then: torch.device) -> None:
    """Work queued next on `then`'s current stream starts after what `first`'s current stream holds now (a
    worker's pool is read after rank 0's all-reduce of the layer, which every rank reaches only after
    writing that layer's KV). Nothing to order on the CPU or on one device."""
    if first != then and first.type == "cuda" and then.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(first))
        torch.cuda.current_stream(then).wait_event(event)


def pool_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def map_shared_pool(fd: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU pool of `shape` on memfd `fd`, mapped shared: rank 0 and the worker that owns it call this
    with the same fd's file and shape (each sizes the file alike, so the order does not matter), and see
    the same pages. Pages are committed on first write, as a rank's own pool."""
    nbytes = pool_bytes(shape, dtype)
    os.ftruncate(fd, nbytes)
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    return torch.frombuffer(mapping, dtype=dtype).view(tuple(shape))  # the tensor keeps the mapping


def pool_key(rank: int) -> str:
    """The store key under which a CUDA worker publishes its pool's IPC handle."""
    return f"pdserve-tp/kv/{rank}"


def publish_cuda_pool(store: dist.Store, rank: int, kv: torch.Tensor) -> None:
    """A CUDA worker's side: its pool's allocation as torch shares it between processes (hex in JSON)."""
    device, handle, size, offset, rc, rc_offset, event, event_sync = kv.untyped_storage()._share_cuda_()
    record = {
        "device": int(device), "handle": bytes(handle).hex(), "size": int(size), "offset": int(offset),
        "rc": bytes(rc).hex(), "rc_offset": int(rc_offset), "event": bytes(event or b"").hex(),
        "event_sync": bool(event_sync), "storage_offset": kv.storage_offset(),
    }  # fmt: skip
    store.set(pool_key(rank), json.dumps(record))


def open_cuda_pool(
    store: dist.Store,
    rank: int,
    here: torch.device,
    owner: torch.device,
    shape: Sequence[int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rank 0's side: rank `rank`'s pool, allocated on `owner`, as a tensor of rank 0's device `here` when
    `here` can reach `owner` as a peer (the IPC open in `here`'s context maps the memory there and enables
    peer access, cudaIpcMemLazyEnablePeerAccess, so kernels on `here` read and write it over NVLink; torch's
    are what KVPools runs on it, Triton's were refused a pool opened on `owner`); else as memory of `owner`,
    which this process then reaches with work queued on `owner`."""
    r = json.loads(store.get(pool_key(rank)))
    assert r["device"] == owner.index, f"rank {rank} published a pool on cuda:{r['device']}, not {owner}"
    device = here if here == owner or torch.cuda.can_device_access_peer(here, owner) else owner
    with torch.cuda.device(device):
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index, bytes.fromhex(r["handle"]), r["size"], r["offset"], bytes.fromhex(r["rc"]),
            r["rc_offset"], bytes.fromhex(r["event"]), r["event_sync"],
        )  # fmt: skip
        flat = torch.empty(0, dtype=torch.uint8, device=device).set_(storage).view(dtype)
    start, count = r["storage_offset"], math.prod(shape)
    return flat[start : start + count].view(tuple(shape))
