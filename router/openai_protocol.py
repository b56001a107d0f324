"""OpenAI request parsing and validation: a request body in, a GenerationSpec or an OpenAIError out.

Invariants: a GenerationSpec is fully validated (its SamplingParams template was built, so every sampling
field is in range); every field the body models accept is honoured, a known field this server does not carry
out is refused naming it (router/openai_options.py), and unknown fields are ignored, as vLLM does, and logged;
every refusal is an OpenAIError carrying the HTTP status and OpenAI's ErrorResponse body, naming the bad
parameter. Bodies arrive as strict JSON (router/json_body.py). Every list a client sends is bounded (stop
strings, stop token ids, logprobs; prompts and n by RouterConfig.max_n, prompt tokens by the context).
Response and chunk objects are built in router/openai_builders.py. Structured output fields become one
checked Constraint in the sampling params (router/structured_output.py); tools become a ToolPlan whose
`required` or named choice is such a constraint too (router/tool_calls.py).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.router import openai_options, structured_output, tool_calls
from pdserve.router.openai_errors import OpenAIError
from pdserve.router.tool_calls import ToolPlan
from pdserve.shared.engine.sampling_params import Constraint, SamplingParams
from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)

Kind = Literal["chat", "completion"]
Prompt = str | tuple[int, ...]
ChatMessages = tuple[dict[str, Any], ...]
_MESSAGE_REFUSED = {
    "function_call": "the deprecated function_call is not read; send tool_calls",
    "audio": "input and output are text only",
}
"""Message fields refused when set (a null or empty value asks for nothing). `name`, `tool_call_id` and an
assistant's `tool_calls` reach the chat template; other message fields are ignored like unknown body
fields."""
_MESSAGE_PASSED = ("name", "tool_call_id")
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 64


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    """Token id (as a string key, OpenAI's form) -> bias in [-100, 100] added to its logit at every step."""
    user: str | None = None
    """An end-user id for OpenAI's abuse monitoring: accepted, and used for nothing here."""
    # Extensions (vLLM's names): sampling knobs, the tenant's cache salt, a per-request deadline in seconds,
    # and how the prompt is tokenized.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    timeout: float | None = Field(default=None, gt=0.0)
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    # Structured output (router/structured_output.py reads them from the body; typed loosely here so that
    # its messages, not pydantic's, name what is wrong)
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    regex: Any = None
    ebnf: Any = None
    json_schema: Any = None


class CompletionBody(_Body):
    prompt: Any
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=_MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None


class ChatBody(_Body):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=_MAX_LOGPROBS)
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class Tokenize:
    """How the router turns the prompt into token ids (vLLM's fields and defaults)."""

    add_special_tokens: bool
    """Add the tokenizer's own special tokens (BOS): completions default true, chat false (its template
    writes them)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last this many prompt tokens (left truncation); None keeps all."""
    add_generation_prompt: bool = True
    """Chat: end the template with the assistant's header, so the model answers in a new message."""
    continue_final_message: bool = False
    """Chat: leave the final message open (no end-of-turn), so the model continues it."""
    template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Chat: more variables for the chat template (vLLM's `chat_template_kwargs`, e.g. Qwen3's
    `enable_thinking`)."""


@dataclass(frozen=True)
class GenerationSpec:
    """One validated client request. max_tokens None: whatever the context leaves (chat only)."""

    kind: Kind
    model: str
    prompts: tuple[Prompt, ...]
    """Completions: each prompt as text or token ids. Chat: empty (the messages are the prompt)."""
    messages: ChatMessages
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    max_tokens: int | None
    sampling: SamplingParams
    """Template: max_tokens and seed are replaced per node request (see `sampling_for`)."""
    cache_salt: str | None
    timeout_s: float | None
    tokenize: Tokenize
    tools: ToolPlan | None = None
    """Chat: the functions the model may call and how (None: none)."""

    def sampling_for(self, max_tokens: int, choice: int) -> SamplingParams:
        """Sampling of choice `choice` (0..n-1): seeded requests fan out with seeds seed + choice."""
        seed = None if self.sampling.seed is None else self.sampling.seed + choice
        return dataclasses.replace(self.sampling, max_tokens=max_tokens, seed=seed)


def check_token_ids(spec: GenerationSpec, vocab_size: int) -> None:
    """OpenAIError 400 when a token-id prompt or a stop token id is outside the tokenizer's vocabulary."""
    for i, prompt in enumerate(spec.prompts):
        if isinstance(prompt, tuple) and max(prompt) >= vocab_size:
            raise OpenAIError(
                400,
                f"prompt {i} holds token id {max(prompt)}, outside the vocabulary [0, {vocab_size})",
                param="prompt",
            )
    for param, ids in (
        ("stop_token_ids", spec.sampling.stop_token_ids),
        ("logit_bias", [t for t, _ in spec.sampling.logit_bias]),
    ):
        too_big = [t for t in ids if t >= vocab_size]
        if too_big:
            raise OpenAIError(
                400, f"{param} holds {too_big[0]}, outside the vocabulary [0, {vocab_size})", param=param
            )


