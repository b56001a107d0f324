"""What every node process shares whatever its role: the engine in its thread, its presence in the Redis
index (node/index_presence.py: registration, heartbeat, block records), drain and evict.

Invariants: a drained node takes no new request and deregisters when its last one ends (the heartbeat loop
sees it idle). The node owns its state in Redis: every heartbeat rewrites its load (drain flag included)
signed with the cluster's record key, so a field someone else writes there is ignored by readers and undone
within a heartbeat; draining and undraining take effect in the index through an immediate signed heartbeat.
The pool's events have one reader, the publish loop, which feeds the index and the KV-events publisher.
The node's current role is `role` (runtime state; node/role_change.py changes it and registers the node
under it with a new epoch, its held blocks resent); `refuses` gates the role's routes by it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.node.drain_migrate import RequestMover
from pdserve.node.index_presence import Holdings, IndexPresence
from pdserve.node.node_metrics import NodeMetrics
from pdserve.shared.engine.async_engine import AsyncEngine, EngineDead
from pdserve.shared.engine.block_pool import BlockEvent
from pdserve.shared.engine.engine import EngineSnapshot, LLMEngine
from pdserve.shared.index.block_digest import IndexTruth
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import NodeInfo, NodeLoad, RedisConfig
from pdserve.shared.node.node_sign import ClusterKeys
from pdserve.shared.tracing import NO_TRACING, Tracing

if TYPE_CHECKING:
    from pdserve.node.kv_events import KVEventsPublisher
from pdserve.shared.types import ROLES, BlockHash, NodeId, Role

log = logging.getLogger(__name__)


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
        self.presence: IndexPresence | None = None
        """The node's registration in the index (None without Redis)."""
        if settings.redis is not None:
            index = BlockIndex(settings.redis, keys)
            held = functools.partial(self.aengine.call, engine.held_hashes)
            truth = IndexTruth(index, self.node_id, held, self.metrics.registry)
            load = functools.partial(self.aengine.call, self.load)
            self.presence = IndexPresence(index, self.node_id, truth, load, self._holdings)
        self.role: Role = settings.role
        """The role the node serves as now (`settings.role` at start; node/role_change.py changes it)."""
        self.changing_role = False
        """A role change is under way: the node takes no new work and shows as draining in the index."""
        self.draining = False
        self._tasks: list[asyncio.Task[None]] = []
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
    def epoch(self) -> int:
        """The node's registration epoch in the index (0 before it registered, or without Redis)."""
        return 0 if self.presence is None else self.presence.epoch

    @property
    def truth(self) -> IndexTruth | None:
        return None if self.presence is None else self.presence.truth

    @property
    def registration(self) -> NodeInfo | None:
        """The node's registration with its current epoch (None before it registered)."""
        info = None if self.presence is None else self.presence.info
        return None if info is None else dataclasses.replace(info, epoch=self.epoch)

    def _registered(self) -> IndexPresence | None:
        """The node's presence while it is registered (None without Redis, before start or after leaving)."""
        p = self.presence
        return p if p is not None and p.info is not None and not p.deregistered else None

    async def _holdings(self) -> Holdings:
        engine = self.engine
        return await self.aengine.call(lambda: (engine.held_hashes(), engine.host_hashes()))

    async def start(self, transfer_addr: str, protocol_version: int, credential_digest: str) -> None:
        """Starts the engine and registers; IncompatibleNode (another model, KV layout, protocol version or
        credential than the live nodes') propagates, so a refused node stops before it serves."""
        self.aengine.start()
        self.metrics.engine_counts(EngineSnapshot(kv_total_blocks=self.engine.num_blocks))  # nothing runs yet
        if self.presence is not None:
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
            await self.presence.register(info)  # IncompatibleNode propagates: refuse to start
            log.info("node %s registered as %s, epoch %d", self.node_id, self.settings.role, self.epoch)
            self._tasks.append(asyncio.create_task(self._heartbeat_loop()))
            self._tasks.append(asyncio.create_task(self._publish_loop()))
        elif self.kv_events is not None:
            self._tasks.append(asyncio.create_task(self._publish_loop()))

    async def stop(self) -> None:
        await self.leave()
        if self.presence is not None:
            await self.presence.index.close()
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
        if self.presence is not None:
            await self.presence.deregister(quiet=True)

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
        presence = self.presence
        assert presence is not None
        while True:
            load = await self.aengine.call(self.load)
            self.metrics.engine_counts(load)
            await self.mover.expire_due()
            held = self.requests_outside_engine() + self.mover.pinned()  # pinned: moved, not pulled yet
            idle = load.running == 0 and load.waiting == 0 and held == 0
            if self.draining and idle and not presence.deregistered:
                await presence.deregister(quiet=False)
                if presence.deregistered:
                    log.info("node %s drained and deregistered", self.node_id)
            elif not presence.deregistered:
                await self._beat(presence, load)
            await asyncio.sleep(self.settings.heartbeat_s)

    async def _beat(self, presence: IndexPresence, load: NodeLoad) -> None:
        # a drain (or role change) since `load` was read stands
        await presence.beat(dataclasses.replace(load, draining=self.draining or self.changing_role))

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
            presence = self.presence
            if presence is not None and not presence.deregistered and (presence.need_resync or events):
                await presence.publish(events)
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

    async def drain(self) -> None:
        """Takes no new work: shown in the index at once (a signed heartbeat), so routers stop choosing it."""
        self.draining = True
        await self.beat_now()

    async def undrain(self) -> None:
        """Takes new work again: clears its draining mark in the index (a signed heartbeat), or registers anew
        (a new epoch, its held blocks resent) when the drained node had already deregistered."""
        self.draining = False
        p = self.presence
        if p is not None and p.info is not None and p.deregistered:
            await p.register(p.info)
        else:
            await self.beat_now()

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
        presence = self._registered()
        if presence is not None:
            await self._beat(presence, await self.aengine.call(self.load))

    async def register_as(self, role: Role, transfer_addr: str) -> None:
        """Serves as `role` from now on: registers under it with a new epoch and has the publish loop resend
        every block it holds under that epoch, so its prefix cache stays in the index under the node.
        BlockIndexError (the index refused or did not answer) leaves the node in its old role."""
        old = self.role
        if self.presence is not None and self.presence.info is not None:
            await self.presence.register(self.presence.registered_as(role, transfer_addr))
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
