"""The request options this API knows and refuses: OpenAI's, and the extras of vLLM (and SGLang's constrained
decoding) that it does not carry out, each with the values that ask for nothing and so are accepted.

The rule (docs/operations.md, "Request options"): every field the request models in router/openai_protocol.py
accept is honoured; a field named here gets a 400 naming it unless its value is one of its no-op values; any
other field is unknown and ignored, as vLLM does, and named in one log line. Structured output
(response_format, guided_*, structured_outputs) and tools are honoured (router/structured_output.py,
router/tool_calls.py); what is left of them here is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_STRUCTURED = "send the constraint as response_format, guided_json/regex/choice/grammar or structured_outputs"
_STATELESS = "this server stores nothing"


@dataclass(frozen=True)
class Refused:
    why: str
    """What the client should know or do instead; ends the error message."""
    no_ops: tuple[Any, ...] = ()
    """Values that ask for nothing (the default, or a choice this server makes anyway): accepted."""


_BOTH: dict[str, Refused] = {
    "guided_decoding_backend": Refused("the grammar engine is xgrammar", ("xgrammar", "auto")),
    "guided_whitespace_pattern": Refused("JSON is written without free whitespace; " + _STRUCTURED),
    "structural_tag": Refused(_STRUCTURED),
    "prompt_logprobs": Refused("prompt logprobs are not computed; leave it out", (0,)),
    "use_beam_search": Refused("there is no beam search; sample with n instead", (False,)),
    "length_penalty": Refused("it applies to beam search, which this server does not do", (1, 1.0)),
    "allowed_token_ids": Refused("the vocabulary is not restricted per request"),
    "bad_words": Refused("words are not banned per request; use stop or stop_token_ids"),
    "logits_processors": Refused("custom logits processors are not loaded"),
    "priority": Refused("requests are not prioritised; every request has priority 0", (0,)),
    "request_id": Refused("the router names requests itself; send an X-Request-Id header to tag one"),
    "return_tokens_as_token_ids": Refused("tokens come back as text", (False,)),
    "return_token_ids": Refused("token ids are not returned", (False,)),
    "spaces_between_special_tokens": Refused("special tokens are joined with spaces", (True,)),
    "kv_transfer_params": Refused("KV transfer is the cluster's own: the router places prefill and decode"),
    "vllm_xargs": Refused("no extension arguments are read"),
}

CHAT: Mapping[str, Refused] = {
    **_BOTH,
    "functions": Refused("the deprecated functions field is not read; send tools", ([],)),
    "function_call": Refused(
        "the deprecated function_call field is not read; send tool_choice", ("none", "auto")
    ),
    "audio": Refused("output is text only"),
    "modalities": Refused("output is text only", (["text"],)),
    "prediction": Refused("predicted outputs are not used"),
    "reasoning_effort": Refused("this model does not reason before answering"),
    "include_reasoning": Refused("this model does not reason before answering", (True,)),
    "verbosity": Refused("output length follows max_tokens only"),
    "web_search_options": Refused("there is no web search"),
    "store": Refused(_STATELESS, (False,)),
    "metadata": Refused(_STATELESS, ({},)),
    "service_tier": Refused("there is one service tier", ("auto", "default")),
    "prompt_cache_key": Refused("prefix caching routes by the prompt itself; use cache_salt to separate"),
    "prompt_cache_retention": Refused("cached prefixes live while the nodes' KV pools hold them"),
    "chat_template": Refused("the model's own chat template is applied"),
    "documents": Refused("documents are not passed to the chat template"),
    "mm_processor_kwargs": Refused("input is text only"),
    "echo": Refused("chat responses do not repeat the prompt; use completions with echo", (False,)),
}

COMPLETION: Mapping[str, Refused] = {
    **_BOTH,
    "suffix": Refused("this model does not fill in the middle", ("",)),
    "prompt_embeds": Refused("prompts are text or token ids"),
}


def refusal(body: Mapping[str, Any], known: Mapping[str, Refused]) -> tuple[str, str] | None:
    """(field, message) of the first known field in `body` that asks for something not done, else None.
    Null values are absent ones (the caller drops them first)."""
    for name, value in body.items():
        refused = known.get(name)
        if refused is not None and not any(type(value) is type(ok) and value == ok for ok in refused.no_ops):
            return name, f"`{name}` is not supported by this server ({name}={value!r:.80}): {refused.why}"
    return None
