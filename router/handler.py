"""Request handling of the router's OpenAI API, without a web framework: an `Incoming` request (its
Authorization header, declared length, body chunks and a disconnect probe) in, a `Reply` out (a JSON body
with its status and headers, or the SSE chunks of a stream). router/app.py only binds it to FastAPI routes.

Invariants: every refusal leaves as OpenAI's ErrorResponse with its status; routing and node outcomes arrive
as domain errors (router/errors.py) and are mapped by `to_openai` alone; the router tokenizes (chat template
included) and only token ids go to the nodes; a request ends on every path (finish, node failure, deadline,
client disconnect, streaming or not) with its node requests aborted where they may still run
(router/dispatch.py); every request counted in flight is counted out once; a body over the size bound is
refused before it is parsed, and a prompt longer than every node's context before the index lookup. The
handler owns the BlockIndex it is given and closes it in `stop()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from pdserve.router.background import Background
from pdserve.router.breaker import Breakers
from pdserve.router.config import RouterConfig
from pdserve.router.cost_model import CostModel
from pdserve.router.dispatch import ChoiceEvent, ChoiceJob, RequestRun
from pdserve.router.errors import ClientGone, DeadlineExceeded, RouterError, to_openai
from pdserve.router.json_body import parse_json_body
from pdserve.router.ledger_redis import ledger_for
from pdserve.router.membership import Membership
from pdserve.router.metrics import RouterMetrics
from pdserve.router.model_check import ModelCheck
from pdserve.router.node_client import NodeClients
from pdserve.router.openai_builders import ChoiceFinish, ResponseHead, models_response
from pdserve.router.openai_protocol import (
    GenerationSpec,
    OpenAIError,
    check_token_ids,
    parse_chat,
    parse_completion,
)
from pdserve.router.policy import NodeView, NoNodeAvailable, choose
from pdserve.router.request_log import REQUEST_ID
from pdserve.router.request_state import ChoiceState, ServedRequest, check_length
from pdserve.router.request_trace import CURRENT, RequestTrace, on_event
from pdserve.router.routing import Placement, Router
from pdserve.router.tenants import Tenants, cache_salt
from pdserve.router.tool_calls import ToolCallStream, parse_tool_calls, template_input, tool_format
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.model.tokenizer import Tokenizer
from pdserve.shared.node.node_sign import ClusterKeys
from pdserve.shared.tracing import tracing
from pdserve.shared.types import ROLES, RequestId

log = logging.getLogger(__name__)

Endpoint = Literal["completions", "chat"]
_PARSERS: dict[Endpoint, Callable[[dict[str, Any]], GenerationSpec]] = {
    "completions": parse_completion,
    "chat": parse_chat,
}


async def _never() -> bool:
    return False


@dataclass(frozen=True)
class Incoming:
    """One API request as the handler needs it, whatever server carries it."""

    authorization: str | None
    body: AsyncIterable[bytes]
    content_length: str | None = None
    is_disconnected: Callable[[], Awaitable[bool]] = _never
    trace_context: dict[str, str] | None = None
    """The client's W3C trace headers (`traceparent`, `tracestate`) it sent, if any."""


@dataclass(frozen=True)
class Reply:
    """What goes back: a JSON body with its status and headers, or (`stream` set) SSE chunks under 200."""

    status: int
    body: dict[str, Any] | None = None
    headers: dict[str, str] | None = None
    stream: AsyncIterator[bytes] | None = None


