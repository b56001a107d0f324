"""The settings every node process takes (flags, PDSERVE_* variables or the --config file), and turning them
into the node's frozen configs. Only entry points call this; the transfer token and the Redis password come
from the environment or files (shared/cli/settings.py), never from argv."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pdserve.shared.cli.engine_args import EngineOptions, engine_config
from pdserve.shared.cli.settings import ClusterMember, LogLevel, SettingsError, check_model_path
from pdserve.shared.types import Role
from pydantic import Field, field_validator

if TYPE_CHECKING:
    from pdserve.kvtransfer.connector import ConnectorConfig
    from pdserve.node.kv_events import KVEventsConfig
    from pdserve.node.node_runtime import NodeSettings
    from pdserve.shared.engine.config import EngineConfig

Connector = Literal["tcp", "ucx", "nccl", "cuda_ipc"]
"""The connector kinds kvtransfer registers (a test keeps the two lists equal; importing it loads torch)."""


class NodeOptions(EngineOptions, ClusterMember):
    node_id: str = Field(description="this node's id in the cluster (unique; letters, digits, '_', '.', '-')")
    host: str = Field("127.0.0.1", description="address of the internal HTTP API and the transfer listener")
    port: int = Field(ge=1, le=65535, description="port of the node's internal HTTP API")
    redis: str | None = Field(
        None,
        description="redis://, rediss://, unix:// or redis+sentinel://host:port[,host:port]/service URL of "
        "the block index (default: no index)",
    )
    cluster: str = Field("default", description="the cluster name of the index's keys")
    transfer_port: int = Field(0, ge=0, le=65535, description="KV-transfer listener port (0: a free one)")
    transfer_advertise: str | None = Field(
        None,
        description="the KV-transfer address announced to the cluster, <connector>://<host>:<port>, when "
        "prefill nodes reach this one through another address (a NAT, a proxy; default: the listener's)",
    )
    connector: Connector = Field("tcp", description="KV connector")
    no_checksum: bool = Field(False, description="skip frame checksums (NVLink/RDMA links check integrity)")
    transfer_liveness_s: float = Field(
        5.0,
        gt=0,
        description="seconds without a byte from a KV-transfer peer (they ping each other) before its "
        "connection is cut and its transfers fail over",
    )
    heartbeat_s: float = Field(1.0, gt=0, description="seconds between heartbeats to the index")
    auth_window_s: float = Field(
        30.0,
        gt=0,
        description="seconds a signed internal request's timestamp may differ from this node's clock; its "
        "nonce is remembered as long, so a replay inside the window is refused too",
    )
    log_level: LogLevel = Field("INFO", description="log level")
    kv_events_endpoint: str | None = Field(
        None,
        description="ZMQ PUB address for KV events in vLLM's format, e.g. tcp://*:5557 (bound when it has a "
        "wildcard, else connected; default: none published)",
    )
    kv_events_replay_endpoint: str | None = Field(
        None, description="ZMQ ROUTER address that replays missed KV-event batches, e.g. tcp://*:5558"
    )
    kv_events_topic: str = Field("", description="the topic frame of every KV-event message")
    kv_events_hash: Literal["int64", "bytes"] = Field(
        "int64",
        description="block hashes in KV events: the first 8 bytes of pdserve's SHA-256 as a signed int64 "
        "(64-bit indexers), or all 32 bytes",
    )
    served_model_name: str | None = Field(
        None, description="the model_name label of the vllm:* metrics (default: the model's file name)"
    )
    log_stats_interval_s: float = Field(
        10.0,
        ge=0,
        description="seconds between stats log lines (running, waiting, KV use, throughput); 0: off",
    )

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, value: str) -> str:
        """Checked here, before the model loads, as the index checks it (block_index_types.NodeInfo)."""
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", value):
            raise ValueError("use letters, digits, '_', '.', '-' only")
        return value


class PrefillOptions(NodeOptions):
    layers_per_frame: int = Field(
        4,
        ge=1,
        description="consecutive layers of a prefill step sent as one KV-transfer frame (1: one per layer); "
        "4 is the best measured (docs/benchmarks.md)",
    )


class DecodeOptions(NodeOptions):
    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute",
        description="when a request's KV transfer fails: compute its prompt on this node within the "
        "request's deadline (recompute), or end the request with an error (fail)",
    )


@dataclass(frozen=True)
class NodeConfigs:
    """Everything one node process runs with, validated: the engine's, the node's and the connector's."""

    engine: EngineConfig
    node: NodeSettings
    connector: ConnectorConfig
    model_name: str
    """The `model_name` label of the node's vllm:* metrics."""
    layers_per_frame: int = 4
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    transfer_advertise: str | None = None
    """The transfer address announced in the index (None: the listener's own)."""
    otlp_endpoint: str | None = None
    """The OTLP/HTTP collector of the node's request spans (shared/tracing.py); None: not traced."""
    kv_events: KVEventsConfig | None = None
    """The KV-events publisher in vLLM's format (node/kv_events.py); None: none."""


