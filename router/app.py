"""The router's OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions, /v1/models,
/health (a readiness report: 200 while some node pair can serve, else 503), /metrics.

Invariants: every error leaves as OpenAI's ErrorResponse (never FastAPI's {"detail"}); the router
tokenizes (chat template included) and only token ids go to the nodes; a request ends on every path
(finish, node failure, deadline, client disconnect, streaming or not) with its node requests aborted
where they may still run (router/dispatch.py). The app owns the BlockIndex it is given and closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pdserve.router.admission import Ledger
from pdserve.router.breaker import Breakers
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Background, ChoiceEvent, ChoiceJob, RequestRun
from pdserve.router.membership import Membership
from pdserve.router.metrics import RouterMetrics
from pdserve.router.model_check import ModelCheck
from pdserve.router.node_client import NodeClients
from pdserve.router.openai_builders import ResponseHead, models_response, usage
from pdserve.router.openai_protocol import (
    GenerationSpec,
    OpenAIError,
    check_token_ids,
    parse_chat,
    parse_completion,
    parse_json_body,
)
from pdserve.router.policy import NodeView, NoNodeAvailable, choose
from pdserve.router.request_log import REQUEST_ID
from pdserve.router.routing import Placement, Router
from pdserve.router.tenants import Tenants, cache_salt
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import ROLES
from pdserve.shared.model.tokenizer import Tokenizer
from pdserve.shared.node.node_auth import credential_digest
from pdserve.shared.node.node_protocol import TokenLogprob
from pdserve.shared.types import RequestId
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


@dataclass
class _Choice:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    offset: int = 0
    last_token_at: float | None = None


@dataclass
class _Request:
    """One client request being served: its spec, routes, response head and per-choice progress."""

    spec: GenerationSpec
    head: ResponseHead
    prompt_lens: list[int]
    echo: list[str]
    run: RequestRun
    arrival: float
    choices: dict[int, _Choice]
    first_token_seen: bool = False

    def usage(self) -> dict[str, Any]:
        n = self.spec.n
        done = self.choices.values()
        cached = sum(self.choices[p * n].cached_tokens for p in range(len(self.prompt_lens)))
        return usage(sum(self.prompt_lens), sum(c.completion_tokens for c in done), cached)


def _error(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def create_app(config: RouterConfig, tokenizer: Tokenizer, index: BlockIndex) -> FastAPI:
    metrics = RouterMetrics()
    background = Background()
    clients = NodeClients(config.node_connect_timeout_s, config.max_connections_per_node, config.node_token)
    breakers = Breakers(config.breaker, clients.probe, metrics)
    clients.on_down = breakers.trip
    membership = Membership(index, clients, breakers, metrics, config.node_list_ttl_s, config.seed_nodes)
    ledger = Ledger(config.admission)
    model_check = ModelCheck(config.model_path, tokenizer)
    router = Router(
        index, clients, config.policy, membership, metrics, background, breakers, ledger, model_check
    )
    started = int(time.time())
    served = set(config.served_model_names)
    tenants = Tenants(config.api_keys, config.rate_limit)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await model_check.prepare()
        watch = asyncio.create_task(membership.run())
        yield
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        await breakers.aclose()
        await background.drain()
        await clients.aclose()
        await index.close()

    app = FastAPI(title="pdserve router", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return _error(OpenAIError(400, f"{param}: {first['msg']}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        code = "not_found" if exc.status_code == 404 else None
        return _error(OpenAIError(exc.status_code, message, param=None, code=code))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        return _error(OpenAIError(500, f"internal router error: {exc!r}", "server_error", code="internal"))

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        authenticate(request)
        return models_response(config.served_model_names, started)

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
        authenticate(request)
        if model_id not in served:
            raise OpenAIError(
                404, f"The model {model_id!r} does not exist", param="model", code="model_not_found"
            )
        model: dict[str, Any] = models_response([model_id], started)["data"][0]
        return model

    credential = None if config.node_token is None else credential_digest(config.node_token)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Ready (200) only while the policy can place a request on the nodes the router would use now: a
        prefill and decode pair, a single node, or a decode node prefilling locally; else 503. Draining
        nodes, nodes whose breaker is open (`down`) and nodes that registered another credential than this
        router's token (they would answer it 401) cannot serve. The body counts the router's view of the
        nodes by role and says whether the index answers (without it the router serves on from its view)."""
        now = time.monotonic()
        statuses = await membership.nodes()
        counts = {role: {"ready": 0, "draining": 0, "down": 0} for role in ROLES}
        for s in statuses:
            state = (
                "ready"
                if router.usable(s, now)
                else "down"
                if breakers.is_open(s.info.node_id)
                else "draining"
            )
            counts[s.info.role][state] += 1
        body: dict[str, Any] = {"nodes": counts, "index": "ok" if router.index_ok else "unavailable"}
        usable = [s for s in statuses if router.usable(s, now)]
        trusted = [s for s in usable if credential in (None, s.info.credential_digest)]
        try:
            decision = choose(0, 1, {}, [NodeView.from_status(s) for s in trusted], config.policy)
        except NoNodeAvailable as exc:
            reason = str(exc)
            if len(trusted) < len(usable):
                reason += (
                    f"; {len(usable) - len(trusted)} live node(s) hold another credential than this "
                    "router's (PDSERVE_AUTH_TOKEN or --auth-token-file)"
                )
            return JSONResponse({"status": "unavailable", **body, "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok", "mode": decision.mode, **body})

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        if config.metrics_auth:
            authenticate(request)
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "completions", parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, "chat", parse_chat)

    async def serve(
        request: Request, endpoint: str, parse: Callable[[dict[str, Any]], GenerationSpec]
    ) -> Response:
        metrics.in_flight.inc()
        streaming = False
        status = 500
        try:
            req = await start(request, parse)
            if req.spec.stream:
                streaming = True
                status = 200
                return StreamingResponse(
                    stream(req, request, endpoint),
                    media_type="text/event-stream",
                    headers={"cache-control": "no-cache"},
                )
            body = await collect(req, request)
            status = 200
            return JSONResponse(body)
        except OpenAIError as exc:
            status = exc.status
            return _error(exc)
        finally:
            if not streaming:
                metrics.in_flight.dec()
                metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()

    async def start(request: Request, parse: Callable[[dict[str, Any]], GenerationSpec]) -> _Request:
        arrival = time.perf_counter()
        tenant = tenants.admit(request.headers.get("authorization"))
        spec = parse(await read_json(request))
        check_token_ids(spec, tokenizer.vocab_size)
        if spec.model not in served:
            raise OpenAIError(
                404,
                f"The model {spec.model!r} does not exist; this server serves {', '.join(sorted(served))}",
                param="model",
                code="model_not_found",
            )
        if spec.n * max(len(spec.prompts), 1) > config.max_n:
            raise OpenAIError(400, f"n x prompts = {spec.n * max(len(spec.prompts), 1)} exceeds the limit "
                              f"{config.max_n}", param="n")  # fmt: skip
        prompts, echo = await tokenize(spec)
        salt = cache_salt(tenant, spec.cache_salt)
        timeout = min(spec.timeout_s or config.default_deadline_s, config.max_deadline_s)
        deadline = time.time() + timeout
        placed = await asyncio.gather(
            *(router.place(ids, salt, deadline, spec.n) for ids in prompts), return_exceptions=True
        )
        placements = [p for p in placed if isinstance(p, Placement)]
        base = f"{'cmpl' if spec.kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        jobs = []
        try:
            for outcome in placed:
                if isinstance(outcome, BaseException):
                    raise outcome
            for p, (ids, placement) in enumerate(zip(prompts, placements, strict=True)):
                max_tokens = check_length(spec, len(ids), placement)
                for j in range(spec.n):
                    index = p * spec.n + j
                    sampling = spec.sampling_for(max_tokens, j)
                    job_id = RequestId(f"{base}-{index}")
                    jobs.append(ChoiceJob(index, job_id, ids, sampling, placement.route, placement.leases[j]))
        except BaseException:
            for placement in placements:
                placement.release()
            raise
        metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts))
        run = RequestRun(jobs, salt, deadline, clients, metrics, background, router, config.migration_limit)
        head = ResponseHead(spec.kind, base, int(time.time()), spec.model,
                            f"fp_{placements[0].model_fingerprint[:12]}")  # fmt: skip
        choices = {job.index: _Choice() for job in jobs}
        for job in jobs:
            choices[job.index].offset = len(echo[job.index // spec.n])
        return _Request(spec, head, [len(ids) for ids in prompts], echo, run, arrival, choices)

    def authenticate(request: Request) -> None:
        tenants.authenticate(request.headers.get("authorization"))

    async def read_json(request: Request) -> Any:
        limit = config.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise OpenAIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise OpenAIError(413, f"request body exceeds the limit of {limit} bytes")
        return parse_json_body(bytes(body))

    async def tokenize(spec: GenerationSpec) -> tuple[list[tuple[int, ...]], list[str]]:
        """Token ids of each prompt, and the text `echo` puts in front of each prompt's choices."""
        t0 = time.perf_counter()
        if spec.kind == "chat":
            try:
                ids = await asyncio.to_thread(tokenizer.apply_chat_template, list(spec.messages), True)
            except ValueError as exc:
                raise OpenAIError(400, str(exc), param="messages") from exc
            prompts = [tuple(ids)]
        else:
            prompts = [
                p if isinstance(p, tuple) else tuple(await asyncio.to_thread(tokenizer.encode, p, True))
                for p in spec.prompts
            ]
        metrics.tokenize.observe(time.perf_counter() - t0)
        if any(not ids for ids in prompts):
            raise OpenAIError(400, "the prompt encodes to no tokens", param="prompt")
        echo = [""] * len(prompts)
        if spec.echo:
            echo = [p if isinstance(p, str) else tokenizer.decode(p) for p in spec.prompts]
        return prompts, echo

    def check_length(spec: GenerationSpec, prompt_len: int, placement: Placement) -> int:
        """max_tokens for one prompt; OpenAIError 400 when prompt + output exceed the context."""
        limit = placement.max_model_len
        max_tokens = spec.max_tokens if spec.max_tokens is not None else limit - prompt_len
        if prompt_len + max(max_tokens, 1) > limit:
            param = "messages" if spec.kind == "chat" else "prompt"
            if prompt_len < limit:
                param = "max_tokens"
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                "completion). Please reduce the prompt or max_tokens.",
                param=param,
                code="context_length_exceeded",
            )
        return max_tokens

    def record(req: _Request, event: ChoiceEvent) -> tuple[str, list[TokenLogprob] | None]:
        """Fold a step into its choice; returns (text for the client, this step's logprobs)."""
        step = event.step
        assert step is not None
        choice = req.choices[event.index]
        text = step.text
        if not choice.text and req.echo[event.index // req.spec.n]:
            text = req.echo[event.index // req.spec.n] + text
        choice.text.append(text)
        choice.completion_tokens = step.completion_tokens
        choice.cached_tokens = step.cached_tokens
        choice.finish_reason = step.finish_reason
        now = time.perf_counter()
        if step.token_ids:
            metrics.generation_tokens.inc(len(step.token_ids))
            if not req.first_token_seen:
                req.first_token_seen = True
                metrics.ttft.observe(now - req.arrival)
            if choice.last_token_at is not None:
                for _ in step.token_ids:
                    metrics.itl.observe((now - choice.last_token_at) / len(step.token_ids))
            choice.last_token_at = now
        logprobs = None if step.logprobs is None else list(step.logprobs)
        if logprobs is not None:
            choice.logprobs.extend(logprobs)
        return text, logprobs

    async def events(req: _Request, request: Request) -> AsyncIterator[ChoiceEvent]:
        """The run's events; cancels it and raises OpenAIError at the deadline or when the client left."""
        run = req.run
        run.start()
        checked = time.monotonic()
        while not run.finished:
            remaining = run.deadline - time.time()
            if remaining <= 0:
                run.cancel("deadline")
                raise OpenAIError(504, f"the request did not finish before its deadline ({run.deadline:.3f})",
                                  "timeout_error", code="deadline_exceeded")  # fmt: skip
            event = await run.next_event(min(config.disconnect_poll_s, remaining))
            if time.monotonic() - checked >= config.disconnect_poll_s:
                checked = time.monotonic()
                if await request.is_disconnected():
                    run.cancel("client_disconnect")
                    raise OpenAIError(499, "client closed the request", code="client_disconnect")
            if event is not None:
                yield event

    async def collect(req: _Request, request: Request) -> dict[str, Any]:
        try:
            async for event in events(req, request):
                if event.error is not None:
                    raise event.error
                record(req, event)
        except OpenAIError:
            req.run.cancel("error")
            raise
        metrics.e2e.observe(time.perf_counter() - req.arrival)
        choices = [
            req.head.choice(i, "".join(c.text), c.finish_reason or "stop",
                            c.logprobs if req.spec.sampling.logprobs is not None else None, c.offset)
            for i, c in req.choices.items()
        ]  # fmt: skip
        return req.head.response(choices, req.usage())

    async def stream(req: _Request, request: Request, endpoint: str) -> AsyncIterator[bytes]:
        status, finished = "200", False
        include_usage = req.spec.include_usage
        try:
            if req.spec.kind == "chat":
                for index in req.choices:
                    yield _sse(req.head.chunk(index, "", None, None, include_usage, role=True))
            async for event in events(req, request):
                if event.error is not None:
                    raise event.error
                choice = req.choices[event.index]
                offset = sum(len(t) for t in choice.text) if choice.text else choice.offset
                text, logprobs = record(req, event)
                assert event.step is not None
                if text or logprobs or event.step.finish_reason is not None:
                    yield _sse(req.head.chunk(event.index, text, event.step.finish_reason, logprobs,
                                              include_usage, offset))  # fmt: skip
            if include_usage:
                yield _sse(req.head.usage_chunk(req.usage()))
            metrics.e2e.observe(time.perf_counter() - req.arrival)
            yield b"data: [DONE]\n\n"
            finished = True
        except OpenAIError as exc:
            status = str(exc.status)
            if exc.status >= 500:  # the response is a 200 already: RequestLog cannot see this one
                log.warning("request %s: its stream ended with %d %s: %s", REQUEST_ID.get(), exc.status,
                            exc.code or exc.type, exc.message)  # fmt: skip
            if exc.status != 499:
                yield _sse(exc.body())
                yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                # Client gone (GeneratorExit / cancellation), deadline or node failure: stop the rest.
                status = "499" if status == "200" else status
                req.run.cancel("client_disconnect" if status == "499" else "error")
            metrics.in_flight.dec()
            metrics.requests.labels(endpoint=endpoint, status=status).inc()

    return app
