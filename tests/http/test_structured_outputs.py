"""Structured outputs through the official openai client: `response_format` (what `.parse(response_format=Model)`
sends, as langchain's `with_structured_output`, instructor's JSON_SCHEMA mode and litellm do) and vLLM's
`structured_outputs` / `guided_*` names, streamed and not, on completions and with tools.

Two models. A tiny random checkpoint whose vocabulary has every printable ASCII character: greedy decoding on
random weights writes noise, and the mask holds it to the schema, so `.parse` gets a parsed object. The demo
model, whose vocabulary has no braces or quotes (tests/engine/test_grammar.py): it can answer schemas whose
values are `true`, `false` or `null`, and an object schema is a 400 before anything runs, naming what it
cannot write (never a 500, which the openai client would retry twice)."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from .helpers import KEYS, MODEL, Stack, user

QUESTION = "is there a red object in row one ?"
SCHEMA = {"anyOf": [{"type": "boolean"}, {"type": "null"}]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                                          "properties": {"city": {"enum": ["paris", "rome"]}}}}}


class Person(BaseModel):         # bounded: random weights may otherwise write one string to max_tokens
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)


class Answer(BaseModel):
    colour: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=99)
    sure: bool
    note: str | None = Field(max_length=12)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return value is None or isinstance(value, bool)


def token(stack: Stack, text: str) -> int:
    return stack.worker.runtime.engine.formatter.tokenizer.convert_tokens_to_ids(text)


def counting_client(stack: Stack) -> tuple[OpenAI, list[httpx.Request]]:
    """The openai client as users make it (its default retries), and the requests it sends."""
    sent: list[httpx.Request] = []
    http = httpx.Client(event_hooks={"request": [sent.append]}, timeout=120)
    return OpenAI(base_url=stack.http.url + "/v1", api_key=KEYS[0], http_client=http), sent


def test_parse_returns_a_parsed_object(tool_stack):
    client, sent = counting_client(tool_stack)
    for model in (Person, Answer):
        r = client.chat.completions.parse(model=MODEL, messages=[user("who is it ?")], response_format=model,
                                          max_tokens=200)
        assert isinstance(r.choices[0].message.parsed, model), r.choices[0].message.content
    with client.chat.completions.stream(model=MODEL, messages=[user("who is it ?")], response_format=Person,
                                        max_tokens=200) as stream:
        assert isinstance(stream.get_final_completion().choices[0].message.parsed, Person)
    assert len(sent) == 3


def test_parse_on_the_demo_model_is_one_400_naming_what_it_cannot_write(stack):
    client, sent = counting_client(stack)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.parse(model=MODEL, messages=[user(QUESTION)], response_format=Person, max_tokens=8)
    message = e.value.response.json()["error"]["message"]
    assert """the grammar requires '{"name":"', and no token writes '{'""" in message and len(sent) == 1


OBJECT = Person.model_json_schema()
PROMPT = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", {"messages": [user(QUESTION)], "max_tokens": 8, "response_format": schema_format(OBJECT)},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": [user(QUESTION)], "max_tokens": 8,
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [user(QUESTION)], "max_tokens": 8, "guided_json": OBJECT}, "guided_json"),
    ("/v1/chat/completions", {"messages": [user(QUESTION)], "max_tokens": 8, "structured_outputs": {"json": OBJECT}},
     "structured_outputs.json"),
    ("/v1/responses", {"input": QUESTION, "max_output_tokens": 8,
                       "text": {"format": {"type": "json_schema", "name": "p", "schema": OBJECT}}},
     "text.format"),
    ("/generate", {"text": PROMPT, "sampling_params": {"json_schema": json.dumps(OBJECT), "max_new_tokens": 8}},
     "sampling_params.json_schema"),
])
def test_a_schema_the_vocabulary_cannot_write_is_a_400_naming_its_field(stack, path, body, field):
    """What the field's clients show of the refusal is the message: it names the request's field (the worker
    that found the schema unwritable sees only its grammar), and so does `param`."""
    r = httpx.post(stack.http.url + path, json={"model": MODEL, **body}, timeout=120,
                   headers={"authorization": f"Bearer {KEYS[0]}"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == field, error
    assert error["message"].startswith(f"{field}: the model's vocabulary cannot write any answer"), error


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("extra", "check"), [
    ({"guided_json": Person.model_json_schema()}, lambda t: Person.model_validate_json(t)),
    ({"guided_json": json.dumps({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                 "minItems": 2, "maxItems": 3})},
     lambda t: 2 <= len(json.loads(t)) <= 3),
    ({"guided_regex": r"(yes|no), [0-9]{2}\."}, lambda t: re.fullmatch(r"(yes|no), [0-9]{2}\.", t)),
    ({"guided_choice": ["red box", "blue circle"]}, lambda t: t in ("red box", "blue circle")),
    ({"guided_grammar": 'start: "the " colour " one"\ncolour: "red" | "blue"'},
     lambda t: t in ("the red one", "the blue one")),
    ({"guided_grammar": 'root ::= "n=" [0-9] [0-9]'}, lambda t: re.fullmatch(r"n=[0-9]{2}", t)),     # GBNF
    ({"structured_outputs": {"json": Answer.model_json_schema()}}, lambda t: Answer.model_validate_json(t)),
    ({"structured_outputs": {"regex": "[a-c]{3}"}}, lambda t: re.fullmatch("[a-c]{3}", t)),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"grammar": 'start: "x" | "y"'}}, lambda t: t in ("x", "y")),
    ({"structured_outputs": {"json_object": True}, "logit_bias": {"CLOSE": 100}},   # any object: close it
     lambda t: isinstance(json.loads(t), dict)),
])
def test_vllm_names_hold_the_answer(tool_stack, extra, check, stream):
    client = tool_stack.openai()
    if "logit_bias" in extra:
        extra = {**extra, "logit_bias": {str(token(tool_stack, "}")): 100}}
    kwargs = dict(model=MODEL, messages=[user("say it")], max_tokens=200, extra_body=extra)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    else:
        r = client.chat.completions.create(**kwargs)
        assert r.choices[0].finish_reason == "stop"
        text = r.choices[0].message.content
    assert check(text), text


@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_vllm_names(tool_stack, stream):
    client = tool_stack.openai()
    kwargs = dict(model=MODEL, prompt="the answer is", max_tokens=100,
                  extra_body={"structured_outputs": {"json": Person.model_json_schema()}})
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    else:
        text = client.completions.create(**kwargs).choices[0].text
    Person.model_validate_json(text)


@pytest.mark.parametrize("stream", [False, True])
def test_with_tools(tool_stack, stream):
    """tool_choice none: the structured output holds the whole answer; auto: the answer is that output or a
    call (greedy noise picks one; either parses); required: the call's grammar holds it."""
    client = tool_stack.openai()

    def ask(choice: str) -> tuple[str | None, list]:
        kwargs = dict(model=MODEL, messages=[user("weather in paris ?")], tools=[WEATHER], tool_choice=choice,
                      response_format=schema_format(Person.model_json_schema()), max_tokens=200)
        if not stream:
            message = client.chat.completions.create(**kwargs).choices[0].message
            return message.content, message.tool_calls or []
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        content = "".join(c.choices[0].delta.content or "" for c in chunks) or None
        return content, [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]

    content, calls = ask("none")
    Person.model_validate_json(content)
    assert not calls
    content, calls = ask("auto")
    if calls:
        assert json.loads(calls[0].function.arguments)["city"] in ("paris", "rome")
    else:
        Person.model_validate_json(content)
    content, calls = ask("required")
    assert calls and calls[0].function.name == "get_weather"


