"""Tool calls through the official openai client on a tiny random checkpoint whose chat template renders
tools in Qwen's format (tests/http/data/qwen_tool_format.jinja): its answers are noise, so what is
checked is the wire format end to end. A forced call (`required`, a named function) is held to the
call's grammar, so it always parses into `tool_calls`, streamed or not; tool results go back through the
template; what a tool chat cannot do is a 400."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from .helpers import MODEL, random_model_stack

TEMPLATE = Path(__file__).parent / "data" / "qwen_tool_format.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"enum": ["paris", "rome"]}, "unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"enum": ["utc", "cet"]}}}}}
ASK = [{"role": "user", "content": "what is the weather in paris ?"}]


@pytest.fixture(scope="module")
def tool_stack(tmp_path_factory):
    stack = random_model_stack(tmp_path_factory.mktemp("tool-model"), TEMPLATE)
    yield stack
    stack.close()


def ask(stack, **kwargs):
    return stack.openai().chat.completions.create(model=MODEL, messages=kwargs.pop("messages", ASK),
                                                  max_tokens=kwargs.pop("max_tokens", 160), **kwargs)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def check_call(call, name: str) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == name
    arguments = json.loads(call.function.arguments)
    params = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"]
    assert set(arguments) == set(params["required"])
    assert all(arguments[k] in params["properties"][k]["enum"] for k in arguments)
    return arguments


def test_a_named_function_is_called(tool_stack):
    r = ask(tool_stack, tools=[WEATHER, TIME], tool_choice=named("get_time"))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0], "get_time")
    assert choice.message.content is None and r.usage.prompt_tokens > 0


def test_a_required_call_streams_as_tool_calls_deltas(tool_stack):
    chunks = list(ask(tool_stack, tools=[WEATHER, TIME], tool_choice="required", stream=True,
                      stream_options={"include_usage": True}))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["tool_calls"] and [d.index for d in deltas] == [0]
    check_call(deltas[0], deltas[0].function.name)
    assert chunks[-1].usage.completion_tokens > 0


def test_tool_results_go_back_through_the_template(tool_stack):
    first = ask(tool_stack, tools=[WEATHER], tool_choice="required").choices[0].message
    call = first.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny , 21 degrees"}]
    again = ask(tool_stack, messages=history, tools=[WEATHER], tool_choice=named("get_weather"))
    check_call(again.choices[0].message.tool_calls[0], "get_weather")
    first_usage = ask(tool_stack, tools=[WEATHER], tool_choice="required").usage
    assert again.usage.prompt_tokens > first_usage.prompt_tokens + 10     # the call and its result were rendered
    auto = ask(tool_stack, messages=history, tools=[WEATHER], max_tokens=8)     # noise: content or a call
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(tools=[WEATHER], tool_choice=named("nope")), "tool_choice is none, auto, required or one of"),
    (dict(tools=[WEATHER], logprobs=True), "logprobs cannot be combined with tools"),
    (dict(tools=[{"type": "function"}]), "tools[0] is"),
    (dict(tool_choice="required"), "tool_choice needs tools"),
    (dict(tools=[WEATHER], functions=[{"name": "f"}]), "functions is not supported"),
])
def test_what_a_tool_chat_cannot_do_is_400(tool_stack, kwargs, message):
    with pytest.raises(openai.BadRequestError) as e:
        ask(tool_stack, **kwargs)
    assert message in e.value.response.json()["error"]["message"]
