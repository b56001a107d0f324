"""The collectives of a tensor-parallel group over torch.distributed: gloo on the CPU, NCCL on CUDA,
picked by device once, at construction.

Invariants: every collective runs under the group's timeout (`COLLECTIVE_TIMEOUT_S`), so no rank waits on a
dead peer for longer; a collective that fails (a peer's process died, or the timeout passed) raises
`RankFailure`, a ConnectionError that names what happened, and the engine is then down (no collective is
retried: the ranks' streams would no longer line up). Rank 0 hosts the rendezvous store; the others connect
to its port. The group is joined (`join`) once every rank has loaded its weights: loading takes as long as
it takes, and the collectives' timeout starts counting only when every rank can answer.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 30.0
"""Longest wait of one collective (and of the rendezvous while the ranks load their weights)."""

_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


class RankFailure(ConnectionError):
    """A rank of the tensor-parallel group is gone (or a collective timed out): the engine is down."""


class DistCollectives:
    """`Collectives` (shared/model/parallel.py) of one rank of a torch.distributed group."""

    def __init__(
        self, rank: int, size: int, device: torch.device, why: Callable[[], str | None] = lambda: None
    ) -> None:
        """`why`: what the caller knows of a failure (rank 0's watchdog names the rank that exited),
        consulted when a collective fails. No collective runs before `join`."""
        self.rank, self.size, self.device = rank, size, device
        self._why = why

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

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        try:
            dist.all_reduce(x)
        except RuntimeError as exc:
            raise self._failure("all-reduce", exc) from exc
        return x

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        local = local.contiguous()  # [S, V / N]
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        try:
            dist.gather(local, parts, dst=0)
        except RuntimeError as exc:
            raise self._failure("logits gather", exc) from exc
        return local if parts is None else torch.cat(parts, dim=1)  # rank 0: [S, V_padded]

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (each rank's KV pool size: all ranks take the smallest)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        except RuntimeError as exc:
            raise self._failure("start-up all-reduce", exc) from exc
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def _failure(self, what: str, exc: Exception) -> RankFailure:
        cause = self._why() or " ".join(str(exc).split())[:200]
        return RankFailure(
            f"tensor-parallel rank {self.rank}: the {what} failed ({cause}); the engine is down"
        )
