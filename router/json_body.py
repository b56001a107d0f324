"""A request body as JSON the models can take: strict JSON (no NaN or Infinity) in UTF-8, nested at most
MAX_JSON_DEPTH deep, whose every string is Unicode text (no lone surrogate), so nothing downstream
(tokenizer, block hash, node messages) sees a value JSON's grammar allows but UTF-8 cannot carry. Every
refusal is an OpenAIError 400.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.router.openai_protocol import OpenAIError

MAX_JSON_DEPTH = 32
"""Nesting of a request body (the object itself is 1); OpenAI's own bodies need under 10."""


def parse_json_body(raw: bytes) -> Any:
    """The request body as JSON; OpenAIError 400 when it is not strict JSON in UTF-8 (NaN and Infinity are
    refused), nests deeper than MAX_JSON_DEPTH, or holds a lone surrogate escape such as "\\ud800"."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError as exc:  # the parser's own stack ran out: far deeper than MAX_JSON_DEPTH
        raise OpenAIError(400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels") from exc
    except ValueError as exc:
        raise OpenAIError(400, f"We could not parse the JSON body of your request: {exc}") from exc
    _check_tree(body)
    return body


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; send finite numbers")


_NESTED = frozenset((str, list, dict))
"""What json.loads builds that _check_tree looks into (the rest are numbers, booleans and null)."""


def _check_tree(body: Any) -> None:
    """Depth and text of every value, iteratively (a recursive walk is what a deep body attacks). A list of
    scalars only (a token-id prompt: 16k ints) is passed over in one C-level pass of its item types."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node, path)
            continue
        if depth > MAX_JSON_DEPTH:
            raise OpenAIError(
                400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels (at {path})", param=path
            )
        if isinstance(node, dict):
            for key, value in node.items():
                _check_text(key, f"{path}.{key!a}".lstrip("."))
                if isinstance(value, str | list | dict):
                    stack.append((value, f"{path}.{key}".lstrip("."), depth + 1))
        elif not _NESTED.isdisjoint(set(map(type, node))):
            for i, value in enumerate(node):
                if isinstance(value, str | list | dict):
                    stack.append((value, f"{path}[{i}]", depth + 1))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise OpenAIError(
            400,
            f"{path or 'the body'}: the string holds a lone surrogate {bad!a} at character {exc.start}; "
            "send Unicode text (a surrogate escape such as \\ud83d must be followed by its low half)",
            param=path or None,
        ) from exc