def error_reply(exc: OpenAIError | RouterError) -> Reply:
    err = to_openai(exc) if isinstance(exc, RouterError) else exc
    return Reply(err.status, err.body(), err.headers)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class RequestHandler:
    """The router's API over its view of the cluster; one per router process."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, index: BlockIndex) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.index = index
        self.metrics = RouterMetrics(config.served_model_name)
        self.background = Background()
        self.clients = NodeClients(
            config.node_connect_timeout_s, config.max_connections_per_node, ClusterKeys(config.node_token)
        )
        self.breakers = Breakers(config.breaker, self.clients.probe, self.metrics)
        self.clients.on_down = self.breakers.trip
        self.membership = Membership(
            index, self.clients, self.breakers, self.metrics, config.node_list_ttl_s, config.seed_nodes
        )
        self.model_check = ModelCheck(config.model_path, tokenizer)
        self.ledger = ledger_for(config.admission, config.redis, self.metrics, self.background)
        self.router = Router(
            index, config.policy, self.membership, self.metrics, self.background, self.breakers,
            self.ledger, self.model_check, CostModel(), config.cost_model,
        )  # fmt: skip
        self.tenants = Tenants(config.api_keys, config.rate_limit)
        self.tracing = tracing(config.otlp_endpoint, "pdserve-router", f"router@{config.host}:{config.port}")
        self.router.telemetry.subscribe(on_event)
        self._served = set(config.served_model_names)
        self._started = int(time.time())
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.model_check.prepare()
        await self.ledger.start()
        self._watch = asyncio.create_task(self.membership.run())

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.breakers.aclose()
        await self.background.drain()
        await self.ledger.close()
        await self.clients.aclose()
        await self.index.close()
        self.tracing.shutdown()

    def authenticate(self, authorization: str | None) -> None:
        """OpenAIError 401 unless the API keys accept `authorization`."""
        self.tenants.authenticate(authorization)

    async def models(self, authorization: str | None) -> dict[str, Any]:
        self.authenticate(authorization)
        return models_response(self.config.served_model_names, self._started, await self._max_model_len())

    async def model(self, model_id: str, authorization: str | None) -> dict[str, Any]:
        self.authenticate(authorization)
        if model_id not in self._served:
            raise OpenAIError(
                404, f"The model {model_id!r} does not exist", param="model", code="model_not_found"
            )
        cards = models_response([model_id], self._started, await self._max_model_len())
        model: dict[str, Any] = cards["data"][0]
        return model

    async def _max_model_len(self) -> int | None:
        """The context length a request can count on: the smallest the nodes in view registered (None when
        the router sees no node)."""
        return min((s.info.max_model_len for s in await self.membership.nodes()), default=None)

    def metrics_page(self, authorization: str | None) -> bytes:
        if not self.config.metrics_public:
            self.authenticate(authorization)
        return self.metrics.render()

    async def health(self) -> Reply:
        """Ready (200) only while the policy can place a request on the nodes the router would use now: a
        prefill and decode pair, a single node, or a decode node prefilling locally; else 503. Draining
        nodes and nodes whose breaker is open (`down`) cannot serve; a node whose record is not signed with
        this router's credential is never in the view (router/membership.py). The body counts the router's
        view of the nodes by role and says whether the index answers (without it the router serves on from
        its view)."""
        now = time.monotonic()
        router = self.router
        statuses = await self.membership.nodes()
        counts = {role: {"ready": 0, "draining": 0, "down": 0} for role in ROLES}
        for s in statuses:
            ready, down = router.usable(s, now), self.breakers.is_open(s.info.node_id)
            counts[s.info.role]["ready" if ready else "down" if down else "draining"] += 1
        body: dict[str, Any] = {"nodes": counts, "index": "ok" if router.index_ok else "unavailable"}
        usable = [s for s in statuses if router.usable(s, now)]
        views = [NodeView.from_status(s) for s in usable]
        block_size = usable[0].info.block_size if usable else 1
        try:
            decision = choose(0, 1, {}, views, self.config.policy, block_size=block_size)
        except NoNodeAvailable as exc:
            return Reply(503, {"status": "unavailable", **body, "reason": str(exc)})
        return Reply(200, {"status": "ok", "mode": decision.mode, **body})

    async def generate(self, endpoint: Endpoint, incoming: Incoming) -> Reply:
        """A completion or chat completion: its JSON reply, or its SSE stream."""
        metrics = self.metrics
        metrics.in_flight.inc()
        trace = RequestTrace.begin(self.tracing, incoming.trace_context, endpoint)
        streaming = False
        status = 500
        try:
            req = await self._start(incoming, _PARSERS[endpoint], trace)
            if req.spec.stream:
                streaming = True
                status = 200
                return Reply(200, stream=self._stream(req, incoming, endpoint, trace))
            body = await self._collect(req, incoming)
            status = 200
            return Reply(200, body)
        except (OpenAIError, RouterError) as exc:
            reply = error_reply(exc)
            status = reply.status
            return reply
        finally:
            if not streaming:
                metrics.in_flight.dec()
                metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
                if trace is not None:
                    trace.end(status)

    async def prompt_ids(self, endpoint: Endpoint, body: Any) -> list[tuple[int, ...]]:
        """The token ids each prompt of a completions or chat body becomes, as `generate` would send them
        (chat template, tools and truncation included); OpenAIError 400 for a bad body."""
        spec = _PARSERS[endpoint](body)
        check_token_ids(spec, self.tokenizer.vocab_size)
        return (await self._tokenize(spec))[0]

    async def count_prompt_tokens(self, authorization: str | None, body: Any) -> int:
        """The prompt length of a chat body, for the client of `authorization` (OpenAIError 401 otherwise)."""
        self.authenticate(authorization)
        return sum(len(ids) for ids in await self.prompt_ids("chat", body))

    async def _start(
        self,
        incoming: Incoming,
        parse: Callable[[dict[str, Any]], GenerationSpec],
        trace: RequestTrace | None = None,
    ) -> ServedRequest:
        config = self.config
        arrival = time.perf_counter()
        tenant = self.tenants.admit(incoming.authorization)
        context = await self._context_limit()
        spec = parse(await self._read_json(incoming, context))
        check_token_ids(spec, self.tokenizer.vocab_size)
        if spec.model not in self._served:
            served = ", ".join(sorted(self._served))
            raise OpenAIError(404, f"The model {spec.model!r} does not exist; this server serves {served}",
                              param="model", code="model_not_found")  # fmt: skip
        if spec.n * max(len(spec.prompts), 1) > config.max_n:
            raise OpenAIError(400, f"n x prompts = {spec.n * max(len(spec.prompts), 1)} exceeds the limit "
                              f"{config.max_n}", param="n")  # fmt: skip
        prompts, echo = await self._tokenize(spec)
        if context is not None:  # before the index lookup: a prompt that cannot fit costs no routing
            for ids in prompts:
                check_length(spec, len(ids), context)
        salt = cache_salt(tenant, spec.cache_salt)
        deadline = time.time() + self._timeout(spec)
        traced = CURRENT.set(trace)  # the placements' telemetry reaches the request's trace
        try:
            placed = await asyncio.gather(
                *(self.router.place(ids, salt, deadline, spec.n) for ids in prompts), return_exceptions=True
            )
        finally:
            CURRENT.reset(traced)
        placements = [p for p in placed if isinstance(p, Placement)]
        base = f"{'cmpl' if spec.kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        jobs = []
        try:
            for outcome in placed:
                if isinstance(outcome, BaseException):
                    raise outcome
            for p, (ids, placement) in enumerate(zip(prompts, placements, strict=True)):
                max_tokens = check_length(spec, len(ids), placement.max_model_len)
                for j in range(spec.n):
                    index = p * spec.n + j
                    sampling = spec.sampling_for(max_tokens, j)
                    job_id = RequestId(f"{base}-{index}")
                    jobs.append(
                        ChoiceJob(index, job_id, ids, sampling, placement.route, placement.bookings[j])
                    )
        except BaseException:
            for placement in placements:
                placement.release()
            raise
        self.metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts))
        run = RequestRun(jobs, salt, deadline, self.clients, self.metrics, self.background, self.router,
                         config.migration_limit, trace)  # fmt: skip
        # an alias is served under the first served name, which every response carries (as vLLM's do)
        head = ResponseHead(spec.kind, base, int(time.time()), config.served_model_name,
                            f"fp_{placements[0].model_fingerprint[:12]}")  # fmt: skip
        choices = {job.index: ChoiceState(offset=len(echo[job.index // spec.n])) for job in jobs}
        return ServedRequest(spec, head, [len(ids) for ids in prompts], echo, run, arrival, choices)

    def _timeout(self, spec: GenerationSpec) -> float:
        """Seconds the request may take: its `timeout`, else the router's default, at most the cap."""
        return min(spec.timeout_s or self.config.default_deadline_s, self.config.max_deadline_s)

    async def _context_limit(self) -> int | None:
        """The largest context (max_model_len) of the nodes the router knows: no prompt longer fits on any
        (the chosen nodes' own is checked after routing); None while it knows none."""
        statuses = await self.membership.nodes()
        return max((s.info.max_model_len for s in statuses), default=None)

    async def _read_json(self, incoming: Incoming, context: int | None) -> Any:
        """The body, parsed; OpenAIError 413 as soon as its declared or received size is over the limit:
        max_request_bytes, or max_request_bytes_per_token x the context when that is lower (a body no prompt
        could fit is refused before it is parsed or tokenized)."""
        config = self.config
        limit, why = config.max_request_bytes, "--max-request-bytes"
        if context is not None and context * config.max_request_bytes_per_token < limit:
            limit = context * config.max_request_bytes_per_token
            why = (f"{config.max_request_bytes_per_token} bytes per token of the model's context of "
                   f"{context} tokens (--max-request-bytes-per-token); send several prompts as several "
                   "requests")  # fmt: skip
        declared = incoming.content_length or ""
        if declared.isdigit() and int(declared) > limit:
            raise OpenAIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes: "
                              f"{why}")  # fmt: skip
        body = bytearray()
        async for chunk in incoming.body:
            body += chunk
            if len(body) > limit:
                raise OpenAIError(413, f"request body exceeds the limit of {limit} bytes: {why}")
        return parse_json_body(bytes(body))

    async def _tokenize(self, spec: GenerationSpec) -> tuple[list[tuple[int, ...]], list[str]]:
        """Token ids of each prompt, and the text `echo` puts in front of each prompt's choices."""
        tokenizer, how = self.tokenizer, spec.tokenize
        t0 = time.perf_counter()
        if spec.kind == "chat":
            messages, tools = template_input(spec.messages, spec.tools, tokenizer.chat_template)
            try:
                ids = await asyncio.to_thread(
                    tokenizer.apply_chat_template, messages, how.add_generation_prompt,
                    how.continue_final_message, how.add_special_tokens, how.template_kwargs, tools,
                )  # fmt: skip
            except ValueError as exc:
                raise OpenAIError(400, str(exc), param="messages") from exc
            prompts = [tuple(ids)]
        else:
            prompts = [
                p
                if isinstance(p, tuple)
                else tuple(await asyncio.to_thread(tokenizer.encode, p, how.add_special_tokens))
                for p in spec.prompts
            ]
        if how.truncate_prompt_tokens is not None:
            prompts = [ids[-how.truncate_prompt_tokens :] for ids in prompts]
        self.metrics.tokenize.observe(time.perf_counter() - t0)
        if any(not ids for ids in prompts):
            raise OpenAIError(400, "the prompt encodes to no tokens", param="prompt")
        echo = [""] * len(prompts)
        if spec.echo:  # the prompt the model saw: a truncated one is decoded from what was kept
            echo = [
                p if isinstance(p, str) and how.truncate_prompt_tokens is None else tokenizer.decode(ids)
                for p, ids in zip(spec.prompts, prompts, strict=True)
            ]
        return prompts, echo

    async def _events(self, req: ServedRequest, incoming: Incoming) -> AsyncIterator[ChoiceEvent]:
        """The run's events, each choice's error raised; cancels the run and raises DeadlineExceeded at the
        deadline, ClientGone when the client left."""
        poll = self.config.disconnect_poll_s
        run = req.run
        run.start()
        checked = time.monotonic()
        while not run.finished:
            remaining = run.deadline - time.time()
            if remaining <= 0:
                run.cancel("deadline")
                at = datetime.fromtimestamp(run.deadline, UTC).isoformat(timespec="milliseconds")
                raise DeadlineExceeded(
                    f"the request did not finish within its deadline of {self._timeout(req.spec):g} s "
                    f"({at.replace('+00:00', 'Z')}); a larger `timeout` (at most "
                    f"{self.config.max_deadline_s:g} s) gives it longer"
                )
            event = await run.next_event(min(poll, remaining))
            if time.monotonic() - checked >= poll:
                checked = time.monotonic()
                if await incoming.is_disconnected():
                    run.cancel("client_disconnect")
                    raise ClientGone("client closed the request")
            if event is not None:
                if event.error is not None:
                    raise event.error
                yield event

    async def _collect(self, req: ServedRequest, incoming: Incoming) -> dict[str, Any]:
        try:
            async for event in self._events(req, incoming):
                req.record(event, self.metrics)
        except RouterError:
            req.run.cancel("error")
            raise
        self.metrics.e2e.observe(time.perf_counter() - req.arrival)
        plan = req.spec.tools
        fmt = tool_format(plan, self.tokenizer.chat_template)
        choices = []
        for i, c in req.choices.items():
            text: str | None = "".join(c.text)
            calls: list[dict[str, Any]] = []
            if fmt is not None and plan is not None:
                text, calls = parse_tool_calls(fmt, "".join(c.text), plan.name)
            finish: ChoiceFinish = (
                "tool_calls" if calls and c.finish_reason in (None, "stop") else c.finish_reason or "stop"
            )
            logprobs = c.logprobs if req.spec.sampling.logprobs is not None else None
            choices.append(req.head.choice(i, text, finish, logprobs, c.offset, calls))
        return req.head.response(choices, req.usage())

    async def _stream(
        self, req: ServedRequest, incoming: Incoming, endpoint: str, trace: RequestTrace | None = None
    ) -> AsyncIterator[bytes]:
        metrics = self.metrics
        status, finished = "200", False
        include_usage = req.spec.include_usage
        plan, fmt = req.spec.tools, tool_format(req.spec.tools, self.tokenizer.chat_template)
        parsers = {i: ToolCallStream(fmt, plan.name) for i in req.choices} if fmt and plan else {}
        try:
            if req.spec.kind == "chat":
                for index in req.choices:
                    yield _sse(req.head.chunk(index, "", None, None, include_usage, role=True))
            async for event in self._events(req, incoming):
                choice = req.choices[event.index]
                offset = sum(len(t) for t in choice.text) if choice.text else choice.offset
                text, logprobs = req.record(event, self.metrics)
                assert event.step is not None
                finish: ChoiceFinish | None = event.step.finish_reason
                calls: list[dict[str, Any]] = []
                parser = parsers.get(event.index)
                if parser is not None:
                    text, calls = parser.feed(text)
                    if finish is not None:
                        more_text, more_calls = parser.finish()
                        text, calls = text + more_text, calls + more_calls
                        finish = "tool_calls" if parser.called and finish == "stop" else finish
                if text or logprobs or calls or finish is not None:
                    yield _sse(req.head.chunk(event.index, text, finish, logprobs, include_usage, offset,
                                              tool_calls=calls))  # fmt: skip
            if include_usage:
                yield _sse(req.head.usage_chunk(req.usage()))
            metrics.e2e.observe(time.perf_counter() - req.arrival)
            yield b"data: [DONE]\n\n"
            finished = True
        except RouterError as exc:
            err = to_openai(exc)
            status = str(err.status)
            if err.status >= 500:  # the response is a 200 already: RequestLog cannot see this one
                log.warning("request %s: its stream ended with %d %s: %s", REQUEST_ID.get(), err.status,
                            err.code or err.type, err.message)  # fmt: skip
            if not isinstance(exc, ClientGone):
                yield _sse(err.body())
                yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                # Client gone (GeneratorExit / cancellation), deadline or node failure: stop the rest.
                status = "499" if status == "200" else status
                req.run.cancel("client_disconnect" if status == "499" else "error")
            metrics.in_flight.dec()
            metrics.requests.labels(endpoint=endpoint, status=status).inc()
            if trace is not None:
                trace.end(status)