def test_a_dead_end_while_answering_ends_that_answer_with_its_error(tool_stack):
    """A key the tiny vocabulary cannot write, after a string the up-front search cannot see past (a bias on
    the quote closes it at once): the answer ends with the error naming it, a 400 (one request: the client
    does not retry it) or, streamed, an error event; never a 500. Another request goes on."""
    client, sent = counting_client(tool_stack)
    schema = {"type": "object", "additionalProperties": False, "required": ["a", "é"],
              "properties": {"a": {"type": "string"}, "é": {"type": "integer"}}}
    kwargs = dict(model=MODEL, messages=[user("say it")], max_tokens=40, response_format=schema_format(schema),
                  logit_bias={str(token(tool_stack, '"')): 100})
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kwargs)
    assert "requires 'é\":', and no token writes 'é'" in e.value.response.json()["error"]["message"]
    assert len(sent) == 1
    with httpx.stream("POST", tool_stack.http.url + "/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEYS[0]}"}, json={**kwargs, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "invalid_request_error" and "no token writes 'é'" in error["message"]
    assert client.chat.completions.create(model=MODEL, messages=[user("say it")], max_tokens=4).choices[0].message


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one structured output per request"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex",
     "one structured output per request"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "is not supported"),
    ({"guided_regex": "("}, "guided_regex", "invalid grammar"),
    ({"guided_grammar": "start: ((("}, "guided_grammar", "invalid grammar"),
    ({"guided_choice": []}, "guided_choice", "a list of non-empty strings"),
    ({"guided_json": "{not json"}, "guided_json", "is a JSON schema"),
    ({"guided_json": {"type": "string", "minLength": "x"}}, "guided_json", "invalid grammar"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "is true"),
])
def test_bad_structured_outputs_are_400_naming_the_field(tool_stack, extra, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        tool_stack.openai().chat.completions.create(model=MODEL, messages=[user("say it")], max_tokens=4,
                                                    extra_body=extra)
    error = e.value.response.json()["error"]
    assert error["param"] == param and message in error["message"]


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
    ({"type": "json_object"}, "at the start the grammar requires '{', and no token writes '{'"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs json_schema.schema"),
    ({"type": "yaml"}, "response_format type is"),
])
def test_bad_or_inexpressible_schemas_are_400(stack, response_format, message):
    with pytest.raises(openai.BadRequestError) as e:
        stack.openai().chat.completions.create(model=MODEL, messages=[user(QUESTION)], max_tokens=4,
                                               response_format=response_format)
    assert message in e.value.response.json()["error"]["message"]
