"""OpenAI's Responses API through the official openai client (`client.responses`), on the demo model: a
conversation continued by `previous_response_id` continues the session that answered it (only the new input
is prefilled), streamed events in OpenAI's order, stored responses retrieved and deleted by their own key
only, and what the API cannot do is a 400 naming it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent, response_create_params

from services.common.grpc_util import ServiceError
from services.http import openai_fields
from services.http.responses_request import ResponsesRequest
from services.http.responses_stream import stream_events

from .helpers import KEYS, MAX_TOKENS, MODEL, data_url, dialogue

D = dialogue(seed=16)                    # turn 1 lists twelve objects, then two questions about them
Q, IMAGE = [x.text for x in D.questions], D.scene.png()


def first_input() -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(IMAGE)},
                                         {"type": "input_text", "text": Q[0]}]}]


def create(stack, key: str = KEYS[0], **kwargs):
    return stack.openai(key).responses.create(model=MODEL, max_output_tokens=kwargs.pop("max_output_tokens",
                                                                                        MAX_TOKENS), **kwargs)


def test_previous_response_id_continues_the_session(stack):
    """The acceptance test of issue 43: the second response's input tokens were mostly held by the session."""
    r1 = create(stack, input=first_input())
    assert r1.object == "response" and r1.status == "completed" and r1.id.startswith("resp_")
    (message,) = r1.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert r1.output_text == message.content[0].text and r1.output_text.startswith("one ")
    assert r1.usage.input_tokens_details.cached_tokens == 0 and r1.usage.output_tokens > 0
    r2 = create(stack, input=Q[1], previous_response_id=r1.id)
    assert r2.previous_response_id == r1.id and r2.output_text
    assert r2.usage.input_tokens_details.cached_tokens > 0
    assert r2.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens - 1
    assert r2.model_extra["raincheck"]["match"] == "continued"
    assert r2.model_extra["raincheck"]["session_id"] == r1.model_extra["raincheck"]["session_id"]
    r3 = create(stack, input=Q[2], previous_response_id=r2.id)
    assert r3.model_extra["raincheck"]["match"] == "continued" and r3.usage.input_tokens_details.cached_tokens > \
        r2.usage.input_tokens_details.cached_tokens


def test_the_same_answers_as_chat_completions(stack):
    """A response is the chat it stands for: the same answers, turn by turn, as the chat completion."""
    r1 = create(stack, input=first_input())
    r2 = create(stack, input=Q[1], previous_response_id=r1.id)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMAGE)}},
                                             {"type": "text", "text": Q[0]}]}]
    c1 = stack.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
    messages += [{"role": "assistant", "content": c1.choices[0].message.content}, {"role": "user", "content": Q[1]}]
    c2 = stack.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
    assert [r1.output_text, r2.output_text] == [c1.choices[0].message.content, c2.choices[0].message.content]
    assert r2.usage.input_tokens == c2.usage.prompt_tokens


def test_a_branch_from_an_earlier_response_forks(stack):
    r1 = create(stack, input=first_input())
    create(stack, input=Q[1], previous_response_id=r1.id)          # the session moves on
    again = create(stack, input=Q[2], previous_response_id=r1.id)  # another branch from r1
    assert again.model_extra["raincheck"]["match"] == "forked" and again.output_text