def parse_completion(body: dict[str, Any]) -> GenerationSpec:
    req = _validate(CompletionBody, body)
    if req.best_of is not None and req.best_of != req.n:
        raise OpenAIError(
            400,
            f"`best_of` is not supported by this server unless equal to n (best_of={req.best_of}, n={req.n})",
            param="best_of",
        )
    if req.echo and req.logprobs is not None:
        raise OpenAIError(
            400, "echo together with logprobs is not supported: it needs the prompt tokens' logprobs, which "
            "the nodes do not compute (they return logprobs of sampled tokens only); send echo without "
            "logprobs, or logprobs without echo", param="echo",
        )  # fmt: skip
    prompts = _parse_prompt(req.prompt)
    tokenize = Tokenize(_default(req.add_special_tokens, True), req.truncate_prompt_tokens)
    constraint = structured_output.constraint_of(req.model_dump(include=set(structured_output.FIELDS),
                                                                exclude_none=True))  # fmt: skip
    return _spec("completion", req, prompts, (), req.max_tokens, req.logprobs, req.echo, tokenize, constraint)


def parse_chat(body: dict[str, Any]) -> GenerationSpec:
    req = _validate(ChatBody, body)
    if req.continue_final_message and req.add_generation_prompt:
        # vLLM's check and message: both asked explicitly. Continuing alone implies no generation prompt.
        raise OpenAIError(
            400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )  # fmt: skip
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    tokenize = Tokenize(
        add_special_tokens=_default(req.add_special_tokens, False),
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        add_generation_prompt=_default(req.add_generation_prompt, not req.continue_final_message),
        continue_final_message=req.continue_final_message,
        template_kwargs=req.chat_template_kwargs or {},
    )
    body_fields = req.model_dump(exclude_none=True)
    constraint = structured_output.constraint_of(
        {k: body_fields[k] for k in structured_output.FIELDS if k in body_fields}
    )
    plan = tool_calls.parse_plan(body_fields)
    tool_constraint = None if plan is None else plan.constraint()
    if plan is not None and tool_constraint is not None:
        if constraint is not None:
            raise OpenAIError(
                400, f"tool_choice {plan.choice!r} constrains the output to a tool call: it cannot be "
                "combined with a structured output field", param="tool_choice",
            )  # fmt: skip
        constraint = tool_constraint
    spec = _spec(
        "chat", req, (), _parse_messages(req.messages), max_tokens, logprobs, False, tokenize, constraint
    )
    return dataclasses.replace(spec, tools=plan)


def _default(value: bool | None, default: bool) -> bool:
    return default if value is None else value


def _spec(
    kind: Kind,
    req: CompletionBody | ChatBody,
    prompts: tuple[Prompt, ...],
    messages: ChatMessages,
    max_tokens: int | None,
    logprobs: int | None,
    echo: bool,
    tokenize: Tokenize,
    constraint: Constraint | None,
) -> GenerationSpec:
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise OpenAIError(
            400, f"min_tokens={req.min_tokens} must be less than or equal to max_tokens={max_tokens}",
            param="min_tokens",
        )  # fmt: skip
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    stream_options = req.stream_options or {}
    for name in _STREAM_OPTIONS_REFUSED:
        if stream_options.get(name):
            raise OpenAIError(
                400, f"stream_options.{name} is not supported by this server; only include_usage is",
                param="stream_options",
            )  # fmt: skip
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise OpenAIError(
            400, f"include_usage must be a boolean, got {include_usage!r}", param="stream_options"
        )
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise OpenAIError(
            400,
            f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each, got "
            f"{len(stop)} of up to {max(len(s) for s in stop)} characters",
            param="stop",
        )
    # Only what the client set goes in; SamplingParams' own defaults stand for the rest.
    optional: dict[str, Any] = {
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
        "repetition_penalty": req.repetition_penalty,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
    }
    try:
        sampling = SamplingParams(
            max_tokens=1,
            logit_bias=_logit_bias(req.logit_bias or {}),
            temperature=1.0 if req.temperature is None else req.temperature,
            stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            constraint=constraint,
            **{k: v for k, v in optional.items() if v is not None},
        )
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param=_param_named_in(str(exc))) from exc
    spec = GenerationSpec(
        kind=kind,
        model=req.model,
        prompts=prompts,
        messages=messages,
        n=req.n,
        stream=req.stream,
        include_usage=include_usage,
        echo=echo,
        max_tokens=max_tokens,
        sampling=sampling,
        cache_salt=req.cache_salt,
        timeout_s=req.timeout,
        tokenize=tokenize,
    )
    try:
        spec.sampling_for(1, spec.n - 1)  # the last choice's seed must be valid too
    except ValueError as exc:
        raise OpenAIError(400, f"{exc} (choice {spec.n - 1} of n={spec.n} uses seed + {spec.n - 1})",
                          param=_param_named_in(str(exc))) from exc  # fmt: skip
    return spec


