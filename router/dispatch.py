"""Running one client request on the nodes: the node requests of its choices, merged into one event stream.

Invariants: every node a choice touches is recorded before the first byte is sent to it, and every node
that has not reported the end of its part (a StepOutput with finish_reason, or a PrefillResult) gets
`POST /internal/abort` when the choice ends on any path (success elsewhere, node failure, client
disconnect, deadline). Aborts run as their own tasks, so a cancelled caller cannot cancel them. All node
requests of one client request carry the same absolute deadline. A choice that has streamed nothing to its
client is placed again (at most _MAX_REROUTES times, under a fresh node request id) when a node refuses it
(503: draining) or cannot be reached (refused, reset, cut: that node's breaker is open by then, so the new
placement avoids it); a choice that has streamed a token migrates (router/migration.py: re-prefilled
elsewhere from its prompt and the tokens already streamed, at most `migration_limit` times) when its node
became unreachable or failed it, or ended it with the migration signal of a drain (`kvctl drain
--migrate`: the continuation's prefilling node then fetches the KV of the prompt and streamed tokens from
the draining node, which the index lists, instead of computing it), else ends with the error. Routing:
router/routing.py. A choice ends with a domain error (router/errors.py), which the request handler maps to
the client's OpenAI error.
Each attempt holds its booking in the in-flight ledger in a `with` block, so the ledger gets it back on
every path; what the nodes report (prefix hits, prefill times, the first token) is emitted to the telemetry
sink (router/telemetry.py), which counts and learns from it.
Why one module of about 400 lines: the abort-every-touched-node invariant holds across placement, re-placement
and migration only if one class owns the choice's whole life.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from pdserve.router.admission import Booking
from pdserve.router.background import Background
from pdserve.router.errors import (
    DeadlineExceeded,
    Internal,
    NodeAborted,
    NodeFailed,
    NodeUnavailable,
    RouterError,
)
from pdserve.router.metrics import RouterMetrics
from pdserve.router.migration import Continuation
from pdserve.router.node_client import NodeClient, NodeClients, NodeError
from pdserve.router.request_trace import CURRENT, RequestTrace
from pdserve.router.routing import Placement, Route
from pdserve.router.telemetry import (
    ChoiceFinished,
    FirstToken,
    PrefillDone,
    PrefixHits,
    StaleDecision,
    Telemetry,
)
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.index.block_index_types import NodeInfo
from pdserve.shared.node.node_protocol import NodeGenerateRequest, PrefillRequest, StepOutput
from pdserve.shared.types import NodeId, RequestId

log = logging.getLogger(__name__)

_PREFILL_GRACE_S = 1.0
_MAX_REROUTES = 2


class Rerouter(Protocol):
    """What RequestRun needs of the router: placing a choice again when a node turns it away, and the
    telemetry sink it reports each choice's outcomes to."""

    telemetry: Telemetry

    async def refused(self, node_id: NodeId) -> None: ...

    def place(
        self, prompt: Sequence[int], cache_salt: str | None, deadline: float
    ) -> Awaitable[Placement]: ...


@dataclass(frozen=True)
class ChoiceJob:
    index: int
    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    route: Route
    booking: Booking
    """The choice's load in the router's in-flight ledger; given back when it ends (on any path)."""


@dataclass(frozen=True)
class ChoiceEvent:
    """One step of choice `index`, or the error that ended it."""

    index: int
    step: StepOutput | None
    error: RouterError | None


def _step_error(node: NodeInfo, step: StepOutput, deadline: float) -> RouterError:
    reason = step.error or step.finish_reason or "unknown"
    if step.migrate:
        reason = "the node is draining and moved the request off; it could not be continued elsewhere"
    if time.time() >= deadline:
        return DeadlineExceeded(f"deadline exceeded on node {node.node_id}: {reason}")
    if step.finish_reason == "abort":
        return NodeAborted(f"node {node.node_id} aborted the request: {reason}")
    return NodeFailed(f"node {node.node_id} failed the request: {reason}")


