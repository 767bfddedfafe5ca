"""OpenAI's `response_format` as the grammar the answer is held to (raincheck_core/grammar.py): `text`
none, `json_object` any JSON object, `json_schema` the schema's values (whether `strict` or not: the mask
never lets an answer leave the schema). A schema that is invalid, or that the model's vocabulary cannot
start, is refused by the worker with a 400."""

from __future__ import annotations

from typing import Any

from raincheck_core.grammar import json_schema_grammar

from .errors import HttpError


def grammar_of(response_format: Any) -> str | None:
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise HttpError.invalid("response_format is an object with a type", param="response_format")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise HttpError.invalid("response_format json_schema needs json_schema.schema, an object",
                                    param="response_format")
        return json_schema_grammar(schema)
    raise HttpError.invalid(f"response_format type is text, json_object or json_schema; got {kind!r}",
                            param="response_format")
