"""The collectives of a tensor-parallel group over torch.distributed: gloo on the CPU, NCCL on CUDA,
picked by device once, at construction.

Invariants: every collective runs under the group's timeout (`COLLECTIVE_TIMEOUT_S`), so no rank waits on a
dead peer for longer; a collective that fails (a peer's process died, or the timeout passed) raises
`RankFailure`, a ConnectionError that names what happened, and the engine is then down (no collective is
retried: the ranks' streams would no longer line up). Rank 0 hosts the rendezvous store; the others connect
to its port. The group is joined (`join`) once every rank has loaded its weights: loading takes as long as
it takes, and the collectives' timeout starts counting only when every rank can answer.

On CUDA, a bf16 all-reduce of at most `LAMPORT_MAX_BYTES` (a decode step's hidden states) runs as the
Lamport all-reduce of kernels/triton_allreduce.py (each rank pushes its partial into its peers' symmetric
buffers, no barrier), and the all-reduce that feeds a residual add + RMSNorm runs fused with them
(`all_reduce_add_rms_norm`); an all-reduce of at most `ONE_SHOT_MAX_BYTES` that the Lamport path does not
take runs as torch's symmetric-memory one-shot all-reduce (each rank reads its peers' buffer over NVLink, no
multicast), larger ones through NCCL. The buffers are set up at `join` on every rank or on none: where a rank
cannot (no peer access, one GPU shared by two ranks), every rank stays on NCCL. A Lamport spin is bounded by
`LAMPORT_MAX_POLLS` polls of local memory instead of the group's timeout (a kernel cannot read the
process's clock); one that runs out marks an error word in host memory, which every token broadcast,
logits gather and argmax exchange reads (no wait on the device) and turns into `RankFailure`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from pdserve.kernels.ops import AttentionOps
from pdserve.shared.model.parallel import Collectives, best_of_ranks

if TYPE_CHECKING:  # triton is the [gpu] extra: imported where the CUDA path sets the kernel up
    from pdserve.kernels.triton_allreduce import LamportState

COLLECTIVE_TIMEOUT_S = 30.0
"""Longest wait of one collective (and of the rendezvous while the ranks load their weights)."""

ONE_SHOT_MAX_BYTES = 256 * 1024
"""Largest all-reduce that goes through the symmetric-memory one-shot path on CUDA."""

LAMPORT_MAX_BYTES = 512 * 1024
"""Largest bf16 all-reduce (and fused all-reduce + add + RMSNorm) that goes through the Lamport kernel:
benchmarks/tp_allreduce.py on two H200s measured it the fastest at every size from 8 to 512 KiB in a CUDA
graph (3.6-6.9 us per call against the one-shot's 7.1-11.0 and NCCL's 11.3-16.3); larger sizes are
batch 128 and up, where NCCL's bandwidth matters more, not measured against it."""

LAMPORT_MAX_POLLS = 1 << 24
"""Polls of one Lamport spin before it gives up on a peer: each reads the rank's own buffer, 605 ns a poll
for a 1,024-word program on an H200 (tests/test_lamport_gpu.py), so about 10 s, under the group's timeout;
a live peer is microseconds behind."""

_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
log = logging.getLogger(__name__)


class RankFailure(ConnectionError):
    """A rank of the tensor-parallel group is gone (or a collective timed out): the engine is down."""