class _StepFailed(NodeError):
    """A node ended a choice with an error line (finish_reason `reason`: abort or error); `error` is what the
    client gets if the choice can neither be placed again nor migrate."""

    def __init__(self, node_id: NodeId, error: RouterError, reason: str) -> None:
        super().__init__(node_id, f"failed the request: {error.message}", retryable=True)
        self.error = error
        self.reason = reason


async def _blame(exc: NodeError, other: asyncio.Task[Any]) -> NodeError:
    """The failure to act on when one side of a P/D pair failed: the other side's, if it turns out within
    _PREFILL_GRACE_S to be unreachable (a D that saw its transfer cut because P died), else exc."""
    await asyncio.wait({other}, timeout=_PREFILL_GRACE_S)
    if other.done() and not other.cancelled():
        failure = other.exception()
        if isinstance(failure, NodeError) and failure.unreachable:
            return failure
    return exc


def _node_error(exc: NodeError, deadline: float) -> RouterError:
    if time.time() >= deadline:
        return DeadlineExceeded(f"deadline exceeded: {exc}")
    return NodeUnavailable(str(exc))


class RequestRun:
    """The node requests of one client request: `start()`, then `next_event()` until `finished`;
    `cancel()` on any early exit (the caller enforces the deadline, the same one the nodes got)."""

    def __init__(
        self,
        jobs: list[ChoiceJob],
        cache_salt: str | None,
        deadline: float,
        clients: NodeClients,
        metrics: RouterMetrics,
        background: Background,
        rerouter: Rerouter,
        migration_limit: int = 0,
        trace: RequestTrace | None = None,
    ) -> None:
        assert [job.index for job in jobs] == list(range(len(jobs))), "choices are indexed by position"
        self._jobs = jobs
        # a response the client dropped before it started streaming never runs start() or cancel()
        weakref.finalize(self, RequestRun._release_jobs, jobs)
        self._rerouter = rerouter
        self._telemetry = rerouter.telemetry
        self._migration_limit = migration_limit
        self._trace = trace
        self._trace_context = None if trace is None else trace.carrier
        self._streamed = {job.index: Continuation(job.prompt_token_ids, job.sampling) for job in jobs}
        self._moved: dict[RequestId, str] = {}
        """Continuation request ids -> why their choice migrated (drain or failure): their prefill's hits are
        counted per cause."""
        self._started: set[int] = set()
        self._choice_start: dict[int, float] = {}  # choice index -> perf_counter at its (latest) route start
        """Choices that have delivered a step to the client (they can no longer be placed again)."""
        self._salt = cache_salt
        self.deadline = deadline
        self._clients = clients
        self._metrics = metrics
        self._background = background
        self._queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._pending = 0
        # request id -> nodes that may still hold it (removed when a node reports the end of its part).
        self._open: dict[RequestId, dict[NodeId, NodeClient]] = {}

    def start(self) -> None:
        """Send the node requests (once)."""
        assert not self._tasks, "RequestRun.start called twice"
        self._pending = len(self._jobs)
        self._tasks = [asyncio.create_task(self._run_choice(job)) for job in self._jobs]

    @property
    def finished(self) -> bool:
        """Every choice has delivered its last event (a step with finish_reason, or an error)."""
        return bool(self._tasks) and self._pending == 0

    async def next_event(self, timeout_s: float) -> ChoiceEvent | None:
        """The next event of any choice, or None when none arrived within timeout_s seconds."""
        try:
            async with asyncio.timeout(timeout_s):
                event = await self._queue.get()
        except TimeoutError:
            return None
        if event.error is not None or (event.step is not None and event.step.finish_reason is not None):
            self._pending -= 1
        return event

    def cancel(self, reason: str) -> None:
        """Stop every choice and abort it on every node that may still hold it. Idempotent."""
        for task in self._tasks:
            task.cancel()
        self.release()
        for request_id, nodes in self._open.items():
            for client in nodes.values():
                self._metrics.aborts.labels(reason=reason).inc()
                self._background.spawn(self._abort(client, request_id))
            nodes.clear()

    def release(self) -> None:
        """Gives back every choice's lease (idempotent); on cancel, and when the run is dropped unstarted."""
        RequestRun._release_jobs(self._jobs)

    @staticmethod
    def _release_jobs(jobs: list[ChoiceJob]) -> None:
        for job in jobs:
            job.booking.release()

    async def _abort(self, client: NodeClient, request_id: RequestId) -> None:
        try:
            await client.abort(request_id)
        except NodeError:
            # The node is gone or already forgot the request; either way it holds nothing for it.
            self._metrics.aborts.labels(reason="abort_failed").inc()

    def _closed(self, request_id: RequestId, node_id: NodeId) -> None:
        self._open.get(request_id, {}).pop(node_id, None)

    async def _run_choice(self, job: ChoiceJob) -> None:
        """Runs a choice; a node that refuses it (503: draining) or dies before it streamed anything gets it
        placed again, and one that fails it after migrates; each new attempt has a fresh node request id, so
        the failed node's abort cannot race it."""
        CURRENT.set(self._trace)  # this choice's task: its telemetry (reroutes' placements too) is traced
        attempt = 0
        while True:
            try:
                await self._run_route(job)
                return
            except NodeError as exc:
                if self._may_migrate(job, exc):
                    prompt, sampling = self._streamed[job.index].migrate()
                    tag, reason = f"m{self._streamed[job.index].migrations}", "migrated"
                    cause = "drain" if isinstance(exc, _StepFailed) and exc.reason == "migrate" else "failure"
                    self._moved[RequestId(f"{job.request_id}-{tag}")] = cause
                    self._metrics.migrations.labels(cause=cause).inc()
                elif self._may_reroute(job, exc, attempt):
                    attempt += 1
                    prompt, sampling, tag, reason = (
                        job.prompt_token_ids,
                        job.sampling,
                        f"r{attempt}",
                        "rerouted",
                    )
                else:
                    err = exc.error if isinstance(exc, _StepFailed) else _node_error(exc, self.deadline)
                    await self._queue.put(ChoiceEvent(job.index, None, err))
                    return
                if exc.status == 503 or (isinstance(exc, _StepFailed) and exc.reason == "migrate"):
                    # draining or no longer of that role: the next placement avoids it, on a fresh view
                    await self._rerouter.refused(exc.node_id)
                self._metrics.aborts.labels(reason=reason).inc()
                try:
                    placement = await self._rerouter.place(prompt, self._salt, self.deadline)
                except RouterError as err:
                    await self._queue.put(ChoiceEvent(job.index, None, err))
                    return
                job = replace(
                    job,
                    request_id=RequestId(f"{job.request_id}-{tag}"),
                    prompt_token_ids=tuple(prompt),
                    sampling=sampling,
                    route=placement.route,
                    booking=placement.bookings[0],
                )
                self._jobs[job.index] = job

    def _may_migrate(self, job: ChoiceJob, exc: NodeError) -> bool:
        """After a streamed token: the node is gone, failed the choice, moved it (a drain's migration
        signal), or refused its continuation (503: draining, so nothing of it ran there); not an abort, not
        past the deadline."""
        moved = isinstance(exc, _StepFailed) and exc.reason in ("error", "migrate")
        failed = exc.unreachable or exc.status == 503 or moved
        return (
            failed
            and job.index in self._started
            and self._streamed[job.index].eligible(self._migration_limit)
            and time.time() < self.deadline
        )

    def _may_reroute(self, job: ChoiceJob, exc: NodeError, attempt: int) -> bool:
        return (
            (exc.status == 503 or exc.unreachable or exc.retryable)
            and job.index not in self._started
            and attempt < _MAX_REROUTES
            and time.time() < self.deadline
        )

    async def _run_route(self, job: ChoiceJob) -> None:
        route = job.route
        self._choice_start[job.index] = time.perf_counter()
        decode = self._clients.get(route.decode.node_id, route.decode.http_url)
        opened = {decode.node_id: decode}
        prefill = None
        if route.prefill is not None:
            prefill = self._clients.get(route.prefill.node_id, route.prefill.http_url)
            opened[prefill.node_id] = prefill
        self._open[job.request_id] = opened
        gauges = [self._metrics.node_in_flight.labels(node_id=n) for n in opened]
        for gauge in gauges:
            gauge.inc()
        for node_id in opened:
            self._metrics.node_requests.labels(node_id=node_id).inc()
        error: str | None = None
        try:
            with job.booking:
                await self._run_nodes(job, decode, prefill)
        except NodeError as exc:
            error = str(exc)
            raise
        except Exception as exc:
            # A bug must fail the request with its cause, never leave the client waiting for the deadline.
            err = Internal(f"router error in {job.request_id}: {exc!r}")
            error = err.message
            await self._queue.put(ChoiceEvent(job.index, None, err))
            raise
        finally:
            self._telemetry.emit(ChoiceFinished(job.request_id, error))
            for gauge in gauges:
                gauge.dec()
            if self._open.get(job.request_id):
                self.cancel_one(job.request_id)

    def cancel_one(self, request_id: RequestId) -> None:
        for client in self._open.get(request_id, {}).values():
            self._metrics.aborts.labels(reason="choice_ended").inc()
            self._background.spawn(self._abort(client, request_id))
        self._open[request_id] = {}

    async def _run_nodes(self, job: ChoiceJob, decode: NodeClient, prefill: NodeClient | None) -> None:
        route = job.route
        # what to run, the same in both node requests: id, prompt, sampling, salt, deadline
        what = (job.request_id, job.prompt_token_ids, job.sampling, self._salt, self.deadline)
        fetch_url = None if route.fetch_from is None else route.fetch_from.http_url
        fetch_blocks = route.fetch_blocks if route.fetch_from is not None else 0
        if prefill is None or route.prefill is None:  # D prefills, after fetching a holder's prefix if named
            gen = NodeGenerateRequest(*what, None, fetch_url, fetch_blocks, self._trace_context)
            await self._pump(job, decode, route.decode, gen)
            return
        gen = NodeGenerateRequest(*what, route.prefill.node_id, trace_context=self._trace_context)
        pre = PrefillRequest(*what, route.decode.node_id, route.decode.transfer_addr, fetch_url, fetch_blocks,
                             self._trace_context)  # fmt: skip
        pump = asyncio.create_task(self._pump(job, decode, route.decode, gen))
        pre_task = asyncio.create_task(prefill.prefill(pre))
        try:
            done, _ = await asyncio.wait({pump, pre_task}, return_when=asyncio.FIRST_COMPLETED)
            if pre_task in done:
                job.booking.prefill_done()
                self._closed(job.request_id, prefill.node_id)
                failure = pre_task.exception()
                result = None if failure is not None else pre_task.result()
                if result is not None and result.error is None:
                    self._prefilled(job, result.cached_tokens, result.fetched_tokens)
                    n, bs = len(job.prompt_token_ids), route.decode.block_size
                    self._telemetry.emit(PrefillDone(n, bs, result))
                # Once D streams it has the KV and the first token: P's part is over whatever its reply (P may
                # have died after its transfer completed). Before that, P's failure ends this attempt (the
                # decode side is aborted in finally), unless D took the transfer: D then computes the prompt
                # itself (kv_load_failure_policy) and its stream tells how the request ends.
                if job.index not in self._started:
                    if failure is not None:
                        raise failure
                    if result is not None and result.error is not None and not result.decode_computes:
                        failed = NodeError(prefill.node_id, f"prefill failed: {result.error}", retryable=True)
                        blamed = await _blame(failed, pump)
                        if job.index not in self._started:  # else D computed the prompt and streams it
                            raise blamed
                await pump
                return
            try:
                await pump
            except NodeError as exc:
                raise (exc if exc.unreachable else await _blame(exc, pre_task)) from None
            # The decode node finished, so the prefill node's part is over; give its reply a moment to land.
            job.booking.prefill_done()
            await asyncio.wait({pre_task}, timeout=_PREFILL_GRACE_S)
            if pre_task.done() and not pre_task.cancelled() and pre_task.exception() is None:
                self._closed(job.request_id, prefill.node_id)
        finally:
            for task in (pump, pre_task):
                task.cancel()

    def _first_token(self, job: ChoiceJob) -> None:
        """The choice's first token: its prefilling node's part is over; its time from the choice's start
        goes beside the cost model's estimate."""
        job.booking.prefill_done()
        route, start = job.route, self._choice_start.get(job.index)
        if route.estimate is not None and route.inputs is not None and start is not None:
            self._telemetry.emit(FirstToken(route.estimate, route.inputs, time.perf_counter() - start))

    def _prefilled(self, job: ChoiceJob, cached_tokens: int, fetched_tokens: int) -> None:
        """What the prefilling node reported of the prompt: `cached_tokens` it did not compute, of them
        `fetched_tokens` fetched from the route's holder. A planned fetch that did not come was computed: a
        miss. A decision made on index records the node turned out not to hold is a stale decision."""
        route, n = job.route, len(job.prompt_token_ids)
        node_id = route.prefilling.node_id
        if cached_tokens < route.expected_cached_tokens(n):
            self._telemetry.emit(StaleDecision(node_id))
        hits = PrefixHits(node_id, cached_tokens - fetched_tokens, fetched_tokens, n - cached_tokens)
        self._telemetry.emit(hits)
        cause = self._moved.get(job.request_id)
        if cause is not None:
            self._continued(job, cause, hits)

    def _continued(self, job: ChoiceJob, cause: str, hits: PrefixHits) -> None:
        """A continuation's prompt tokens by where their KV came from; a drain's continuation that did not
        fetch from the draining node (no room there, or the index did not list its blocks) is logged."""
        tokens = self._metrics.migration_prompt_tokens
        for source, n in (("cached", hits.local), ("fetched", hits.remote), ("computed", hits.miss)):
            tokens.labels(cause=cause, source=source).inc(max(0, n))  # a node's report is not trusted blindly
        if cause == "drain" and hits.remote == 0:
            log.warning("continuation %s of a drained node's request was prefilled (%d prompt tokens "
                        "computed, %d cached): no fetch from the draining node", job.request_id, hits.miss,
                        hits.local)  # fmt: skip

    async def _pump(
        self, job: ChoiceJob, client: NodeClient, node: NodeInfo, req: NodeGenerateRequest
    ) -> None:
        first, timed = True, False
        async for step in client.generate(req):
            if first and req.prefill_node_id is None:  # D prefilled (local, local_fetch, single)
                # D does not report what it fetched: what it found cached beyond its own came (local_fetch)
                n, route = len(job.prompt_token_ids), job.route
                beyond = step.cached_tokens - route.expected_cached_tokens(n)
                fetched = max(0, min(beyond, route.planned_fetch_tokens(n)))
                self._prefilled(job, step.cached_tokens, fetched)
            first = False
            if step.token_ids and not timed:
                timed = True
                self._first_token(job)
            if step.finish_reason is not None:
                self._closed(job.request_id, client.node_id)
            if step.finish_reason in ("abort", "error"):  # the choice may go on elsewhere (_run_choice)
                reason = "migrate" if step.migrate else step.finish_reason
                raise _StepFailed(client.node_id, _step_error(node, step, self.deadline), reason)
            self._started.add(job.index)
            await self._queue.put(ChoiceEvent(job.index, self._streamed[job.index].record(step), None))
