"""Test helper: validate a response body against a named schema of OpenAI's API (openai-schemas.json).

The schema document is tests/data/openai-schemas.json, taken from OpenAI's published OpenAPI spec (source and
licence: tests/data/README.md): OpenAPI 3.1 components, with `nullable` already rewritten as JSON Schema null
types; $refs resolve through a `referencing` registry. It lives in the repository: a plain clone tests itself.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SCHEMAS_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "openai-schemas.json"
)
_URI = "urn:pdserve:openai-schemas"


@functools.cache
def _document() -> dict[str, Any]:
    with open(SCHEMAS_PATH, encoding="utf-8") as f:
        doc: dict[str, Any] = json.load(f)
    return doc


def schema_names() -> list[str]:
    return sorted(_document()["components"]["schemas"])


@functools.cache
def _validator(name: str, nullable_completion_finish: bool) -> Draft202012Validator:
    doc = _document()
    if name not in doc["components"]["schemas"]:
        raise KeyError(f"no schema {name!r}; known: {schema_names()}")
    if nullable_completion_finish:
        # OpenAI streams completions chunks with finish_reason null until the last one; the schema's single
        # shape for streamed and final objects does not say so (see router/openai_builders.py).
        doc = copy.deepcopy(doc)
        item = doc["components"]["schemas"][name]["properties"]["choices"]["items"]
        item["properties"]["finish_reason"] = {
            "anyOf": [item["properties"]["finish_reason"], {"type": "null"}]
        }
    registry = Registry().with_resource(_URI, Resource.from_contents(doc, default_specification=DRAFT202012))
    return Draft202012Validator({"$ref": f"{_URI}#/components/schemas/{name}"}, registry=registry)


def validate(body: Any, name: str, streamed_completion: bool = False) -> None:
    """Raise jsonschema.ValidationError (with the path of the first bad field) unless body matches `name`.

    streamed_completion: a completions stream chunk, whose finish_reason may be null.
    """
    errors = sorted(
        _validator(name, streamed_completion).iter_errors(body), key=lambda e: list(e.absolute_path)
    )
    if errors:
        raise errors[0]
