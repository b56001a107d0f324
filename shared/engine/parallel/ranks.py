"""Rank 0's side of the tensor-parallel group: it starts one process per other rank, broadcasts every
step's batch to them, maps their KV pools (kv_pools.py), watches them, calls back when one dies, and stops
them.

Invariants: the worker processes are children of rank 0, started before it loads its own share (they load
in parallel) and ended on every path: `close` (idempotent) shuts the step channel, so each worker reads end
of file and exits, and kills any that has not within `_EXIT_WAIT_S`; if rank 0 dies, the same end of file
(or a failed collective) ends them. A worker that exits while the group is open takes the engine down: the
watchdog thread records which one, kills the others at once, and the next collective or broadcast on rank 0
raises `RankFailure` naming it. At size 1 (`SoloRank`) there is nothing to start, broadcast or watch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.model_runner import BatchItem
from pdserve.shared.engine.parallel.dist import COLLECTIVE_TIMEOUT_S, DistCollectives, RankFailure
from pdserve.shared.engine.parallel.kv_pools import map_shared_pool, open_cuda_pool
from pdserve.shared.engine.parallel.step_channel import StepWriter, capacity_bytes
from pdserve.shared.model.parallel import Collectives, SingleRank

log = logging.getLogger(__name__)

_EXIT_WAIT_S = 5.0
_POLL_S = 0.05
_WHY_WAIT_S = 1.0


class Ranks(Protocol):
    """What the engine (rank 0) does with its group."""

    comm: Collectives

    def join(self) -> None:
        """Waits for every rank to have loaded its share, then joins the group (rank 0 has loaded its own)."""

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value`."""

    def publish(self, items: Sequence[BatchItem], argmax: bool) -> None:
        """Sends a step's batch to the other ranks (before rank 0 runs it); `argmax`: every rank ends the
        step in the greedy tokens (`ModelRunner.execute`)."""

    def share_tokens(self, tokens: torch.Tensor) -> None:
        """With async scheduling: a step's sampled tokens [S] (on the device) to the other ranks, whose next
        step reads its placeholders from them (every step that samples from logits, in launch order; an
        `argmax` step's tokens are on every rank already)."""

    def open_pools(self, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        """The KV pools of ranks 1..N-1 (each of `shape`), mapped into this process (kv_pools.py)."""

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Calls `callback(why)` once, from the watchdog's thread, when a rank exits while the group is open
        (at once if one already has): an idle engine would not notice until its next step."""

    def close(self) -> None:
        """Stops the other ranks; idempotent."""


class SoloRank:
    """A group of one."""

    def __init__(self) -> None:
        self.comm: Collectives = SingleRank()

    def join(self) -> None:
        return None

    def agree_min(self, value: int) -> int:
        return value

    def publish(self, items: Sequence[BatchItem], argmax: bool) -> None:
        return None

    def share_tokens(self, tokens: torch.Tensor) -> None:
        return None

    def open_pools(self, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        return []

    def on_failure(self, callback: Callable[[str], None]) -> None:
        return None

    def close(self) -> None:
        return None


def start_ranks(cfg: EngineConfig, max_model_len: int) -> Ranks:
    """The engine's group: `SoloRank` at size 1, else the worker processes, started (they load their shares
    while rank 0 loads its own; `join` waits for them)."""
    if cfg.tensor_parallel_size == 1:
        return SoloRank()
    return TPRanks(cfg, max_model_len)


class TPRanks:
    def __init__(self, cfg: EngineConfig, max_model_len: int) -> None:
        self.size = size = cfg.tensor_parallel_size
        self._failure: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._closing = False
        self._stop_r, self._stop_w = os.pipe()
        self.dist = DistCollectives(0, size, cfg.torch_device, self._why, cfg.torch_dtype)
        self.comm: Collectives = self.dist
        store = self.store = dist.TCPStore(
            "127.0.0.1",
            0,
            size,
            is_master=True,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
            wait_for_workers=False,
        )
        blocks_per_seq = -(-max_model_len // cfg.block_size)
        self.channel = StepWriter(
            capacity_bytes(cfg.max_num_seqs, cfg.max_num_batched_tokens, blocks_per_seq), size - 1
        )
        self.procs: list[subprocess.Popen[bytes]] = []
        self.devices = [cfg.rank_device(rank) for rank in range(size)]
        # on the CPU, each worker's KV pool lies on a memfd rank 0 keeps open and maps too (kv_pools.py)
        cpu = cfg.torch_device.type == "cpu"
        self._kv_fds = [os.memfd_create(f"pdserve-tp-kv-{r}") if cpu else -1 for r in range(1, size)]
        try:
            for rank in range(1, size):
                region_fd, bell_fd = self.channel.fds(rank - 1)
                kv_fd = self._kv_fds[rank - 1]
                args = {
                    "config": dataclasses.asdict(cfg),
                    "rank": rank,
                    "store_port": store.port,
                    "region_fd": region_fd,
                    "bell_fd": bell_fd,
                    "kv_fd": kv_fd,
                    "capacity": self.channel.capacity,
                    "threads": torch.get_num_threads(),
                }
                cmd = [sys.executable, "-m", "pdserve.shared.engine.parallel.worker", json.dumps(args)]
                fds = (region_fd, bell_fd) if kv_fd < 0 else (region_fd, bell_fd, kv_fd)
                proc = subprocess.Popen(cmd, pass_fds=fds, stdin=subprocess.DEVNULL)
                self.procs.append(proc)
            self.channel.started()
            threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()
        except BaseException:
            self.close()
            raise
        log.info("tensor parallel: %d ranks, workers %s", size, [p.pid for p in self.procs])

    def join(self) -> None:
        loaded = [loaded_key(rank) for rank in range(1, self.size)]
        while not self.store.check(loaded):  # loading has no timeout: a worker that dies ends the wait
            if self._failure is not None:
                raise RankFailure(f"tensor parallel: {self._failure} while loading; the engine is down")
            time.sleep(_POLL_S)
        self.dist.join(self.store)

    def agree_min(self, value: int) -> int:
        return self.dist.agree_min(value)

    def publish(self, items: Sequence[BatchItem], argmax: bool) -> None:
        self.channel.publish(items, argmax)

    def share_tokens(self, tokens: torch.Tensor) -> None:
        self.dist.broadcast_tokens(tokens)

    def open_pools(self, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        pools = []
        for rank in range(1, self.size):
            fd = self._kv_fds[rank - 1]
            if fd >= 0:
                pools.append(map_shared_pool(fd, shape, dtype))
            else:  # published once the worker allocated it; the store's get waits for it, under its timeout
                pools.append(
                    open_cuda_pool(self.store, rank, self.devices[0], self.devices[rank], shape, dtype)
                )
        return pools

    def on_failure(self, callback: Callable[[str], None]) -> None:
        with self._lock:
            failure = self._failure
            if failure is None:
                self._callbacks.append(callback)
        if failure is not None:
            callback(failure)

    def _why(self) -> str | None:
        """The watchdog's account of a failed collective: a rank that exited (it notices within moments)."""
        deadline = time.monotonic() + _WHY_WAIT_S
        while self._failure is None and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return self._failure

    def _watch(self) -> None:
        pidfds = {os.pidfd_open(p.pid): (rank, p) for rank, p in enumerate(self.procs, start=1)}
        try:
            ready, _, _ = select.select([*pidfds, self._stop_r], [], [])
            for fd in ready:
                if fd in pidfds and not self._closing:
                    rank, proc = pidfds[fd]
                    failure = f"rank {rank} (pid {proc.pid}) exited with code {proc.wait()}"
                    log.error("tensor parallel: %s; stopping the other ranks, the engine is down", failure)
                    self._kill_all()
                    with self._lock:
                        self._failure, callbacks = failure, self._callbacks
                    for callback in callbacks:
                        callback(failure)
                    return
        finally:
            for fd in [*pidfds, self._stop_r]:
                os.close(fd)

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self.channel.close()
        for fd in self._kv_fds:  # a mapping keeps its pages; the workers hold their own descriptors
            if fd >= 0:
                os.close(fd)
        os.close(self._stop_w)
        if self._failure is None:  # with a peer gone, the group's teardown can hang: the exit does it
            self.dist.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("tensor parallel: worker pid %d did not exit; killing it", proc.pid)
                proc.kill()
                proc.wait()


def loaded_key(rank: int) -> str:
    """The store key a worker sets once its share is loaded."""
    return f"pdserve-tp/loaded/{rank}"
