"""Structured output requests: the body's constraint fields (OpenAI's `response_format`, vLLM's `guided_*` and
`structured_outputs`, SGLang's `regex` / `ebnf` / `json_schema`) into one `Constraint`, checked.

Invariants: at most one constraint per request (two are a 400 naming both); a constraint that leaves here
compiles (shared/engine/grammar.py's `check`, no tokenizer needed), so a node never refuses one the router
accepted for its syntax; every refusal is an OpenAIError 400 naming the parameter. docs/operations.md,
"Request options", lists the accepted shapes.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.router.openai_errors import OpenAIError
from pdserve.shared.engine.grammar import GrammarError, check
from pdserve.shared.engine.sampling_params import Constraint

FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "regex",
    "ebnf",
    "json_schema",
)
"""The body fields that ask for a constraint (every one also a field of the request models)."""
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def constraint_of(body: dict[str, Any]) -> Constraint | None:
    """The one constraint `body` asks for (None: plain text). Null fields were dropped by the caller."""
    found: list[tuple[str, Constraint]] = []
    for name in FIELDS:
        if name in body:
            c = _one(name, body[name])
            if c is not None:
                found.append((_where(name, body[name]), c))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(n.split(".")[0] for n, _ in found)
        raise OpenAIError(400, f"at most one structured output constraint per request; got {names}",
                          param=found[1][0].split(".")[0])  # fmt: skip
    name, constraint = found[0]
    checked(constraint, name)
    return constraint


def _where(name: str, value: Any) -> str:
    """The parameter that holds the grammar of field `name` (a valid value: `_one` checked its shape)."""
    if name == "response_format" and value.get("type") == "json_schema":
        return "response_format.json_schema.schema"
    if name == "structured_outputs":
        return "structured_outputs." + next(k for k, v in value.items() if v is not None and v is not False)
    return name


def checked(constraint: Constraint, param: str) -> Constraint:
    """The constraint, or OpenAIError 400 naming `param` when it does not compile."""
    try:
        check(constraint)
    except GrammarError as exc:
        raise OpenAIError(400, f"{param}: {exc}", param=param) from exc
    return constraint


def _schema_text(param: str, value: Any) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise OpenAIError(400, f"{param} is not valid JSON: {exc}", param=param) from exc
    if not isinstance(value, dict | bool):
        raise OpenAIError(400, f"{param} must be a JSON schema (an object), got {type(value).__name__}",
                          param=param)  # fmt: skip
    return json.dumps(value)


def _text(param: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise OpenAIError(400, f"{param} must be a non-empty string", param=param)
    return value


def _choice(param: str, value: Any) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise OpenAIError(400, f"{param} must be a non-empty list of non-empty strings", param=param)
    return json.dumps(value)


def _one(name: str, value: Any) -> Constraint | None:
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    if name in ("guided_json", "json_schema"):
        return Constraint("json_schema", _schema_text(name, value))
    if name in ("guided_regex", "regex"):
        return Constraint("regex", _text(name, value))
    if name == "guided_choice":
        return Constraint("choice", _choice(name, value))
    return Constraint("grammar", _text(name, value))  # guided_grammar, ebnf


def _response_format(value: Any) -> Constraint | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise OpenAIError(400, "response_format.json_schema must be an object with a name and a schema",
                              param="response_format.json_schema")  # fmt: skip
        if "schema" not in spec:
            raise OpenAIError(400, "response_format.json_schema.schema is missing: send the JSON schema the "
                              "output must follow", param="response_format.json_schema.schema")  # fmt: skip
        return Constraint("json_schema", _schema_text("response_format.json_schema.schema", spec["schema"]))
    raise OpenAIError(
        400, f"response_format.type must be one of text, json_object, json_schema; got {kind!r}",
        param="response_format",
    )  # fmt: skip


def _structured_outputs(value: Any) -> Constraint | None:
    if not isinstance(value, dict):
        raise OpenAIError(400, "structured_outputs must be an object", param="structured_outputs")
    asked = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(asked) - {*_STRUCTURED_KEYS, "json_object"})
    if unknown:
        raise OpenAIError(
            400, f"structured_outputs.{unknown[0]} is not supported; accepted: json, regex, choice, grammar, "
            "json_object", param=f"structured_outputs.{unknown[0]}",
        )  # fmt: skip
    if len(asked) > 1:
        raise OpenAIError(400, f"structured_outputs holds {sorted(asked)}: give exactly one",
                          param="structured_outputs")  # fmt: skip
    if not asked:
        return None
    key, v = next(iter(asked.items()))
    param = f"structured_outputs.{key}"
    if key == "json_object":
        return Constraint("json_object", "")
    if key == "json":
        return Constraint("json_schema", _schema_text(param, v))
    if key == "choice":
        return Constraint("choice", _choice(param, v))
    return Constraint(_STRUCTURED_KEYS[key], _text(param, v))  # type: ignore[arg-type]
