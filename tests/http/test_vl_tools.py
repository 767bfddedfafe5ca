"""Tools and images in one chat, and the chat template's variables, through the official openai client on a tiny
random checkpoint whose template renders both in Qwen3-VL's shape (tests/http/data/qwen_vl_tool_format.jinja,
with Qwen3's `enable_thinking`): a screenshot next to the tools is what a Qwen3-VL agent sends. Its answers
are noise, so what is checked is what the model was given (prompt tokens) and the wire format."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.multimodal.mm_helpers import png

from .helpers import KEYS, MODEL, assistant, data_url, random_model_stack, user
from .test_tools import WEATHER, check_call, named

TEMPLATE = Path(__file__).parent / "data" / "qwen_vl_tool_format.jinja"
THINK = "<think>\n\n</think>\n\n"
QUESTION = "what is the weather in paris ?"


@pytest.fixture(scope="module")
def vl_stack(tmp_path_factory):
    stack = random_model_stack(tmp_path_factory.mktemp("vl-tool-model"), TEMPLATE)
    yield stack
    stack.close()


def ask(stack, messages, **kwargs):
    return stack.openai().chat.completions.create(model=MODEL, messages=messages,
                                                  max_tokens=kwargs.pop("max_tokens", 160), **kwargs)


def tokens(stack, text: str) -> int:
    r = httpx.post(stack.http.url + "/tokenize", json={"prompt": text}, headers={"authorization": f"Bearer {KEYS[0]}"})
    return r.json()["count"]


SCREENSHOT = png(96, 64)


def test_a_tool_call_about_an_image(vl_stack):
    with_image = ask(vl_stack, [user(QUESTION, SCREENSHOT)], tools=[WEATHER], tool_choice="required")
    choice = with_image.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_call(choice.message.tool_calls[0], "get_weather")
    text_only = ask(vl_stack, [user(QUESTION)], tools=[WEATHER], tool_choice="required")
    # the image's tokens and its vision_start/end were in the prompt: the model saw the screenshot
    assert with_image.usage.prompt_tokens > text_only.usage.prompt_tokens + 2


def test_a_streamed_tool_call_about_an_image_and_its_result(vl_stack):
    chunks = list(ask(vl_stack, [user(QUESTION, SCREENSHOT)], tools=[WEATHER], tool_choice=named("get_weather"),
                      stream=True, stream_options={"include_usage": True}))
    (delta,) = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    check_call(delta, "get_weather")
    history = [user(QUESTION, SCREENSHOT), {"role": "assistant", "content": None, "tool_calls": [
        {"id": delta.id, "type": "function", "function": {"name": "get_weather",
                                                          "arguments": delta.function.arguments}}]},
               {"role": "tool", "tool_call_id": delta.id, "content": "sunny , 21 degrees"},
               user("and in this picture ?", png(64, 64, "green"))]
    again = ask(vl_stack, history, tools=[WEATHER], max_tokens=4)
    assert again.usage.prompt_tokens > chunks[-1].usage.prompt_tokens       # both images, the call, its result
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_an_image_in_an_assistant_message_of_a_tool_chat_is_400(vl_stack):
    bad = {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": data_url(SCREENSHOT)}}]}
    with pytest.raises(openai.BadRequestError) as e:
        ask(vl_stack, [user("hi"), bad, user(QUESTION)], tools=[WEATHER])
    assert "messages[1].content[0]" in e.value.response.json()["error"]["message"]


def test_chat_template_kwargs_reach_the_template_of_sessions_and_tool_chats(vl_stack):
    think = tokens(vl_stack, THINK)
    plain = ask(vl_stack, [user(QUESTION)], max_tokens=2)
    off = ask(vl_stack, [user(QUESTION)], max_tokens=2, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens == plain.usage.prompt_tokens + think
    tool_plain = ask(vl_stack, [user(QUESTION, SCREENSHOT)], tools=[WEATHER], max_tokens=2)
    tool_off = ask(vl_stack, [user(QUESTION, SCREENSHOT)], tools=[WEATHER], max_tokens=2,
                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert tool_off.usage.prompt_tokens == tool_plain.usage.prompt_tokens + think


def test_a_session_continues_only_with_the_same_template_kwargs(vl_stack):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    first = ask(vl_stack, [user(QUESTION, SCREENSHOT)], max_tokens=4, extra_body=off)
    history = [user(QUESTION, SCREENSHOT), assistant(first.choices[0].message.content), user("and rome ?")]
    same = ask(vl_stack, history, max_tokens=4, extra_body=off)
    assert same.model_extra["raincheck"]["match"] == "continued"
    assert same.model_extra["raincheck"]["session_id"] == first.model_extra["raincheck"]["session_id"]
    assert same.usage.prompt_tokens_details.cached_tokens > 0
    history[-1] = user("and berlin ?")
    other = ask(vl_stack, history, max_tokens=4, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert other.model_extra["raincheck"]["match"] == "forked"     # rendered otherwise: re-prefilled


def test_add_generation_prompt_false_renders_no_assistant_prompt(vl_stack):
    plain = ask(vl_stack, [user(QUESTION)], max_tokens=2)
    bare = ask(vl_stack, [user(QUESTION)], max_tokens=2, extra_body={"add_generation_prompt": False})
    assert plain.usage.prompt_tokens == bare.usage.prompt_tokens + tokens(vl_stack, "<|im_start|>assistant\n")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"add_generation_prompt": True}, "cannot set 'add_generation_prompt'"),
    ({"bos_token": "<|im_start|>"}, "cannot set 'bos_token'"),
    ({"persona": "<|im_start|>system"}, "chat_template_kwargs.persona contains the reserved token"),
])
def test_template_kwargs_a_request_may_not_set_are_400(vl_stack, kwargs, message):
    for tools in ({}, {"tools": [WEATHER]}):
        with pytest.raises(openai.BadRequestError) as e:
            ask(vl_stack, [user(QUESTION)], max_tokens=2, extra_body={"chat_template_kwargs": kwargs}, **tools)
        assert message in e.value.response.json()["error"]["message"]


# -- the same through the Responses API ----------------------------------------------------------------------------

RESPONSE_TOOL = {"type": "function", "name": "get_weather", "description": WEATHER["function"]["description"],
                 "parameters": WEATHER["function"]["parameters"], "strict": True}


def screenshot_input(text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(SCREENSHOT)},
                                         {"type": "input_text", "text": text}]}]


def check_function_call(item) -> None:
    """A function_call item as check_call reads a chat tool call."""
    check_call(SimpleNamespace(type="function", id=item.call_id, function=SimpleNamespace(
        name=item.name, arguments=item.arguments)), "get_weather")


def respond(stack, **kwargs):
    return stack.openai().responses.create(model=MODEL, max_output_tokens=kwargs.pop("max_output_tokens", 160),
                                           tools=[RESPONSE_TOOL], **kwargs)


def test_a_response_calls_a_function_about_an_image_and_takes_its_output(vl_stack):
    r1 = respond(vl_stack, input=screenshot_input(), tool_choice="required")
    (call,) = r1.output
    Response.model_validate(r1.model_dump(exclude_unset=True))
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.status == "completed"
    check_function_call(call)
    text_only = respond(vl_stack, input=QUESTION, tool_choice="required")
    assert r1.usage.input_tokens > text_only.usage.input_tokens + 2          # the screenshot was in the prompt
    # the tool's answer, a screenshot of its own among it, continues the conversation
    output = [{"type": "function_call_output", "call_id": call.call_id, "output": [
        {"type": "input_text", "text": "sunny , 21 degrees"},
        {"type": "input_image", "image_url": data_url(png(64, 64, "green"))}]}]
    r2 = respond(vl_stack, input=output, previous_response_id=r1.id, max_output_tokens=4)
    assert r2.status in ("completed", "incomplete") and r2.usage.input_tokens > r1.usage.input_tokens + 2
    items = vl_stack.openai().responses.input_items.list(r2.id, order="asc").data
    assert [i.type for i in items] == ["function_call_output"]


def test_a_streamed_function_call(vl_stack):
    events = list(respond(vl_stack, input=screenshot_input(), tool_choice={"type": "function", "name": "get_weather"},
                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    added = next(e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert added.item.arguments == "" and done.item_id == added.item.id
    (call,) = [i for i in events[-1].response.output if i.type == "function_call"]
    assert call.arguments == done.arguments and call.id == added.item.id
    check_function_call(call)
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)     # the client builds them unvalidated: check here
    for e in events:
        adapter.validate_python(e.model_dump(exclude_unset=True))


def test_what_a_response_with_tools_cannot_do_names_the_responses_field(vl_stack):
    with pytest.raises(openai.BadRequestError) as e:
        respond(vl_stack, input=QUESTION, include=["message.output_text.logprobs"])
    err = e.value.response.json()["error"]
    assert err["param"] == "include" and "include cannot be combined with tools" in err["message"]


def test_a_response_with_tools_takes_a_structured_output(vl_stack):
    """text.format beside tools: the answer is a JSON object or function calls (one grammar of both)."""
    r = respond(vl_stack, input=QUESTION, text={"format": {"type": "json_object"}}, max_output_tokens=200)
    if r.output[0].type == "function_call":
        check_function_call(r.output[0])
    else:
        assert isinstance(json.loads(r.output_text), dict)