def test_streamed_events_in_openais_order(stack):
    r1 = create(stack, input=first_input())
    events = list(create(stack, input=Q[1], previous_response_id=r1.id, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert text == events[-4].text == done.output_text and done.status == "completed"
    assert done.usage.input_tokens_details.cached_tokens > 0
    assert create(stack, input=Q[2], previous_response_id=done.id).model_extra["raincheck"]["match"] == "continued"


def test_a_streamed_response_reaching_its_limit_is_incomplete(stack):
    events = list(create(stack, input=first_input(), max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete" and final.usage.output_tokens == 3


def test_instructions_are_a_system_message_not_carried_over(stack):
    r1 = create(stack, input=Q[0], instructions="answer in lists .")
    plain = create(stack, input=Q[0])
    assert r1.instructions == "answer in lists ." and r1.usage.input_tokens > plain.usage.input_tokens
    same = create(stack, input=Q[1], previous_response_id=r1.id, instructions="answer in lists .")
    assert same.model_extra["raincheck"]["match"] == "continued"
    dropped = create(stack, input=Q[1], previous_response_id=r1.id)      # OpenAI's rule: not carried over
    assert dropped.model_extra["raincheck"]["match"] == "forked"


def test_retrieve_delete_and_input_items(stack):
    r1 = create(stack, input=first_input(), metadata={"k": "v"})
    got = stack.openai().responses.retrieve(r1.id)
    assert got.id == r1.id and got.output_text == r1.output_text and got.metadata == {"k": "v"}
    items = stack.openai().responses.input_items.list(r1.id).data
    assert [i.type for i in items] == ["message"] and items[0].content[0].type == "input_image"
    assert items[0].content[0].image_url == data_url(IMAGE) and items[0].content[1].text == Q[0]
    with pytest.raises(openai.NotFoundError):                  # another key's is not there for it
        stack.openai(KEYS[1]).responses.retrieve(r1.id)
    with pytest.raises(openai.NotFoundError):
        create(stack, KEYS[1], input=Q[1], previous_response_id=r1.id)
    stack.openai().responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        stack.openai().responses.retrieve(r1.id)
    with pytest.raises(openai.NotFoundError) as e:
        create(stack, input=Q[1], previous_response_id=r1.id)
    assert e.value.response.json()["error"]["param"] == "previous_response_id"


def test_store_false_keeps_nothing(stack):
    r = create(stack, input=Q[0], store=False)
    assert r.store is False and r.output_text
    with pytest.raises(openai.NotFoundError):
        stack.openai().responses.retrieve(r.id)


def test_logprobs_when_included(stack):
    r = create(stack, input=Q[0], include=["message.output_text.logprobs"], top_logprobs=2, max_output_tokens=4)
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens and all(len(t.top_logprobs) == 2 for t in logprobs)
    assert "".join(t.token for t in logprobs).strip() == r.output_text.strip()


def test_structured_output_through_text_format(stack):
    """text.format is chat's response_format (the demo vocabulary can write true, false and null only)."""
    schema = {"anyOf": [{"type": "boolean"}, {"type": "null"}]}
    r = create(stack, input="is there a red object in row one ?",
               text={"format": {"type": "json_schema", "name": "b", "schema": schema, "strict": True}})
    assert r.output_text in ("true", "false", "null") and r.text.format.type == "json_schema"
    with pytest.raises(openai.BadRequestError) as e:
        create(stack, input=Q[0], text={"format": {"type": "json_object"}})
    assert "vocabulary cannot write" in e.value.response.json()["error"]["message"]


RESPONSE_KEYS = sorted(response_create_params.ResponseCreateParamsStreaming.__required_keys__
                       | response_create_params.ResponseCreateParamsStreaming.__optional_keys__)


def test_every_responses_field_is_declared_modelled_and_documented():
    assert set(RESPONSE_KEYS) <= set(openai_fields.RESPONSES), "declare it in services/http/openai_fields.py"
    assert set(openai_fields.RESPONSES) <= set(ResponsesRequest.model_fields)
    docs = (Path(__file__).resolve().parents[2] / "docs/services.md").read_text()
    section = docs[docs.index("### Responses API"):docs.index("### Completions, tokenizer, metrics")]
    for name, field in openai_fields.RESPONSES.items():
        assert f"| `{name}` | {field.status} |" in section, f"{name} is missing from the responses fields table"


ASKING = {"truncation": "auto", "reasoning": {"effort": "high"}, "background": True, "conversation": "conv_1",
          "prompt": {"id": "pmpt_1"}, "service_tier": "flex", "context_management": [{"type": "compaction"}]}


@pytest.mark.parametrize("name", [k for k in RESPONSE_KEYS
                                  if openai_fields.RESPONSES[k].status == openai_fields.REFUSED])
def test_a_refused_responses_field_is_400_naming_it(stack, name):
    with pytest.raises(openai.BadRequestError) as e:
        stack.openai().post("/responses", body={"model": MODEL, "input": "hi", name: ASKING.get(name, True)},
                            cast_to=object)
    err = e.value.response.json()["error"]
    assert err["param"] == name and err["code"] == "unsupported_parameter"


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "'item_reference' is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]",
     "parts are input_text or input_image"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]}, "input[0].content[0]",
     "files are not stored here"),
    ({"input": [{"role": "critic", "content": "hi"}]}, "input[0].role", "role is one of"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]", "only function tools"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include", "only 'message.output_text.logprobs'"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id", "no response with id"),
    ({}, "input", "input is required"),
    ({"input": "hi", "n_things": 2}, "n_things", "Extra inputs are not permitted"),
])
def test_what_a_response_cannot_take_is_4xx_naming_it(stack, body, param, message):
    with pytest.raises(openai.APIStatusError) as e:
        stack.openai().post("/responses", body={"model": MODEL, **body}, cast_to=object)
    err = e.value.response.json()["error"]
    assert e.value.status_code in (400, 404) and err["param"] == param and message in err["message"]
    assert err["code"]


def test_a_failed_request_fails_alone(stack):
    """A request refused mid-way (a bad image after a good conversation) leaves the conversation continuable."""
    r1 = create(stack, input=first_input())
    bad = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
                                        {"type": "input_text", "text": Q[1]}]}]
    with pytest.raises(openai.BadRequestError):
        create(stack, input=bad, previous_response_id=r1.id)
    r2 = create(stack, input=Q[1], previous_response_id=r1.id)
    assert r2.model_extra["raincheck"]["match"] == "continued"


def raw_events(stack, body: dict) -> list[dict]:
    """The server-sent events of a streamed response as sent: `event: <type>` then its data."""
    with httpx.stream("POST", stack.http.url + "/v1/responses", json={"model": MODEL, "stream": True, **body},
                      headers={"authorization": f"Bearer {KEYS[0]}"}, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    events = []
    for name, data in zip(lines[::2], lines[1::2], strict=True):
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


def test_bodies_and_events_validate_against_openais_types(stack):
    """The openai client builds its objects without validating them: check the shapes strictly here."""
    body = create(stack, input=first_input(), include=["message.output_text.logprobs"]).model_dump(exclude_unset=True)
    Response.model_validate(body)
    stream_event = pydantic.TypeAdapter(ResponseStreamEvent)
    for event in raw_events(stack, {"input": first_input(), "max_output_tokens": 5}):
        stream_event.validate_python(event)


def test_a_failure_mid_stream_is_an_error_event_then_response_failed():
    async def pieces():
        yield "one ", []
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the worker went away")

    saved = []
    request = ResponsesRequest(model=MODEL, input="hi")

    async def collect() -> list[dict]:
        events = stream_events(request, "resp_x", 0, pieces(), lambda: None, lambda *a: saved.append(a))
        return [e async for e in events]

    events = asyncio.run(collect())
    assert [e["type"] for e in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert events[-2]["code"] == "unavailable" and "went away" in events[-2]["message"]
    failed = Response.model_validate(events[-1]["response"])
    assert failed.status == "failed" and failed.error.code == "server_error" and not saved
