"""RouterConfig: the one configuration of a router process, validated at construction and frozen.

Built from settings in router/__main__.py only. Values learned at run time (nodes, block size, model
fingerprint, max_model_len) live in the app's runtime state, never here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.router.admission import AdmissionConfig
from pdserve.router.breaker import BreakerConfig
from pdserve.router.policy import PolicyConfig
from pdserve.router.reasoning import REASONING_PARSERS
from pdserve.router.tenants import RateLimit
from pdserve.shared import checks
from pdserve.shared.index.block_index_types import RedisConfig


@dataclass(frozen=True)
class RouterConfig:
    model_path: str
    """The model file or directory; the router loads only its tokenizer and chat template."""
    served_model_name: str
    """The id clients pass as `model`, that responses carry and that /v1/models lists first."""
    redis: RedisConfig
    """Where the block index lives (AUTH and TLS settings included)."""
    host: str = "127.0.0.1"
    port: int = 8000
    default_deadline_s: float = 600.0
    """A request's deadline when it sets no `timeout`; the same absolute deadline goes to every node."""
    max_deadline_s: float = 3600.0
    """Upper bound on a client's `timeout` extension."""
    max_request_bytes: int = 8 * 1024 * 1024
    """Largest request body, bytes, whatever the context."""
    max_request_bytes_per_token: int = 32
    """A body may hold at most this many bytes per token of the nodes' context (max_model_len), so that a
    body no prompt could fit is refused before it is parsed or tokenized (the lower of the two limits
    applies; several prompts in one request share it)."""
    header_timeout_s: float = 10.0
    """Seconds a connection may take to send a request's headers (from its opening or the end of the
    previous response); then it is closed (router/front_guard.py)."""
    body_timeout_s: float = 60.0
    """Seconds a request may take to send its whole body once its headers are in; then it is closed."""
    max_connections_per_client: int = 1024
    """Connections one client address may hold open at once; more are answered 429 and closed (0: no cap;
    behind a proxy every client shares the proxy's address)."""
    api_docs: bool = False
    """Serve /docs, /redoc and /openapi.json."""
    max_n: int = 16
    """Upper bound on `n` times the number of prompts of one request (each is a node request)."""
    node_list_ttl_s: float = 1.0
    """How often the router asks Redis for the node list (and checks the health of nodes Redis no longer
    lists, or of every node while Redis is away)."""
    seed_nodes: tuple[str, ...] = ()
    """Node HTTP URLs asked for their registration when Redis does not list them (a router started while
    Redis is away still finds the nodes)."""
    disconnect_poll_s: float = 0.25
    """How often a non-streaming request checks whether its client went away."""
    node_connect_timeout_s: float = 5.0
    max_connections_per_node: int = 512
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    """How a node whose connection was refused or reset is probed back into routing."""
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    """Per-node in-flight limit and the queue in front of it (router/admission.py)."""
    migration_limit: int = 3
    """Times a choice whose node fails after its first token may be re-prefilled on other nodes from its
    prompt and the tokens already streamed (router/migration.py); 0: it ends with the error. On by default:
    a client's stream outlives one node (a choice that keeps failing stops after 3 moves)."""
    otlp_endpoint: str | None = None
    """The OTLP/HTTP collector the router's request spans go to (shared/tracing.py); None: not traced."""
    cost_model: bool = False
    """Let the cost model (router/cost_model.py) choose, per request, between prefilling on D, on P, and on P
    after fetching a holder's prefix; off: P/D whenever a prefill node exists (local only below
    `policy.local_prefill_max_tokens`) and a fetch whenever another node holds more of the prefix. Its
    estimates are exported either way."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """Routing weights (the block size is the nodes' own, from their registrations)."""
    api_keys: tuple[str, ...] = ()
    """Accepted bearer keys (`Authorization: Bearer <key>` only); empty accepts any client. A key's digest is
    its tenant's cache salt, which a client's `cache_salt` narrows but never replaces (router/tenants.py)."""
    node_token: str = ""
    """The cluster's credential (the KV-transfer token), required: it signs every call to a node and verifies
    every node record the router reads (shared/node/node_sign.py); it is never sent."""
    rate_limit: RateLimit | None = None
    """Each API key's token bucket (requests per second, burst); over it a request gets 429 with
    Retry-After. None: unlimited. Applies to /v1/completions and /v1/chat/completions when api_keys is set."""
    served_model_aliases: tuple[str, ...] = ()
    """More ids clients may pass as `model` (listed by /v1/models after served_model_name)."""
    metrics_public: bool = False
    """Serve /metrics without an API key (by default it asks for one, as every /v1 route, when api_keys is
    set)."""

    reasoning_parser: str | None = None
    """Split chat answers' thoughts into `reasoning_content` with this parser (router/reasoning.py; one of
    REASONING_PARSERS); None: the text stays as the model wrote it."""

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is empty")
        if not self.node_token:
            raise ValueError("node_token is empty: give the cluster's KV-transfer token (PDSERVE_AUTH_TOKEN)")
        if not self.served_model_name or not all(self.served_model_aliases):
            raise ValueError("served_model_name and every alias must be non-empty")
        checks.port(self, "port")
        checks.above(self, 0, "default_deadline_s", "max_deadline_s", "node_list_ttl_s", "disconnect_poll_s",
                     "header_timeout_s", "body_timeout_s", "node_connect_timeout_s")  # fmt: skip
        if self.default_deadline_s > self.max_deadline_s:
            raise ValueError(f"default_deadline_s {self.default_deadline_s} exceeds max_deadline_s")
        checks.at_least(self, 0, "migration_limit", "max_connections_per_client")
        checks.at_least(
            self, 1, "max_request_bytes", "max_request_bytes_per_token", "max_n", "max_connections_per_node"
        )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser {self.reasoning_parser!r} is not one of {list(REASONING_PARSERS)}"
            )

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.served_model_aliases)
