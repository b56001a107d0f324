"""Runs an LLMEngine's step loop in its own thread and exposes submit / stream / abort to asyncio.

Invariants: only the loop thread touches the engine (other threads post closures to `_inbox`); every
stream ends with exactly one finished output (finish_reason set), including on abort, engine error and
shutdown; a consumer that stops early (client disconnect, cancellation) aborts its request, so nothing
it held stays in the pool. torch releases the GIL inside kernels, so the loop runs beside the node's
network front without stalling it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from pdserve.shared.engine.engine import LLMEngine
from pdserve.shared.engine.request import Request
from pdserve.shared.node.node_protocol import StepOutput
from pdserve.shared.types import RequestId

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDead(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[RequestId, asyncio.Queue[StepOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.step_listeners: list[Callable[[list[StepOutput]], None]] = []

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        self._inbox.put(lambda: None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self.engine.close()  # graphs and their memory pool go with the loop that used them

    async def call(self, fn: Callable[[], T]) -> T:
        """Runs `fn` on the loop thread (between steps) and returns its result."""
        if self._error is not None:
            raise EngineDead(f"engine loop died: {self._error}")
        assert self._loop is not None, "start() the engine first"
        fut: asyncio.Future[T] = self._loop.create_future()
        loop = self._loop

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting coroutine, not swallowed
                loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._inbox.put(run)
        return await fut

    def open_stream(self, request_id: RequestId) -> asyncio.Queue[StepOutput]:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already streaming")
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._streams[request_id] = q
        return q

    async def generate(self, request: Request) -> AsyncIterator[StepOutput]:
        """Adds `request` and yields its outputs until it finishes; aborts it if the consumer stops."""
        q = self.open_stream(request.request_id)
        try:
            await self.call(lambda: self.engine.add_request(request))
        except BaseException:
            self._streams.pop(request.request_id, None)
            raise
        async for out in self.stream(request.request_id, q):
            yield out

    async def stream(self, request_id: RequestId, q: asyncio.Queue[StepOutput]) -> AsyncIterator[StepOutput]:
        finished = False
        try:
            while not finished:
                out = await q.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: RequestId, migrate: bool = False) -> bool:
        """Ends the request everywhere in the engine; its stream, if open, receives an 'abort' output (with
        `migrate` set when a drain moves the request: the router continues it elsewhere). False when the
        engine did not hold it (it had ended)."""
        if self._error is not None:
            return False
        out = await self.call(lambda: self.engine.abort(request_id))
        if out is not None:
            self._route([dataclasses.replace(out, migrate=True) if migrate else out])
        return out is not None

    # ---- loop thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine.bind_thread()
            while not self._stop.is_set():
                block = not self.engine.has_unfinished()
                self._drain_inbox(block)
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
        except BaseException as exc:
            log.exception("engine loop died")
            self._error = exc
            self._fail_all(exc)

    def _drain_inbox(self, block: bool) -> None:
        try:
            fn = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            fn()
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, outputs: list[StepOutput]) -> None:
        if not outputs:
            return
        assert self._loop is not None
        for listener in self.step_listeners:
            listener(outputs)
        self._loop.call_soon_threadsafe(self._route, outputs)

    def _route(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        assert self._loop is not None
        ids = list(self._streams)

        def fail() -> None:
            for rid in ids:
                q = self._streams.get(rid)
                if q is not None:
                    q.put_nowait(StepOutput.failed(rid, 0))

        self._loop.call_soon_threadsafe(fail)


def _set_result(fut: asyncio.Future[T], value: T) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[T], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
