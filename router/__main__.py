"""`python -m pdserve.router` (= `pdserve router`): one router process.

The only place a RouterConfig is built from settings (flags, PDSERVE_* variables or the --config file;
API keys and the Redis password from the environment or files). The router loads the model's tokenizer
only (never weights), learns nodes, block size and fingerprint from the Redis index, and serves until
SIGINT/SIGTERM. Imports nothing heavy until it runs, so `--help` answers at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import TYPE_CHECKING, Literal

from pdserve.shared.cli.settings import (
    ClusterMember,
    CommaList,
    LogLevel,
    StartupError,
    chat_template_text,
    check_model_path,
    read_secret,
)
from pydantic import Field

if TYPE_CHECKING:
    from pdserve.router.config import RouterConfig

log = logging.getLogger("pdserve.router")


class RouterOptions(ClusterMember):
    model: str = Field(
        description="model file or directory (only its tokenizer and chat template are loaded)"
    )
    chat_template: str | None = Field(
        None,
        description="a Jinja chat template, or a file holding one, instead of the model's (every node needs "
        "the same one)",
    )
    served_model_name: CommaList = Field(
        (),
        description="the model id(s) clients pass as `model` (repeat or comma-separate for aliases; "
        "the first is the id responses carry; default: the model's file name)",
    )
    redis: str = Field(
        description="redis://, rediss://, unix:// or redis+sentinel://host:port[,host:port]/service URL of "
        "the block index and of the fleet's admission ledger"
    )
    redis_cluster: str = Field("default", description="the cluster name of the index's keys")
    host: str = Field("127.0.0.1", description="address the OpenAI API listens on")
    port: int = Field(8000, ge=0, le=65535, description="port of the OpenAI API")
    deadline: float = Field(600.0, gt=0, description="default request deadline, seconds")
    max_deadline: float = Field(3600.0, gt=0, description="cap on a request's `timeout`, seconds")
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1, description="largest request body, bytes")
    max_request_bytes_per_token: int = Field(
        32,
        ge=1,
        description="a body may also hold at most this many bytes per token of the nodes' context "
        "(max_model_len): larger ones get 413 before they are parsed or tokenized",
    )
    header_timeout: float = Field(
        10.0, gt=0, description="seconds a connection may take to send a request's headers; then it is closed"
    )
    body_timeout: float = Field(
        60.0,
        gt=0,
        description="seconds a request may take to send its body after its headers; then it is closed",
    )
    max_connections_per_client: int = Field(
        1024,
        ge=0,
        description="connections one client address may hold open; more get 429 and are closed (0: no cap; "
        "behind a proxy, every client has the proxy's address)",
    )
    api_docs: bool = Field(False, description="serve /docs, /redoc and /openapi.json")
    max_n: int = Field(16, ge=1, description="cap on n x prompts of one request")
    node_list_ttl: float = Field(
        1.0,
        gt=0,
        description="seconds between two reads of the node list from Redis (and health checks of "
        "nodes Redis does not list)",
    )
    seed_nodes: CommaList = Field(
        (),
        description="node HTTP URLs (comma-separated) asked for their registration when Redis does not list "
        "them: a router started while Redis is away still finds its nodes",
    )
    local_prefill_max_tokens: int = Field(
        0, ge=0, description="prefill on the decode node when it would compute at most this many tokens"
    )
    cost_model: bool = Field(
        False,
        description="choose per request between prefill on D, on P, and on P after fetching a holder's "
        "prefix by the learned cost model (estimates are exported either way)",
    )
    api_keys_file: str | None = Field(
        None,
        description="file of accepted API keys, one per line or comma-separated (else PDSERVE_API_KEYS is "
        "read; none: any client is accepted)",
    )
    metrics_public: bool = Field(
        False, description="serve /metrics without an API key (by default it asks for one when keys are set)"
    )
    rate_limit: float = Field(
        0.0,
        ge=0,
        description="requests per second each API key may sustain (a token bucket; over it: 429 with "
        "Retry-After; 0: unlimited)",
    )
    rate_limit_burst: int = Field(10, ge=1, description="requests an API key may send at once (bucket size)")
    max_requests_per_node: int = Field(
        0,
        ge=0,
        description="requests kept in flight on one node at most (by this router, or by the fleet with "
        "--admission redis); more wait in the router's queue (0: no limit)",
    )
    admission: Literal["local", "redis"] = Field(
        "local",
        description="where --max-requests-per-node is counted: local (this router's own requests; one "
        "router) or redis (leases in the index's Redis shared by every router of the cluster, so the cap "
        "holds for the fleet; give it to every router behind one load balancer)",
    )
    max_queued_requests: int = Field(
        1024,
        ge=0,
        description="requests that may wait for a node below its limit; beyond: 429 with Retry-After",
    )
    migration_limit: int = Field(
        3,
        ge=0,
        description="times a stream whose node fails after its first token is re-prefilled on other nodes "
        "from its prompt and the tokens already sent, and goes on (0: it ends with an error)",
    )
    reasoning_parser: Literal["qwen3"] | None = Field(
        None,
        description="split a thinking model's thoughts from its answer: chat responses carry them as "
        "`reasoning_content` (qwen3: the <think>...</think> at the start of the output)",
    )
    log_level: LogLevel = Field(
        "INFO",
        description="log level of the router and of its HTTP server (INFO and below: one access-log "
        "line per request)",
    )


def router_config(opts: RouterOptions) -> RouterConfig:
    """The frozen RouterConfig; raises SettingsError (model not on disk, unreadable secret) or ValueError."""
    from pdserve.router.admission import AdmissionConfig
    from pdserve.router.config import RouterConfig
    from pdserve.router.policy import PolicyConfig
    from pdserve.router.tenants import RateLimit

    model = check_model_path(opts.model)
    keys = read_secret("api_keys", "the API keys", opts.api_keys_file, required=False) or ""
    token = opts.auth_token()
    names = opts.served_model_name or (os.path.basename(os.path.normpath(model)),)
    return RouterConfig(
        model_path=model,
        served_model_name=names[0],
        served_model_aliases=names[1:],
        redis=opts.redis_config(opts.redis, opts.redis_cluster),
        host=opts.host,
        port=opts.port,
        default_deadline_s=opts.deadline,
        max_deadline_s=opts.max_deadline,
        max_request_bytes=opts.max_request_bytes,
        max_request_bytes_per_token=opts.max_request_bytes_per_token,
        header_timeout_s=opts.header_timeout,
        body_timeout_s=opts.body_timeout,
        max_connections_per_client=opts.max_connections_per_client,
        api_docs=opts.api_docs,
        max_n=opts.max_n,
        node_list_ttl_s=opts.node_list_ttl,
        seed_nodes=opts.seed_nodes,
        migration_limit=opts.migration_limit,
        otlp_endpoint=opts.trace_endpoint(),
        cost_model=opts.cost_model,
        policy=PolicyConfig(local_prefill_max_tokens=opts.local_prefill_max_tokens),
        admission=AdmissionConfig(
            opts.max_requests_per_node, opts.max_queued_requests, fleet=opts.admission == "redis"
        ),
        api_keys=tuple(k.strip() for k in keys.replace(",", "\n").splitlines() if k.strip()),
        metrics_public=opts.metrics_public,
        node_token=token,
        rate_limit=RateLimit(opts.rate_limit, opts.rate_limit_burst) if opts.rate_limit else None,
        reasoning_parser=opts.reasoning_parser,
    )


def run(opts: RouterOptions) -> int:
    """Serves until SIGINT/SIGTERM; SettingsError, ValueError or OSError before serving propagate."""
    config = router_config(opts)  # before the heavy imports: a bad setting fails at once
    template = chat_template_text(opts.chat_template)

    import uvicorn
    from pdserve.router.app import create_app
    from pdserve.router.front_guard import FrontGuard
    from pdserve.router.request_log import RequestLog
    from pdserve.shared.index.block_index import BlockIndex
    from pdserve.shared.model.loader import ModelLoadError, load_tokenizer

    logging.basicConfig(level=opts.log_level, format="%(asctime)s router %(levelname)s %(name)s: %(message)s")
    if opts.log_level != "DEBUG":  # httpx2 logs every call to a node at INFO: the access log is per request
        logging.getLogger("httpx2").setLevel(logging.WARNING)
    try:
        tokenizer = load_tokenizer(config.model_path)
    except ModelLoadError as exc:
        raise StartupError(str(exc)) from exc
    if template is not None:  # the nodes are given the same one (their tokenizer fingerprints must agree)
        tokenizer.chat_template = template
    from pdserve.shared.node.node_sign import ClusterKeys

    app = create_app(config, tokenizer, BlockIndex(config.redis, ClusterKeys(config.node_token)))
    log.info(
        "router for %s (model %s) starting on http://%s:%d; index: Redis at %s, cluster %r; nodes seen: %s",
        ", ".join(config.served_model_names), config.model_path, config.host, config.port,
        config.redis.address, config.redis.cluster, asyncio.run(_nodes_seen(config)),
    )  # fmt: skip
    guard = FrontGuard(config.header_timeout_s, config.body_timeout_s, config.max_connections_per_client)
    # log_config=None: uvicorn's loggers (its access log among them) go through the format set above, at
    # the same --log-level
    uvicorn.run(
        guard.wrap(RequestLog(app)),
        http=guard.protocol(),
        host=config.host,
        port=config.port,
        log_level=opts.log_level.lower(),
        log_config=None,
        access_log=True,
        timeout_graceful_shutdown=5,
    )
    return 0


async def _nodes_seen(config: RouterConfig) -> str:
    from pdserve.shared.index.block_index import BlockIndex
    from pdserve.shared.index.block_index_types import IndexUnavailable
    from pdserve.shared.node.node_sign import ClusterKeys

    async with BlockIndex(config.redis, ClusterKeys(config.node_token)) as index:
        try:
            nodes = await index.nodes()
        except IndexUnavailable as exc:
            return f"none yet (the index does not answer: {exc})"
    seen = [f"{s.info.node_id} ({s.info.role}{', draining' if s.draining else ''})" for s in nodes]
    return ", ".join(seen) or "none yet"


def main(argv: list[str] | None = None) -> int:
    from pdserve.cli.main import main as cli_main

    return cli_main(["router", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
