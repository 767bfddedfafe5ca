"""Structured outputs: the grammar a request's answer is held to (raincheck_core/grammar.py), from OpenAI's
`response_format` (`text` none, `json_object` any JSON object, `json_schema` the schema's values, whether
`strict` or not: the mask never lets an answer leave the schema) or vLLM's names for the same: the extra
fields `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and `structured_outputs` with one of
`json`, `regex`, `choice`, `grammar` (Lark, or GBNF as llama.cpp writes it) or `json_object: true`.

A request sets at most one of them. Each is checked here (a malformed one, or one that does not compile, is
a 400 naming its field); the worker then refuses, also with a 400, one the model's vocabulary cannot write,
saying what it cannot write (`GrammarError`; `naming_field` puts the field before it), and a dead end met
while answering ends that answer with the same message (an error event when streamed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from raincheck_core.grammar import UNWRITABLE, choice_lark, grammar_from

from .errors import HttpError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object")
@dataclass(frozen=True)
class Structured:
    """One request's structured output: `kind` json | regex | choice | grammar, its `value`, the `field` it
    came in (for errors)."""
    kind: str
    value: Any
    field: str

    def grammar(self) -> str:
        """llguidance's grammar text (400 naming the field when it is malformed or does not compile)."""
        import llguidance

        try:
            text = grammar_from(self.kind, self.value)
            error = llguidance.LLMatcher.validate_grammar(text)
        except (ValueError, TypeError) as e:
            error = str(e)
        if error:
            raise HttpError.invalid(f"{self.field}: invalid grammar: {error.strip()[:1000]}", param=self.field)
        return text

    def lark_rule(self) -> str:
        """The answer as a Lark rule body, to stand beside tool calls (tools.py); 400 for a grammar of its own."""
        if self.kind == "json":
            schema = self.value
            if isinstance(schema, dict):
                schema = {**schema, "x-guidance": {"whitespace_flexible": False, **schema.get("x-guidance", {})}}
            return f"%json {json.dumps(schema)}"
        if self.kind == "choice":
            return choice_lark(self.value).removeprefix("start: ")
        if self.kind == "regex":
            import llguidance

            return f"/{llguidance.regex_to_lark(self.value)}/"
        raise HttpError.invalid(f"{self.field} cannot be combined with tool_choice auto (a grammar of its own cannot "
                                "stand beside tool calls); send json, regex or choice", param=self.field)


def structured_of(r: Any) -> Structured | None:
    """The request's structured output, None for free text (400 naming the field for a malformed one, or
    for two of them)."""
    asked = [s for s in (_response_format(getattr(r, "response_format", None)),
                         _structured_outputs(getattr(r, "structured_outputs", None)),
                         *(_guided(name, kind, getattr(r, name, None)) for name, kind in GUIDED.items()))
             if s is not None]
    if len(asked) > 1:
        raise HttpError.invalid(f"one structured output per request: {asked[0].field} and {asked[1].field} are both "
                                "set", param=asked[1].field)
    return asked[0] if asked else None


def grammar_of(r: Any) -> str | None:
    """The grammar the request's answer is held to (None: free text)."""
    s = structured_of(r)
    return s.grammar() if s is not None else None


def naming_field(error: HttpError, field: str | None) -> HttpError:
    """The worker's refusal up front of a grammar its vocabulary cannot write, as a 400 naming `field`, the
    request's field that asked for the grammar (the worker sees only the grammar); any other error as it is."""
    if field is None or error.status != 400 or not error.message.startswith(UNWRITABLE):
        return error
    return HttpError.invalid(f"{field}: {error.message}", param=field)


def _response_format(response_format: Any) -> Structured | None:
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise HttpError.invalid("response_format is an object with a type", param="response_format")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured("json", {"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise HttpError.invalid("response_format json_schema needs json_schema.schema, an object",
                                    param="response_format")
        return Structured("json", schema, "response_format.json_schema.schema")
    raise HttpError.invalid(f"response_format type is text, json_object or json_schema; got {kind!r}",
                            param="response_format")


def _structured_outputs(spec: dict | None) -> Structured | None:
    if spec is None:
        return None
    unknown = sorted(set(spec) - set(STRUCTURED_OUTPUTS))
    if unknown:
        raise HttpError.invalid(f"structured_outputs.{unknown[0]} is not supported: give one of "
                                f"{', '.join(STRUCTURED_OUTPUTS)}", param=f"structured_outputs.{unknown[0]}")
    set_ = {k: v for k, v in spec.items() if v is not None and v is not False}
    if len(set_) != 1:
        raise HttpError.invalid(f"structured_outputs takes exactly one of {', '.join(STRUCTURED_OUTPUTS)}; got "
                                f"{', '.join(sorted(set_)) or 'none'}", param="structured_outputs")
    (key, value), = set_.items()
    if key == "json_object":
        if value is not True:
            raise HttpError.invalid("structured_outputs.json_object is true", param="structured_outputs.json_object")
        return Structured("json", {"type": "object"}, "structured_outputs.json_object")
    return _guided(f"structured_outputs.{key}", key, value)


def _guided(field: str, kind: str, value: Any) -> Structured | None:
    if value is None:
        return None
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise HttpError.invalid(f"{field} is a JSON schema (an object, or one as a string): {e}",
                                        param=field) from None
        if not isinstance(value, dict | bool):
            raise HttpError.invalid(f"{field} is a JSON schema (an object)", param=field)
    elif kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise HttpError.invalid(f"{field} is a list of non-empty strings", param=field)
    elif not (isinstance(value, str) and value):
        raise HttpError.invalid(f"{field} is a non-empty string", param=field)
    return Structured(kind, value, field)
