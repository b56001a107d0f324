"""What every node process shares whatever its role: the engine in its thread, the node's registration,
heartbeat and block-event publishing in the Redis index, drain and evict, and the common internal routes.

Invariants: the node registers at start (a new epoch), publishes its pool's Stored/Removed events in order
and in batches, and after Redis comes back re-sends its whole held set (resync), so the index converges to
the truth. A node the index no longer knows (Redis restarted empty, or lost the node's keys) registers again
with a new epoch, as draining if it is, and then resyncs; only the publish loop writes block records. A
drained node takes no new request and deregisters when its last one ends. Index trouble is logged once when
it starts, at most once a minute while it lasts, and once when the index answers again.
The node owns its state in Redis: every heartbeat rewrites its load (drain flag included) signed with the
cluster's record key, so a field someone else writes there is ignored by readers and undone within a
heartbeat; draining and undraining take effect in the index through an immediate signed heartbeat.
The node's current role is `role` (runtime state; node/role_change.py changes it and registers the node
under it with a new epoch, its held blocks resent); `refuses` gates the role's routes by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pdserve.node.drain_migrate import RequestMover
from pdserve.node.node_metrics import NodeMetrics
from pdserve.shared.engine.async_engine import AsyncEngine, EngineDead
from pdserve.shared.engine.block_pool import BlockEvent
from pdserve.shared.engine.engine import LLMEngine
from pdserve.shared.index.block_digest import IndexTruth
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import (
    BlockIndexError,
    NodeInfo,
    NodeLoad,
    NodeNotRegistered,
    RedisConfig,
    StaleEpoch,
)
from pdserve.shared.node.move_protocol import DrainNote
from pdserve.shared.node.node_protocol import AbortRequest, ChallengeReply, ChallengeRequest, NodeInfoReply
from pdserve.shared.node.node_sign import ClusterKeys
from pdserve.shared.tracing import NO_TRACING, Tracing

if TYPE_CHECKING:
    from pdserve.node.kv_events import KVEventsPublisher
from pdserve.shared.types import ROLES, BlockHash, NodeId, RequestId, Role
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger(__name__)


class IndexLink:
    """Whether the index answered this node's last call, and the log lines that say so: a warning when
    trouble starts, at most one more every `repeat_s` while it lasts, one line when the index answers."""

    def __init__(self, address: str, repeat_s: float = 60.0) -> None:
        self.address = address
        self.repeat_s = repeat_s
        self.down_since: float | None = None
        self._logged_at = 0.0

    def failed(self, what: str, exc: BlockIndexError) -> None:
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = self._logged_at = now
            log.warning(
                "index at %s: %s failed (%s); serving on, and resyncing once it answers (next warning in "
                "%.0fs if it does not)", self.address, what, exc, self.repeat_s,
            )  # fmt: skip
        elif now - self._logged_at >= self.repeat_s:
            self._logged_at = now
            log.warning(
                "index at %s: still failing after %.0fs: %s", self.address, now - self.down_since, exc
            )

    def answered(self) -> None:
        if self.down_since is not None:
            log.info(
                "index reachable again at %s after %.1fs", self.address, time.monotonic() - self.down_since
            )
            self.down_since = None


@dataclass(frozen=True)
class NodeSettings:
    node_id: str
    role: Role
    host: str = "127.0.0.1"
    port: int = 0
    redis: RedisConfig | None = None
    heartbeat_s: float = 1.0
    publish_s: float = 0.05
    auth_window_s: float = 30.0
    """A signed internal request is accepted within this many seconds of the node's clock (either way), and
    its nonce remembered for as long (shared/node/node_sign.py)."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r}: accepted {', '.join(ROLES)}")
        if self.heartbeat_s <= 0 or self.publish_s <= 0 or self.auth_window_s <= 0:
            raise ValueError("heartbeat_s, publish_s and auth_window_s must be > 0")

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"