def node_configs(opts: NodeOptions, role: Role) -> NodeConfigs:
    """The node's frozen configs; raises SettingsError (missing secret, model not on disk, connector not
    installed) or ValueError.
    The cheap checks come first, so a bad start fails before torch loads."""
    token = opts.auth_token()
    check_model_path(opts.model)
    if opts.connector == "ucx" and importlib.util.find_spec("ucxx") is None:
        raise SettingsError("--connector ucx needs ucxx: install the [ucx] extra (pdserve[ucx])")
    redis = opts.redis_config(opts.redis, opts.cluster) if opts.redis else None

    from pdserve.kvtransfer.connector import ConnectorConfig
    from pdserve.node.node_runtime import NodeSettings

    node = NodeSettings(
        opts.node_id, role, opts.host, opts.port, redis, opts.heartbeat_s, auth_window_s=opts.auth_window_s
    )
    connector = ConnectorConfig(
        kind=opts.connector,
        auth_token=token,
        checksum=False if opts.no_checksum else None,  # None: the connector's default (off on NVLink)
        device=opts.device.split(",")[0],  # rank 0's GPU: the transfer runs there
        listen_host=opts.host,
        listen_port=opts.transfer_port,
        liveness_s=opts.transfer_liveness_s,
    )
    if opts.transfer_advertise is not None:
        from pdserve.kvtransfer.transport import parse_address

        parse_address(opts.transfer_advertise, opts.connector)  # ValueError naming the expected form
    frames = opts.layers_per_frame if isinstance(opts, PrefillOptions) else 4
    policy = opts.kv_load_failure_policy if isinstance(opts, DecodeOptions) else "recompute"
    engine = engine_config(opts)
    name = opts.served_model_name or os.path.basename(os.path.normpath(engine.model))
    kv_events = None
    if opts.kv_events_endpoint is not None:
        from pdserve.node.kv_events import KVEventsConfig

        kv_events = KVEventsConfig(
            opts.kv_events_endpoint, opts.kv_events_replay_endpoint, opts.kv_events_hash, opts.kv_events_topic
        )
    elif opts.kv_events_replay_endpoint is not None:
        raise SettingsError(
            "--kv-events-replay-endpoint replays what --kv-events-endpoint publishes: set both, or neither"
        )
    return NodeConfigs(
        engine,
        node,
        connector,
        name,
        frames,
        policy,
        opts.transfer_advertise,
        opts.trace_endpoint(),
        kv_events,
    )


def setup_process(opts: NodeOptions) -> None:
    """Logging format and torch threads of a node process (before the engine loads)."""
    logging.basicConfig(
        level=opts.log_level, format=f"%(asctime)s {opts.node_id} %(levelname)s %(name)s: %(message)s"
    )
    if opts.threads:
        import torch

        torch.set_num_threads(opts.threads)
