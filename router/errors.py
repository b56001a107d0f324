"""The router's domain errors: what routing, admission, the model check and dispatch raise when a request
cannot be placed or a node fails it, and `to_openai`, the one place that turns them into OpenAI errors.

Invariants: below the request handler (router/handler.py) nothing builds an OpenAIError for a routing or
node outcome; each RouterError class maps to exactly one HTTP status, error type and code, in `_OPENAI`.
OpenAI request validation (router/openai_protocol.py) and API keys (router/tenants.py) are the API's own
refusals and raise OpenAIError directly.
"""

from __future__ import annotations

from pdserve.router.openai_protocol import OpenAIError


class RouterError(Exception):
    """Base of the domain errors; `message` is what the client reads."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        """Seconds a client should wait before it tries again (Retry-After), where that is known."""


class NoNodes(RouterError):
    """No live node (or no usable pair) can take the request."""


class NodeUnavailable(RouterError):
    """The node chosen for a request could not be reached, refused it, or died under it."""


class ModelMismatch(RouterError):
    """The nodes serve another model or tokenizer than the router's."""


class QueueFull(RouterError):
    """Every node is at its in-flight limit and the admission queue is full."""


class NoRoom(RouterError):
    """No node had room for the request before its deadline."""


class DeadlineExceeded(RouterError):
    """The request's deadline passed."""


class NodeAborted(RouterError):
    """A node aborted the request."""


class NodeFailed(RouterError):
    """A node failed the request with an error."""


class ClientGone(RouterError):
    """The client closed the connection."""


class Internal(RouterError):
    """A bug in the router: the request fails with its cause instead of waiting for its deadline."""


_OPENAI: dict[type[RouterError], tuple[int, str, str]] = {
    NoNodes: (503, "server_error", "no_nodes"),
    NodeUnavailable: (503, "server_error", "node_unavailable"),
    ModelMismatch: (503, "server_error", "model_mismatch"),
    QueueFull: (429, "rate_limit_exceeded", "overloaded"),
    NoRoom: (503, "server_error", "overloaded"),
    DeadlineExceeded: (504, "timeout_error", "deadline_exceeded"),
    NodeAborted: (503, "server_error", "aborted"),
    NodeFailed: (500, "server_error", "node_error"),
    ClientGone: (499, "invalid_request_error", "client_disconnect"),
    Internal: (500, "server_error", "internal"),
}


def to_openai(exc: RouterError) -> OpenAIError:
    """The OpenAI error a client gets for a domain error."""
    status, type_, code = _OPENAI[type(exc)]
    headers = None if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
    return OpenAIError(status, exc.message, type_, code=code, headers=headers)