class NodeRuntime:
    def __init__(self, settings: NodeSettings, engine: LLMEngine, keys: ClusterKeys) -> None:
        self.settings = settings
        self.engine = engine
        self.keys = keys
        self.aengine = AsyncEngine(engine)
        self.metrics = NodeMetrics(settings.role, tp_size=len(engine.devices), devices=engine.devices)
        self.index = BlockIndex(settings.redis, keys) if settings.redis is not None else None
        held = functools.partial(self.aengine.call, engine.held_hashes)
        self.truth = (
            None if self.index is None else IndexTruth(self.index, self.node_id, held, self.metrics.registry)
        )
        self.epoch = 0
        self.role: Role = settings.role
        """The role the node serves as now (`settings.role` at start; node/role_change.py changes it)."""
        self.changing_role = False
        """A role change is under way: the node takes no new work and shows as draining in the index."""
        self.draining = False
        self.deregistered = False
        self._tasks: list[asyncio.Task[None]] = []
        self._need_resync = False
        self._register_lock = asyncio.Lock()
        self._link = IndexLink(settings.redis.address if settings.redis is not None else "")
        self._info: NodeInfo | None = None
        self.connector_kind = "none"
        """The KV connector this node uses (a metrics label), set by the role's server."""
        self.requests_outside_engine: Callable[[], int] = lambda: 0
        """Requests the role holds before they enter the engine (D: waiting for their KV; P: waiting for D's
        room), set by the role's server: a draining node deregisters only when these are done too."""
        self.tracing: Tracing = NO_TRACING
        """Where the role's servers record their request spans (set by node_serve from --otlp-endpoint)."""
        self.kv_events: KVEventsPublisher | None = None
        """The pool's events in vLLM's format (node/kv_events.py), set by node_serve before start()."""
        self._passes = 0  # publish passes started
        self._pass_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self.mover = RequestMover(self.node_id, self.aengine, self.metrics, self.published)
        """Moves running requests with their KV (a drain or a role change with --migrate)."""

    @property
    def node_id(self) -> NodeId:
        return NodeId(self.settings.node_id)

    @property
    def registration(self) -> NodeInfo | None:
        """The node's registration with its current epoch (None before it registered)."""
        return None if self._info is None else dataclasses.replace(self._info, epoch=self.epoch)

    async def start(self, transfer_addr: str, protocol_version: int, credential_digest: str) -> None:
        """Starts the engine and registers; IncompatibleNode (another model, KV layout, protocol version or
        credential than the live nodes') propagates, so a refused node stops before it serves."""
        self.aengine.start()
        self.metrics.kv_total_blocks.set(self.engine.num_blocks)
        if self.index is not None:
            info = NodeInfo(
                node_id=self.node_id,
                role=self.settings.role,
                http_url=self.settings.http_url,
                transfer_addr=transfer_addr,
                model_fingerprint=self.engine.fingerprint.hex(),
                kv_layout=self.engine.kv_layout,
                protocol_version=protocol_version,
                capacity_blocks=self.engine.num_blocks,
                credential_digest=credential_digest,
                max_model_len=self.engine.max_model_len,
                tokenizer_fingerprint=self.engine.tokenizer.fingerprint,
                model=self.engine.loaded.description,
                quantization=self.engine.loaded.quantization or "none",
                devices=self.engine.devices,
                max_num_seqs=self.engine.cfg.max_num_seqs,
            )
            self._info = info
            load = await self.aengine.call(self.load)
            self.epoch = await self.index.register(info, load)  # IncompatibleNode propagates: refuse to start
            log.info("node %s registered as %s, epoch %d", self.node_id, self.settings.role, self.epoch)
            self._tasks.append(asyncio.create_task(self._heartbeat_loop()))
            self._tasks.append(asyncio.create_task(self._publish_loop()))
        elif self.kv_events is not None:
            self._tasks.append(asyncio.create_task(self._publish_loop()))

    async def stop(self) -> None:
        await self.leave()
        if self.index is not None:
            await self.index.close()
        await self.aengine.stop()

    async def leave(self) -> None:
        """Stops the heartbeat and publishing and deregisters, so routers stop choosing this node at once;
        idempotent (a node whose engine died leaves before its server shuts down)."""
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
            except EngineDead as exc:  # a loop that met the dead engine first: leaving must still happen
                log.warning("node %s: %s", self.node_id, exc)
        if self.index is not None:
            with contextlib.suppress(BlockIndexError):
                await self.index.deregister(self.node_id)
            self.deregistered = True

    def load(self) -> NodeLoad:
        """Read on the loop thread (engine.call) so counts are consistent."""
        snap = self.engine.snapshot()
        return NodeLoad(
            running=snap.running,
            waiting=snap.waiting,
            kv_used_blocks=snap.kv_used_blocks,
            kv_total_blocks=snap.kv_total_blocks,
            blocks_held=len(self.engine.held_hashes()),
            draining=self.draining or self.changing_role,
            queued_prefill_tokens=snap.queued_prefill_tokens,
        )

    async def _heartbeat_loop(self) -> None:
        assert self.index is not None
        while True:
            load = await self.aengine.call(self.load)
            m = self.metrics
            m.kv_used_blocks.set(load.kv_used_blocks)
            m.running.set(load.running)
            m.waiting.set(load.waiting)
            await self.mover.expire_due()
            held = self.requests_outside_engine() + self.mover.pinned()  # pinned: moved, not pulled yet
            idle = load.running == 0 and load.waiting == 0 and held == 0
            if self.draining and idle and not self.deregistered:
                try:
                    await self.index.deregister(self.node_id)
                    self.deregistered = True
                    log.info("node %s drained and deregistered", self.node_id)
                    self._link.answered()
                except BlockIndexError as exc:
                    self._link.failed("deregister", exc)
            elif not self.deregistered:
                await self._beat(load)
            await asyncio.sleep(self.settings.heartbeat_s)

    async def _beat(self, load: NodeLoad) -> None:
        assert self.index is not None and self._info is not None
        # a drain (or role change) since `load` was read stands
        load = dataclasses.replace(load, draining=self.draining or self.changing_role)
        epoch, what = self.epoch, "heartbeat"
        try:
            try:
                await self.index.heartbeat(self._info, load, epoch)
                if self.truth is not None and not self._need_resync:
                    await self.truth.check(epoch)  # shared/index/block_digest.py; logs its own failures
            except NodeNotRegistered:
                what = "registering again"
                await self._register_again(epoch)  # its first heartbeat carries the load, for the router
            except StaleEpoch as exc:
                if exc.current >= epoch:  # a newer registration of this node id: not this process's to undo
                    raise
                what = "registering again"  # the index lost the last registration (a failover)
                await self._register_again(epoch)
            self._link.answered()
        except StaleEpoch as exc:
            if epoch == self.epoch:  # not the other loop's re-registration racing this beat
                self._link.failed(what, exc)
        except BlockIndexError as exc:
            self._link.failed(what, exc)
            self._need_resync = True

    async def _register_again(self, seen_epoch: int) -> None:
        """The index lost this node (Redis restarted empty, or a failover lost its last registration):
        register with a new epoch, draining if the node is, and have the publish loop resync every block it
        holds. A no-op if the other loop already did it since `seen_epoch`."""
        assert self.index is not None and self._info is not None
        async with self._register_lock:
            if self.epoch != seen_epoch or self.deregistered:
                return
            load = await self.aengine.call(self.load)  # its drain flag: the node's own, signed
            self.epoch = await self.index.register(self._info, load, after_epoch=seen_epoch)
            self._need_resync = True
        log.warning(
            "node %s was not registered in the index (Redis lost its data?): registered again, epoch %d -> "
            "%d%s; resyncing every block it holds", self.node_id, seen_epoch, self.epoch,
            ", draining" if self.draining else "",
        )  # fmt: skip

    async def _publish_loop(self) -> None:
        """The only reader of the pool's events: the only writer of the node's block records (events drained
        before a resync's listing are covered by it; those after it are applied after it, in order, so the
        records end as the pool is) and the KV-events publisher's only source."""
        while True:
            await asyncio.sleep(self.settings.publish_s)
            self._passes += 1
            events: list[BlockEvent] = await self.aengine.call(self.engine.drain_events)
            if self.kv_events is not None and events:
                self.kv_events.publish(events)
            if self.index is not None and not self.deregistered and (self._need_resync or events):
                await self._publish(events)
            done = [f for n, f in self._pass_waiters if n <= self._passes]
            self._pass_waiters = [(n, f) for n, f in self._pass_waiters if n > self._passes]
            for f in done:
                if not f.done():
                    f.set_result(None)

    async def published(self) -> None:
        """Returns once a publish pass that started after this call has ended: the index then lists the
        blocks the pool held at the call (unless Redis failed that pass). At once when nothing publishes."""
        if not self._tasks:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pass_waiters.append((self._passes + 1, waiter))
        await waiter

    async def _publish(self, events: list[BlockEvent]) -> None:
        assert self.index is not None
        epoch, what = self.epoch, "publish"
        try:
            try:
                if self._need_resync:
                    what = "resync"
                    engine = self.engine
                    held, host = await self.aengine.call(lambda: (engine.held_hashes(), engine.host_hashes()))
                    await self.index.resync(self.node_id, epoch, held, host)
                    self._need_resync = False
                    log.info("node %s: index resynced, %d blocks at epoch %d", self.node_id, len(held), epoch)
                else:
                    await self.index.publish(self.node_id, epoch, events)
            except NodeNotRegistered:
                what = "registering again"
                self._need_resync = True
                await self._register_again(epoch)
            except StaleEpoch as exc:
                if exc.current >= epoch:
                    raise
                what = "registering again"  # the index lost the last registration (a failover)
                self._need_resync = True
                await self._register_again(epoch)
            self._link.answered()
        except StaleEpoch as exc:
            self._need_resync = True  # at the current epoch, next tick
            if epoch == self.epoch:  # not the heartbeat's re-registration racing this publish
                self._link.failed(what, exc)
        except BlockIndexError as exc:
            self._link.failed(what, exc)
            self._need_resync = True

    async def drain(self) -> None:
        """Takes no new work: shown in the index at once (a signed heartbeat), so routers stop choosing it."""
        self.draining = True
        if self.index is not None and self._info is not None and not self.deregistered:
            await self._beat(await self.aengine.call(self.load))

    async def undrain(self) -> None:
        """Takes new work again: clears its draining mark in the index (a signed heartbeat), or registers anew
        (a new epoch, its held blocks resent) when the drained node had already deregistered."""
        self.draining = False
        if self.index is None or self._info is None:
            return
        load = await self.aengine.call(self.load)
        if self.deregistered:
            async with self._register_lock:
                self.epoch = await self.index.register(self._info, load, after_epoch=self.epoch)
                self.deregistered, self._need_resync = False, True
        else:
            await self._beat(load)

    def refuses(self, work: Role) -> str | None:
        """Why the node takes no new request of `work` now ("prefill": a prompt for P; "decode" or "single":
        a request to generate), or None when it takes it."""
        if self.draining:
            return f"node {self.node_id} is draining"
        if self.changing_role:
            return f"node {self.node_id} is changing role"
        if (work == "prefill") != (self.role == "prefill"):
            return f"node {self.node_id} is a {self.role} node"
        return None

    async def beat_now(self) -> None:
        """A signed heartbeat now, so the index shows a change of the node's drain flag at once."""
        if self.index is not None and self._info is not None and not self.deregistered:
            await self._beat(await self.aengine.call(self.load))

    async def register_as(self, role: Role, transfer_addr: str) -> None:
        """Serves as `role` from now on: registers under it with a new epoch and has the publish loop resend
        every block it holds under that epoch, so its prefix cache stays in the index under the node.
        BlockIndexError (the index refused or did not answer) leaves the node in its old role."""
        old = self.role
        if self.index is not None and self._info is not None:
            info = dataclasses.replace(self._info, role=role, transfer_addr=transfer_addr)
            async with self._register_lock:
                load = await self.aengine.call(self.load)
                self.epoch = await self.index.register(info, load, after_epoch=self.epoch)
                self._info, self.deregistered, self._need_resync = info, False, True
        self.role = role
        self.metrics.role_changed(old, role)
        log.info("node %s serves as %s (was %s), epoch %d", self.node_id, role, old, self.epoch)

    def until_leave(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Runs `coro` as a task that `leave()` cancels (and awaits) with the node's loops, so nothing it
        does (a re-registration) outlives the node's deregistration."""
        task = asyncio.create_task(coro)
        self._tasks.append(task)
        return task

    async def evict(self, hashes: list[BlockHash] | None) -> int:
        return await self.aengine.call(lambda: self.engine.evict(hashes))


def add_common_routes(app: FastAPI, rt: NodeRuntime) -> None:
    """Internal routes every role serves. They live on the node's internal port, never the public API, and
    all but health and metrics need the cluster's credential (shared/node/node_auth.py, in front of them)."""

    @app.get("/internal/info")
    async def info() -> Response:
        e = rt.engine
        reply = NodeInfoReply(
            node_id=rt.node_id,
            role=rt.role,
            model=e.cfg.model,
            max_model_len=e.max_model_len,
            block_size=e.cfg.block_size,
        )
        return Response(reply.to_json(), media_type="application/json")

    @app.get("/internal/health")
    async def health() -> JSONResponse:
        return JSONResponse({"ok": True, "node_id": rt.node_id, "draining": rt.draining, "time": time.time()})

    @app.post("/internal/challenge")
    async def challenge(request: Request) -> Response:
        """Proves that this URL is served by a holder of the cluster's credential registered as (node id,
        epoch): the router asks once per epoch before it sends the node any work (router/membership.py)."""
        msg = ChallengeRequest.from_json(await request.body())
        answer = rt.keys.challenge_answer(msg.nonce, rt.node_id, rt.epoch)
        reply = ChallengeReply(node_id=rt.node_id, epoch=rt.epoch, answer=answer)
        return Response(reply.to_json(), media_type="application/json")

    @app.get("/internal/audit")
    async def audit() -> JSONResponse:
        e = rt.engine
        a, live, matchers = await rt.aengine.call(lambda: (e.audit(), e.num_requests(), e.grammar_matchers()))
        return JSONResponse(
            {
                "num_blocks": a.num_blocks,
                "free": a.free,
                "cached": a.cached,
                "in_use": a.in_use,
                "reserved": a.reserved,
                "live_requests": live,
                "grammar_matchers": matchers,
            }
        )

    @app.post("/internal/abort")
    async def abort(request: Request) -> JSONResponse:
        msg = AbortRequest.from_json(await request.body())
        await rt.aengine.abort(RequestId(msg.request_id))
        return JSONResponse({"ok": True})

    @app.post("/internal/drain")
    async def drain(request: Request) -> JSONResponse:
        body = await request.body()
        try:
            note = DrainNote.from_json(body) if body.strip() not in (b"", b"{}") else None
        except ValueError as exc:
            return JSONResponse({"error": f"the drain's body is not a DrainNote: {exc}"}, status_code=400)
        await rt.drain()
        migrated = await rt.mover.migrate_running() if note is not None and note.migrate else 0
        if note is not None and note.why_not is not None:
            log.warning("node %s draining without moving its prefixes (a plain drain): %s", rt.node_id,
                        note.why_not)  # fmt: skip
        elif note is not None and note.moved_prefixes:
            log.info("node %s draining: moved %d prefixes (%d bytes) to the nodes that take them next",
                     rt.node_id, note.moved_prefixes, note.moved_bytes)  # fmt: skip
        if migrated:
            log.info("node %s draining: %d running requests move to other nodes with their KV", rt.node_id,
                     migrated)  # fmt: skip
        return JSONResponse({"ok": True, "draining": True, "migrated": migrated})

    @app.post("/internal/undrain")
    async def undrain() -> JSONResponse:
        await rt.undrain()
        return JSONResponse({"ok": True, "draining": False, "epoch": rt.epoch})

    @app.post("/internal/evict")
    async def evict(request: Request) -> JSONResponse:
        body = await request.json()
        if body.get("all"):
            n = await rt.evict(None)
        else:
            hashes = [BlockHash(bytes.fromhex(h)) for h in body.get("block_hashes", [])]
            n = await rt.evict(hashes)
        return JSONResponse({"ok": True, "evicted": n})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)
