"""This process's UCX context and how the ucx connector awaits ucxx requests (ucx_transport.py's plumbing).

One UCX context per process, shared by every ucx transport and started on the event loop of its first user;
requests complete through ucxx's Python futures, and a failed request's error stops at `ucx_request` with
its traceback dropped, so nothing ucxx keeps refers to a buffer. Invariant: the context's notifier runs while
it has a user (a listener, a set-up channel, or a request of an aborted channel still in flight, held in
ORPHANS until it finished).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable

import torch
import ucxx
from pdserve.kvtransfer.connector import ConnectorConfig
from pdserve.kvtransfer.ucx import UcxOptions

log = logging.getLogger("pdserve.kvtransfer")
UCX_ERRORS = (ucxx.exceptions.UCXError, ucxx.exceptions.UCXCanceled)
ORPHANS: set[asyncio.Future[None]] = set()  # payload requests of aborted channels, held until they finish


def progress_mode(config: ConnectorConfig) -> str:
    """The ucxx progress mode `config` asks for ("auto" resolved by its device)."""
    progress = config.options_of(UcxOptions).progress
    if progress != "auto":
        return progress
    return "thread-polling" if torch.device(config.device).type == "cuda" else "thread"


class _Context:
    """This process's UCX context, shared by every ucx transport (UCX has one per process; the first progress
    mode holds). Requests complete through ucxx's Python futures, which its notifier thread sets on the event
    loop: without them ucxx awaits a request by turning the loop without pause, so D's standing receive kept
    an idle node's loop busy for good, and a Python thread beside it (the node's engine) ran several times
    slower (docs/kv_transfer_protocol.md, "Measurements"). The notifier serves one event loop: it starts with
    the first user (a listener, a set-up channel, a request of an aborted channel still in flight) and stops,
    in a thread of its own (it takes up to a second), when the last one goes; the next loop (a test's) starts
    it anew."""

    def __init__(self) -> None:
        self.users = 0
        self.generation = 0  # counts starts: a user hands back the generation it joined
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping: threading.Thread | None = None

    async def acquire(self, mode: str) -> int:
        """Become a user (starting the context on this loop if it has none); the generation to hand back."""
        loop = asyncio.get_running_loop()
        if self.users and loop is not self.loop:
            if self.loop is not None and not self.loop.is_closed():
                raise RuntimeError("ucx serves one event loop per process at a time")
            log.warning("%d UCX users of a closed event loop were never closed; starting afresh", self.users)
            self.users = 0
            self._stop()
        if self.users == 0:
            if self.stopping is not None:
                await asyncio.to_thread(self.stopping.join)
                self.stopping = None
            self._start(mode)
            self.loop = loop
            self.generation += 1
        self.users += 1
        return self.generation

    def retain(self, generation: int) -> None:
        """One more user, joining the `generation` an existing user holds."""
        if generation == self.generation and self.users:
            self.users += 1

    def release(self, generation: int) -> None:
        if generation != self.generation or not self.users:  # a user of a context started afresh since
            return
        self.users -= 1
        if not self.users:
            self._stop()

    def at_exit(self) -> None:
        """At interpreter exit, before it waits for threads: end the notifier if a user is left."""
        if self.users:
            self.users = 0
            self._stop()
        if self.stopping is not None:
            self.stopping.join()

    def _stop(self) -> None:
        self.loop = None
        self.stopping = threading.Thread(target=ucxx.stop_notifier_thread, name="ucx-notifier-stop")
        self.stopping.start()

    def _start(self, mode: str) -> None:
        try:
            ucxx.init(progress_mode=mode, enable_python_future=True)
        except RuntimeError:  # started by an earlier loop, whose users all went: restart its notifier here
            context = ucxx.core._get_ctx()
            if not context.enable_python_future:
                raise RuntimeError(
                    "ucxx was started without Python futures before the ucx connector"
                ) from None
            if context.progress_mode != mode:
                log.warning(
                    "UCX runs with progress mode %r already; %r is ignored", context.progress_mode, mode
                )
            context.start_notifier_thread()
        else:
            # a process that exits with users left (a crash path) must not wait on the notifier forever
            threading._register_atexit(CONTEXT.at_exit)  # type: ignore[attr-defined]


CONTEXT = _Context()


@contextlib.asynccontextmanager
async def ucx_context(config: ConnectorConfig) -> AsyncIterator[None]:
    """Hold this process's UCX context for raw ucxx use beside the connector (benchmarks)."""
    generation = await CONTEXT.acquire(progress_mode(config))
    try:
        yield
    finally:
        CONTEXT.release(generation)


class RequestFailed(Exception):
    """A UCX request failed (cancelled by an endpoint's end, or an error); the message names ucxx's error."""


async def ucx_request(op: Awaitable[object]) -> None:
    """Await one ucxx send or receive. ucxx keeps a failed request's exception for as long as the worker
    lives (in the Python future its C++ request set), and the traceback it gathers on the way up names every
    frame it passed, with their locals: the buffer among them (each closed connection left its slot
    allocated on D). So the error stops here, its traceback dropped, and a fresh one goes on."""
    try:
        await op
    except UCX_ERRORS as e:
        e.__traceback__ = None
        raise RequestFailed(repr(e)) from None


def settle(generation: int, request: asyncio.Future[None]) -> None:
    """Let go of an aborted channel's request once it finished, reading its outcome (it failed, most likely:
    nobody waits for it any more, and asyncio would report the error as never retrieved)."""
    ORPHANS.discard(request)
    CONTEXT.release(generation)
    if not request.cancelled():
        request.exception()