class DistCollectives(Collectives):
    """`Collectives` (shared/model/parallel.py) of one rank of a torch.distributed group."""

    def __init__(
        self,
        rank: int,
        size: int,
        device: torch.device,
        why: Callable[[], str | None] = lambda: None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        """`why`: what the caller knows of a failure (rank 0's watchdog names the rank that exited),
        consulted when a collective fails. `dtype`: the activations' (the one-shot buffer's). No collective
        runs before `join`."""
        self.rank, self.size, self.device, self.dtype = rank, size, device, dtype
        self._why = why
        self._one_shot: torch.Tensor | None = None
        self._lamport: LamportState | None = None
        self._group_name = ""

    def join(self, store: dist.Store) -> None:
        """Joins the group through `store` (rank 0's TCPStore), waiting for every rank to join."""
        try:
            dist.init_process_group(
                _BACKENDS[self.device.type],
                store=store,
                rank=self.rank,
                world_size=self.size,
                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
            )
        except (RuntimeError, dist.DistStoreError) as exc:
            raise self._failure("rendezvous", exc) from exc
        if self.device.type == "cuda":
            self._setup_one_shot()

    def _setup_one_shot(self) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        from pdserve.kernels.triton_allreduce import LamportState

        group = dist.group.WORLD
        assert group is not None
        buf, why, lamport = None, "", None
        try:
            n = ONE_SHOT_MAX_BYTES // self.dtype.itemsize
            buf = symm_mem.empty(n, dtype=self.dtype, device=self.device)
            symm_mem.rendezvous(buf, group)
            if self.dtype == torch.bfloat16:
                words = 2 * self.size * (LAMPORT_MAX_BYTES // 4)  # [2 slots, N sources, pairs]
                words_buf = symm_mem.empty(words, dtype=torch.int64, device=self.device)
                handle = symm_mem.rendezvous(words_buf, group)
                lamport = (words_buf, list(handle.buffer_ptrs))
        except (RuntimeError, ValueError) as exc:
            buf, why = None, " ".join(str(exc).split())[:200]
        if self.agree_min(int(buf is not None)) == 1:
            self._one_shot, self._group_name = buf, group.group_name
            if lamport is not None:
                self._lamport = LamportState.create(*lamport, self.rank, LAMPORT_MAX_POLLS)
                torch.cuda.synchronize(self.device)  # the zeroed buffer, before a peer may push into it
                dist.barrier()
        elif self.rank == 0:
            log.info(
                "tensor parallel: all-reduces through NCCL alone (no symmetric memory: %s)", why or "a peer"
            )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        lamport = self._lamport
        if lamport is not None and lamport.fits(x):
            return lamport.all_reduce(x)
        buf = self._one_shot
        if buf is not None and x.dtype == buf.dtype and x.numel() <= buf.numel() and x.is_contiguous():
            n = x.numel()
            buf[:n].copy_(x.view(-1))
            torch.ops.symm_mem.one_shot_all_reduce_out(buf[:n], "sum", self._group_name, x.view(-1))
            return x
        try:
            dist.all_reduce(x)
        except RuntimeError as exc:
            raise self._failure("all-reduce", exc) from exc
        return x

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, ops: AttentionOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lamport = self._lamport
        if (
            lamport is not None
            and lamport.fits(x)
            and x.dim() == 2
            and residual.is_contiguous()
            and residual.dtype == weight.dtype == x.dtype
        ):
            return lamport.all_reduce_add_rms_norm(x, residual, weight, eps)
        return ops.add_rms_norm(self.all_reduce(x), residual, weight, eps)

    def broadcast_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rank 0's sampled token ids [S] int64 into every rank's `tokens` (in place; queued on the stream on
        CUDA, so async scheduling keeps the host ahead)."""
        self._check_spins()
        try:
            dist.broadcast(tokens, src=0)
        except RuntimeError as exc:
            raise self._failure("token broadcast", exc) from exc
        return tokens

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        local = local.contiguous()  # [S, V / N]
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        self._check_spins()
        try:
            dist.gather(local, parts, dst=0)
        except RuntimeError as exc:
            raise self._failure("logits gather", exc) from exc
        return local if parts is None else torch.cat(parts, dim=1)  # rank 0: [S, V_padded]

    def argmax_tokens(self, best: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        pair = torch.stack((best.double(), index.double()), dim=1)  # [S, 2]: fp32 values and ids exact
        # [N * S, 2] flat: gloo accepts no [N, S, 2] output for an empty step (S = 0)
        pairs = torch.empty((self.size * pair.shape[0], 2), dtype=pair.dtype, device=pair.device)
        self._check_spins()
        try:
            dist.all_gather_into_tensor(pairs, pair)
        except RuntimeError as exc:
            raise self._failure("argmax all-gather", exc) from exc
        return best_of_ranks(pairs.view(self.size, -1, 2))  # [S] on every rank

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (each rank's KV pool size: all ranks take the smallest)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        except RuntimeError as exc:
            raise self._failure("start-up all-reduce", exc) from exc
        return int(t.item())

    def close(self) -> None:
        self._one_shot = self._lamport = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def _check_spins(self) -> None:
        """RankFailure if a Lamport all-reduce gave up waiting on a peer (a host read, no device sync)."""
        if self._lamport is not None and self._lamport.failed():
            exc = TimeoutError(f"a peer's data did not come in {LAMPORT_MAX_POLLS} polls")
            raise self._failure("Lamport all-reduce", exc)

    def _failure(self, what: str, exc: Exception) -> RankFailure:
        cause = self._why() or " ".join(str(exc).split())[:200]
        return RankFailure(
            f"tensor-parallel rank {self.rank}: the {what} failed ({cause}); the engine is down"
        )
