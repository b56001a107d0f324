"""Runs one node process: builds the engine and runtime, lets the role add its routes and transfer end,
serves the internal API with uvicorn, and tears everything down on exit (deregistration included)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import uvicorn
from fastapi import FastAPI
from pdserve.shared.engine import LLMEngine
from pdserve.shared.node_cli import configs
from pdserve.shared.node_protocol import NODE_KEEPALIVE_S
from pdserve.shared.node_runtime import NodeRuntime, add_common_routes, engine_kv_layout

log = logging.getLogger(__name__)

RoleSetup = Callable[
    [FastAPI, NodeRuntime, argparse.Namespace], Awaitable[tuple[str, Callable[[], Awaitable[None]]]]
]
"""Adds the role's routes; returns (transfer address, async teardown)."""


def serve(args: argparse.Namespace, role: str, setup: RoleSetup, protocol_version: int) -> int:
    engine_cfg, settings = configs(args, role)
    engine = LLMEngine(engine_cfg)
    rt = NodeRuntime(settings, engine, engine_kv_layout(engine))
    log.info(
        "KV pool: %d blocks of %d tokens (%d tokens)",
        engine.num_blocks,
        engine_cfg.block_size,
        engine.num_blocks * engine_cfg.block_size,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        transfer_addr, teardown = await setup(app, rt, args)
        await rt.start(transfer_addr, protocol_version)
        try:
            yield
        finally:
            await rt.stop()
            await teardown()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    add_common_routes(app, rt)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        lifespan="on",
        timeout_keep_alive=NODE_KEEPALIVE_S,
    )
    server = uvicorn.Server(config)
    asyncio.run(server.serve())
    return 0
