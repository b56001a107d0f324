"""Runs one node process: builds the engine and runtime, lets the role add its routes and transfer end,
serves the internal API with uvicorn, logs engine stats periodically, and tears everything down on exit
(deregistration included)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import uvicorn
import zmq
from fastapi import FastAPI
from pdserve.node.kv_events import KVEventsPublisher
from pdserve.node.node_announce import add_announce_routes
from pdserve.node.node_cli import NodeConfigs
from pdserve.node.node_routes import add_common_routes
from pdserve.node.node_runtime import NodeRuntime
from pdserve.node.node_stats import stats_loop
from pdserve.shared.cli.settings import StartupError
from pdserve.shared.engine.engine import LLMEngine
from pdserve.shared.index.block_index_types import BlockIndexError
from pdserve.shared.model.loader import ModelLoadError
from pdserve.shared.node.node_auth import NodeAuth, credential_digest
from pdserve.shared.node.node_protocol import NODE_KEEPALIVE_S
from pdserve.shared.node.node_sign import ClusterKeys, RequestVerifier
from pdserve.shared.tracing import tracing

log = logging.getLogger(__name__)

RoleSetup = Callable[
    [FastAPI, NodeRuntime, NodeConfigs], Awaitable[tuple[str, Callable[[], Awaitable[None]]]]
]
"""Adds the role's routes; returns (transfer address, async teardown)."""


def serve(cfg: NodeConfigs, setup: RoleSetup, protocol_version: int, log_stats_interval_s: float) -> int:
    """Serves until SIGINT/SIGTERM. A model that cannot load or a registration the index refuses raises
    StartupError (one line, no traceback): a refused node stops before it takes any request."""
    try:
        engine = LLMEngine(cfg.engine)
    except ModelLoadError as exc:
        raise StartupError(str(exc)) from exc
    keys = ClusterKeys(cfg.connector.auth_token)
    rt = NodeRuntime(cfg.node, engine, keys)
    rt.metrics.model_name = cfg.model_name
    rt.tracing = tracing(cfg.otlp_endpoint, f"pdserve-{cfg.node.role}", cfg.node.node_id)
    log.info(
        "KV pool: %d blocks of %d tokens (%d tokens)",
        engine.num_blocks,
        cfg.engine.block_size,
        engine.num_blocks * cfg.engine.block_size,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        transfer_addr, teardown = await setup(app, rt, cfg)
        if cfg.kv_events is not None:
            rt.kv_events = KVEventsPublisher(cfg.kv_events, cfg.engine.block_size)
            try:
                rt.kv_events.start()
            except zmq.ZMQError as exc:
                failure.append(StartupError(f"--kv-events-endpoint {cfg.kv_events.endpoint} (or its replay "
                                            f"endpoint): {exc}; pick a free address"))  # fmt: skip
        if not failure:
            try:
                await rt.start(transfer_addr, protocol_version, credential_digest(cfg.connector.auth_token))
            except BlockIndexError as exc:
                failure.append(exc)
        if failure:
            # Raised from here, uvicorn would print a traceback; the node never registered, so it stops
            # without deregistering (the id may belong to a live node) and serve() raises the one line.
            server.should_exit = True
            yield
            await rt.aengine.stop()
            await teardown()
            if rt.kv_events is not None:
                await rt.kv_events.close()
            return
        loop = asyncio.get_running_loop()
        leaving: list[asyncio.Future[None]] = []

        def rank_died(why: str) -> None:  # the watchdog's thread: the node leaves the cluster and exits
            def stop() -> None:
                log.error("node %s: tensor-parallel %s; deregistering and exiting", cfg.node.node_id, why)
                down.append(why)
                leaving.append(asyncio.ensure_future(rt.leave()))  # out of the index before the shutdown
                server.should_exit = True
                server.force_exit = True  # no waiting for open streams: their requests fail with the engine

            loop.call_soon_threadsafe(stop)

        engine.on_rank_failure(rank_died)
        stats = asyncio.create_task(stats_loop(rt, log_stats_interval_s))
        try:
            yield
        finally:
            stats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stats
            for left in leaving:
                await left
            await rt.stop()
            await teardown()
            rt.tracing.shutdown()
            if rt.kv_events is not None:
                await rt.kv_events.close()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    verifier = RequestVerifier(keys, cfg.node.auth_window_s)
    app.add_middleware(NodeAuth, verifier=verifier)  # every route but health and metrics
    add_common_routes(app, rt)
    add_announce_routes(app, rt)
    config = uvicorn.Config(
        app,
        host=cfg.node.host,
        port=cfg.node.port,
        log_level="warning",
        lifespan="on",
        timeout_keep_alive=NODE_KEEPALIVE_S,
    )
    server = uvicorn.Server(config)
    failure: list[BlockIndexError | StartupError] = []
    down: list[str] = []
    try:
        asyncio.run(server.serve())
    finally:
        engine.close()  # the other tensor-parallel ranks end with rank 0's node, on every path
    if failure:
        raise StartupError(f"node {cfg.node.node_id}: {type(failure[0]).__name__}: {failure[0]}")
    if down:
        raise StartupError(f"node {cfg.node.node_id}: tensor-parallel {down[0]}; the node stopped")
    return 0