def _logit_bias(bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as SamplingParams' pairs; OpenAIError 400 naming a key that is no id."""
    bad = [k for k in bias if not (k.isascii() and k.isdigit())]
    if bad:
        raise OpenAIError(
            400, f"logit_bias: key {bad[0]!r} is not a token id; keys are token ids as strings, e.g. "
            '{"50256": -100}', param="logit_bias",
        )  # fmt: skip
    return tuple((int(k), float(v)) for k, v in bias.items())


_STREAM_OPTIONS_REFUSED = ("continuous_usage_stats", "include_obfuscation")
"""vLLM's usage on every chunk, OpenAI's obfuscation padding: refused when true (false asks for nothing)."""


def _validate(model: type[CompletionBody] | type[ChatBody], body: Any) -> Any:
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    # OpenAI's schemas make most fields nullable, null meaning the default: a null field is an absent one.
    body = {k: v for k, v in body.items() if v is not None}
    refused = openai_options.refusal(
        body, openai_options.CHAT if model is ChatBody else openai_options.COMPLETION
    )
    if refused is not None:
        raise OpenAIError(400, refused[1], param=refused[0])
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [p for p in err["loc"] if isinstance(p, int) or str(p).isidentifier()]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
        got = repr(err.get("input"))[:80]
        raise OpenAIError(400, f"{param}: {err['msg']} (got {got})", param=param) from exc
    if req.model_extra:
        log.warning("ignored unknown request field(s) %s (docs/operations.md, Request options)",
                    ", ".join(sorted(req.model_extra)))  # fmt: skip
    return req


def _is_ids(value: Any) -> bool:
    """A list of ints only (no bools): one C-level pass over the item types (a prompt may hold 100k ids)."""
    return isinstance(value, list) and set(map(type, value)) <= _INT


_INT = frozenset((int,))


def _parse_prompt(prompt: Any) -> tuple[Prompt, ...]:
    if isinstance(prompt, str):
        prompts: list[Prompt] = [prompt]
    elif _is_ids(prompt) and prompt:
        prompts = [tuple(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_ids(p) for p in prompt):
        prompts = [tuple(p) for p in prompt]
    else:
        raise OpenAIError(
            400,
            "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
            param="prompt",
        )
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise OpenAIError(400, f"prompt {i} is empty", param="prompt")
        if isinstance(p, tuple) and (lowest := min(p)) < 0:
            raise OpenAIError(400, f"prompt {i} holds a negative token id {lowest}", param="prompt")
    return tuple(prompts)


def _parse_messages(messages: list[dict[str, Any]]) -> ChatMessages:
    out = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise OpenAIError(
                400, f"messages[{i}].role {role!r} is not one of {sorted(_ROLES)}", param="messages"
            )
        for field, why in _MESSAGE_REFUSED.items():
            if msg.get(field):
                raise OpenAIError(
                    400, f"`{field}` in a message is not supported by this server: {why}",
                    param=f"messages[{i}].{field}",
                )  # fmt: skip
        content = msg.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise OpenAIError(
                    400,
                    f"messages[{i}].content: only text parts are supported",
                    param=f"messages[{i}].content",
                )
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise OpenAIError(
                400,
                f"messages[{i}].content must be a string or text parts, got {content!r}"[:200],
                param=f"messages[{i}].content",
            )
        passed: dict[str, Any] = {k: msg[k] for k in _MESSAGE_PASSED if isinstance(msg.get(k), str)}
        if msg.get("tool_calls"):
            if role != "assistant":
                raise OpenAIError(400, f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                                  param=f"messages[{i}].tool_calls")  # fmt: skip
            passed["tool_calls"] = tool_calls.check_message_tool_calls(i, msg["tool_calls"])
        out.append({"role": _ROLES[role], "content": content, **passed})
    return tuple(out)


def _param_named_in(message: str) -> str | None:
    """The SamplingParams field a ValueError names, so the client sees which parameter to fix."""
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    found = [(m.start(), n) for n in names if (m := re.search(rf"\b{n}\b", message))]
    return min(found)[1] if found else None
