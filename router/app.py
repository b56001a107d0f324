"""The router's HTTP API on FastAPI: OpenAI's /v1/completions, /v1/chat/completions, /v1/responses and
/v1/models, Anthropic's /v1/messages and /v1/messages/count_tokens, vLLM's /tokenize and /detokenize,
/health (a readiness report: 200 while some node pair can serve, else 503), /metrics (behind the API key
unless `metrics_public`), and /docs, /redoc, /openapi.json only with `api_docs`.

Invariants: the routes only translate between HTTP and router/handler.py's RequestHandler, which does the
work and owns the BlockIndex it is given (the Anthropic and Responses routes through their own modules, which
translate onto the chat path); every error leaves as OpenAI's ErrorResponse (Anthropic's error shape on its
routes) (never FastAPI's
{"detail"}), the router's domain errors through router/errors.py's `to_openai`; a path with a trailing
slash is served as the path without it (no redirect, whose Location would echo the request's Host); a
client that leaves before its body is in is a ClientGone (499), not a 500.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pdserve.router.anthropic_api import AnthropicAPI, api_key
from pdserve.router.chat_bridge import with_reasoning
from pdserve.router.config import RouterConfig
from pdserve.router.errors import ClientGone, RouterError
from pdserve.router.handler import Incoming, Reply, RequestHandler, error_reply
from pdserve.router.openai_protocol import OpenAIError
from pdserve.router.responses_api import ResponsesAPI
from pdserve.router.tokenize_api import TokenizeAPI
from pdserve.shared.engine import grammar
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.model.tokenizer import Tokenizer, preload_chat_templates
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send


def _response(reply: Reply) -> Response:
    if reply.stream is not None:
        return StreamingResponse(
            reply.stream, media_type="text/event-stream", headers={"cache-control": "no-cache"}
        )
    return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)


async def _body(request: Request) -> AsyncIterator[bytes]:
    try:
        async for chunk in request.stream():
            yield chunk
    except ClientDisconnect as exc:
        raise ClientGone("the client left before it sent the whole request body") from exc


def _incoming(request: Request, authorization: str | None = None) -> Incoming:
    headers = request.headers
    authorization = authorization or headers.get("authorization")
    trace = {k: headers[k] for k in ("traceparent", "tracestate") if k in headers} or None
    return Incoming(
        authorization, _body(request), headers.get("content-length"), request.is_disconnected, trace
    )


class _NoTrailingSlash:
    """Serves `/v1/models/` as `/v1/models`, as OpenAI's API does, instead of redirecting."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            raw = scope.get("raw_path")
            scope = {**scope, "path": path.rstrip("/") or "/"}
            if raw:
                scope["raw_path"] = raw.rstrip(b"/") or b"/"
        await self.app(scope, receive, send)


def create_app(config: RouterConfig, tokenizer: Tokenizer, index: BlockIndex) -> FastAPI:
    # imported now, not by the first chat or constrained request (a second or two each, on the event loop
    # for a constraint's check); the nodes import them only when a request needs them
    preload_chat_templates()
    grammar.preload()
    handler = RequestHandler(config, tokenizer, index)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await handler.start()
        yield
        await handler.stop()

    docs = config.api_docs
    app = FastAPI(
        title="pdserve router",
        lifespan=lifespan,
        redirect_slashes=False,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.add_middleware(_NoTrailingSlash)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> Response:
        return _response(error_reply(exc))

    @app.exception_handler(RouterError)
    async def _router_error(_: Request, exc: RouterError) -> Response:
        return _response(error_reply(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return _response(error_reply(OpenAIError(400, f"{param}: {first['msg']}", param=param)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        code = "not_found" if exc.status_code == 404 else None
        return _response(error_reply(OpenAIError(exc.status_code, message, param=None, code=code)))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> Response:
        error = OpenAIError(500, f"internal router error: {exc!r}", "server_error", code="internal")
        return _response(error_reply(error))

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        return await handler.models(request.headers.get("authorization"))

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
        return await handler.model(model_id, request.headers.get("authorization"))

    @app.get("/health")
    async def health() -> Response:
        return _response(await handler.health())

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        page = handler.metrics_page(request.headers.get("authorization"))
        return Response(page, media_type=handler.metrics.content_type)

    parser = config.reasoning_parser

    async def chat(incoming: Incoming) -> Reply:
        reply = await handler.generate("chat", incoming)
        return reply if parser is None else with_reasoning(reply, parser)

    def post(path: str, handle: Callable[[Incoming], Awaitable[Reply]],
             incoming: Callable[[Request], Incoming] = _incoming) -> None:  # fmt: skip
        """A POST route that hands its request to `handle` as an Incoming and sends back the Reply."""

        async def endpoint(request: Request) -> Response:
            return _response(await handle(incoming(request)))

        app.add_api_route(path, endpoint, methods=["POST"], name=path)

    def anthropic_incoming(request: Request) -> Incoming:  # `anthropic-version` is accepted, whatever it says
        return _incoming(
            request, api_key(request.headers.get("x-api-key"), request.headers.get("authorization"))
        )

    anthropic = AnthropicAPI(chat, handler.count_prompt_tokens, config.max_request_bytes)
    responses = ResponsesAPI(chat, config.max_request_bytes)
    tokens = TokenizeAPI(handler, config.max_request_bytes)
    post("/v1/completions", lambda incoming: handler.generate("completions", incoming))
    post("/v1/chat/completions", chat)
    post("/v1/messages", anthropic.messages, anthropic_incoming)
    post("/v1/messages/count_tokens", anthropic.count_tokens, anthropic_incoming)
    post("/v1/responses", responses.create)
    post("/tokenize", tokens.tokenize)
    post("/detokenize", tokens.detokenize)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return _response(error_reply(responses.not_stored(response_id)))

    return app
