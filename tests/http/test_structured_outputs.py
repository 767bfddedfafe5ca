"""response_format through the official openai client on the demo model: json_schema answers are
schema-valid JSON on 20 of 20 sampled requests, streamed or not; bad or inexpressible schemas are 400s.

The demo vocabulary has no braces, quotes or digits (tests/engine/test_grammar.py): the schemas it can
answer are those whose values are `true`, `false` or `null`; an object schema is refused up front as
one its vocabulary cannot start, which is the honest answer for this model."""

from __future__ import annotations

import json

import openai
import pytest

from .helpers import MODEL, user

QUESTION = "is there a red object in row one ?"
SCHEMA = {"anyOf": [{"type": "boolean"}, {"type": "null"}]}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return value is None or isinstance(value, bool)


def test_json_schema_answers_are_valid_20_of_20(stack):
    client = stack.openai()
    texts = [client.chat.completions.create(model=MODEL, messages=[user(QUESTION)], max_tokens=8, temperature=1.5,
                                            seed=seed, response_format=schema_format(SCHEMA)).choices[0].message.content
             for seed in range(20)]
    assert sum(valid(t) for t in texts) == 20, texts
    free = client.chat.completions.create(model=MODEL, messages=[user(QUESTION)], max_tokens=8)
    assert not valid(free.choices[0].message.content)    # without the mask the demo answers in words
    chunks = list(client.chat.completions.create(model=MODEL, messages=[user(QUESTION)], max_tokens=8, stream=True,
                                                 response_format=schema_format(SCHEMA)))
    assert valid("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))


@pytest.mark.parametrize(("response_format", "message"), [
    (schema_format({"type": "string", "minLength": "x"}), "invalid grammar"),
    ({"type": "json_object"}, "vocabulary cannot start"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs json_schema.schema"),
    ({"type": "yaml"}, "response_format type is"),
])
def test_bad_or_inexpressible_schemas_are_400(stack, response_format, message):
    with pytest.raises(openai.BadRequestError) as e:
        stack.openai().chat.completions.create(model=MODEL, messages=[user(QUESTION)], max_tokens=4,
                                               response_format=response_format)
    assert message in e.value.response.json()["error"]["message"]
