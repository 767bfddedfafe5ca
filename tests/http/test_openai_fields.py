"""No field of OpenAI's chat or completions request is silently ignored: every field the openai package's request type
has is declared in services/http/openai_fields.py, each refused one is a 400 naming it when it asks for
something, each honoured or bookkeeping one is accepted, and a field in no list is a 400."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from services.http import openai_fields
from services.http.completions import CompletionRequest
from services.http.openai_api import ChatCompletionRequest

from .helpers import MODEL, user

CHAT_KEYS = sorted(chat_params.CompletionCreateParamsStreaming.__required_keys__
                   | chat_params.CompletionCreateParamsStreaming.__optional_keys__)
# a value asking for something, per refused field (others: True)
ASKING = {"service_tier": "flex",
          "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
          "tool_choice": "required", "functions": [{"name": "f", "parameters": {}}], "function_call": "auto",
          "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"},
          "reasoning_effort": "high", "verbosity": "low"}
# a non-default value, per honoured or bookkeeping field
SETTING = {"max_tokens": 4, "max_completion_tokens": 4, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["zzz"],
           "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"5": 1.0}, "logprobs": True,
           "top_logprobs": 2, "user": "u1", "metadata": {"k": "v"}, "safety_identifier": "s1",
           "prompt_cache_key": "c1", "stream_options": {"include_usage": True},
           "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "boolean"}}},
           "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "none",
           "parallel_tool_calls": False, "n": 2}
# the demo model's template renders no tools: offering it some is refused as such (tests/http/test_tools.py
# shows these fields honoured on a checkpoint whose template renders them)
NO_TOOLS_HERE = {"tools", "parallel_tool_calls"}
FIXED = {"model", "messages", "stream"}    # every request sets them


def test_every_openai_chat_field_is_declared_and_modelled():
    assert set(CHAT_KEYS) <= set(openai_fields.CHAT), "declare it in services/http/openai_fields.py"
    assert set(openai_fields.CHAT) <= set(ChatCompletionRequest.model_fields)
    assert set(openai_fields.EXTRAS) <= set(ChatCompletionRequest.model_fields)


@pytest.mark.parametrize("name", [k for k in CHAT_KEYS if openai_fields.CHAT[k].status == openai_fields.REFUSED])
def test_a_refused_field_asking_for_something_is_400(stack, name):
    body = {"model": MODEL, "messages": [user("hi")], "max_tokens": 2, name: ASKING.get(name, True)}
    with pytest.raises(openai.BadRequestError) as e:
        stack.openai().post("/chat/completions", body=body, cast_to=object)
    err = e.value.response.json()["error"]
    assert err["param"] == name and f"{name} is not supported" in err["message"]


@pytest.mark.parametrize("name", [k for k in CHAT_KEYS
                                  if openai_fields.CHAT[k].status != openai_fields.REFUSED and k not in FIXED])
def test_an_honoured_or_bookkeeping_field_is_accepted(stack, name):
    body = {"model": MODEL, "messages": [user("hi")], "max_tokens": 2, name: SETTING[name],
            "stream": name == "stream_options"}
    if name == "top_logprobs":
        body["logprobs"] = True
    if name == "parallel_tool_calls":
        body["tools"] = SETTING["tools"]
    if name in NO_TOOLS_HERE:
        with pytest.raises(openai.BadRequestError, match="does not render tools"):
            stack.openai().post("/chat/completions", body=body, cast_to=object)
        return
    assert_answered(stack, "/chat/completions", body)


def assert_answered(stack, path: str, body: dict) -> None:
    response = stack.openai().post(path, body=body, cast_to=object, stream=body["stream"],
                                   stream_cls=openai.Stream[object])
    if body["stream"]:
        assert list(response)
    else:
        assert response["choices"][0]["finish_reason"] in ("stop", "length")


def test_neutral_values_of_refused_fields_pass(stack):
    r = stack.openai().chat.completions.create(model=MODEL, messages=[user("hi")], max_tokens=2, n=1,
                                               response_format={"type": "text"}, store=False, tools=[])
    assert r.choices[0].finish_reason in ("stop", "length")


COMPLETION_KEYS = sorted(completion_params.CompletionCreateParamsStreaming.__required_keys__
                         | completion_params.CompletionCreateParamsStreaming.__optional_keys__)
COMPLETION_ASKING = {"n": 2, "best_of": 2, "suffix": "end"}
COMPLETION_SETTING = {**SETTING, "echo": True, "logprobs": 2}
COMPLETION_FIXED = {"model", "prompt", "stream"}


def test_every_openai_completions_field_is_declared_and_modelled():
    assert set(COMPLETION_KEYS) <= set(openai_fields.COMPLETIONS), "declare it in services/http/openai_fields.py"
    assert set(openai_fields.COMPLETIONS) | set(openai_fields.EXTRAS) <= set(CompletionRequest.model_fields)


@pytest.mark.parametrize("name", [k for k in COMPLETION_KEYS
                                  if openai_fields.COMPLETIONS[k].status == openai_fields.REFUSED])
def test_a_refused_completions_field_is_400(stack, name):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, name: COMPLETION_ASKING[name]}
    with pytest.raises(openai.BadRequestError) as e:
        stack.openai().post("/completions", body=body, cast_to=object)
    assert e.value.response.json()["error"]["param"] == name
    assert e.value.response.json()["error"]["code"] == "unsupported_parameter"


@pytest.mark.parametrize("name", [k for k in COMPLETION_KEYS
                                  if openai_fields.COMPLETIONS[k].status != openai_fields.REFUSED
                                  and k not in COMPLETION_FIXED])
def test_an_honoured_completions_field_is_accepted(stack, name):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, name: COMPLETION_SETTING[name],
            "stream": name == "stream_options"}
    assert_answered(stack, "/completions", body)


def test_docs_table_lists_every_field():
    docs = (Path(__file__).resolve().parents[2] / "docs/services.md").read_text()
    for name in {*openai_fields.CHAT, *openai_fields.COMPLETIONS}:
        assert f"| `{name}` |" in docs, f"{name} is missing from the OpenAI fields table of the services doc"


@pytest.mark.parametrize("name", openai_fields.CHAT_ONLY)
def test_a_chat_only_extra_is_400_on_completions(stack, name):
    value = {"policy": "full", "selector": "uniform", "recovery_mode": "colocated", "retention": 0.5,
             "tpot_slo": 1.5, "add_generation_prompt": False, "chat_template_kwargs": {"enable_thinking": False},
             "mm_processor_kwargs": {"max_pixels": 4096}}.get(
        name, True if name in ("continue_final_message", "deterministic") else 7)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, name: value}
    with pytest.raises(openai.BadRequestError) as e:
        stack.openai().post("/completions", body=body, cast_to=object)
    assert e.value.response.json()["error"]["param"] == name
    assert e.value.response.json()["error"]["code"] == "unsupported_parameter"
