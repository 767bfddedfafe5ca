"""The vLLM/SGLang extension fields apps and eval harnesses send (issue 43), through the official openai client
on the demo model: each honoured one changes what it says it changes, each one this server cannot honour is
a 400 naming it, and a name in no list stays a 400."""

from __future__ import annotations

import httpx
import openai
import pytest

from services.http import openai_fields

from .helpers import KEYS, MAX_TOKENS, MODEL, assistant, dialogue, user

AUTH = {"authorization": f"Bearer {KEYS[0]}"}
D = dialogue(seed=16)                              # turn 1 lists twelve objects: "one ... two ..."
Q, IMAGE = [x.text for x in D.questions], D.scene.png()


def ask(stack, messages, **kwargs):
    return stack.openai().chat.completions.create(model=MODEL, messages=messages,
                                                  max_tokens=kwargs.pop("max_tokens", MAX_TOKENS), **kwargs)


def token_id(stack, text: str) -> int:
    (tid,) = httpx.post(stack.http.url + "/tokenize", json={"prompt": text}, headers=AUTH).json()["tokens"]
    return tid


def test_mm_processor_kwargs_resize_the_images_and_bind_the_session(stack):
    full = ask(stack, [user(Q[0], IMAGE)], max_tokens=4)
    small = ask(stack, [user(Q[0], IMAGE)], max_tokens=4, extra_body={"mm_processor_kwargs": {"max_pixels": 256 * 256}})
    # the 384x384 scene: 144 visual tokens at the checkpoint's range, 64 at 256x256 px
    assert full.usage.prompt_tokens - small.usage.prompt_tokens == 144 - 64
    history = [user(Q[0], IMAGE), assistant(small.choices[0].message.content), user(Q[1])]
    same = ask(stack, history, max_tokens=4, extra_body={"mm_processor_kwargs": {"max_pixels": 256 * 256}})
    assert same.model_extra["raincheck"]["match"] == "continued"
    assert same.usage.prompt_tokens_details.cached_tokens == small.usage.prompt_tokens + 3   # + answer, turn end
    other = ask(stack, history, max_tokens=4)      # the same history at the default range: not the same session
    assert other.model_extra["raincheck"]["match"] == "forked"
    assert other.usage.prompt_tokens - same.usage.prompt_tokens == 144 - 64


@pytest.mark.parametrize(("kwargs", "param", "message"), [
    ({"max_pixels": 10**8}, None, "mm_processor_kwargs.max_pixels must be in [1, 262144]"),
    ({"min_pixels": 128 * 128, "max_pixels": 64 * 64}, None, "min_pixels (16384) is more than max_pixels"),
    ({"do_resize": False}, "mm_processor_kwargs.do_resize", "only min_pixels, max_pixels, fps are"),
    ({"max_pixels": "big"}, "mm_processor_kwargs.max_pixels", "mm_processor_kwargs.max_pixels is a int"),
    ({"fps": -1}, None, "fps must be positive"),
])
def test_mm_processor_kwargs_out_of_range_are_400_naming_them(stack, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        ask(stack, [user(Q[0], IMAGE)], max_tokens=2, extra_body={"mm_processor_kwargs": kwargs})
    err = e.value.response.json()["error"]
    assert message in err["message"] and err["param"] == param


def test_skip_special_tokens_false_keeps_the_special_tokens_generated(stack):
    marker = "<|vision_start|>"
    push = {str(token_id(stack, marker)): 100}      # the model is made to say it
    plain = ask(stack, [user(Q[0])], max_tokens=3, logit_bias=push)
    kept = ask(stack, [user(Q[0])], max_tokens=3, logit_bias=push, extra_body={"skip_special_tokens": False})
    assert plain.choices[0].message.content == "" and kept.choices[0].message.content == marker * 3
    chunks = list(ask(stack, [user(Q[0])], max_tokens=3, logit_bias=push, stream=True,
                      extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": False}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == marker * 3
    # SGLang's /generate takes the same switch in its sampling_params
    text = f"<|im_start|>user\n{Q[0]}<|im_end|>\n<|im_start|>assistant\n"
    params = {"max_new_tokens": 3, "temperature": 0, "logit_bias": push}
    said = [httpx.post(stack.http.url + "/generate", headers=AUTH, timeout=60, json={
        "text": text, "sampling_params": {**params, "skip_special_tokens": skip}}).json()["text"]
        for skip in (True, False)]
    assert said == ["", marker * 3]
    # an answer that ends on its stop token does not show it
    ended = ask(stack, [user(Q[1], IMAGE)], extra_body={"skip_special_tokens": False})
    assert ended.choices[0].finish_reason == "stop" and "<|im_end|>" not in ended.choices[0].message.content


def test_include_stop_str_in_output_keeps_the_stop_string(stack):
    cut = ask(stack, [user(Q[0], IMAGE)], stop=[" two "])
    kept = ask(stack, [user(Q[0], IMAGE)], stop=[" two "], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].finish_reason == "stop"
    assert kept.choices[0].message.content == cut.choices[0].message.content + " two "
    completion = stack.openai().completions.create(model=MODEL, prompt="red and blue", max_tokens=8, stop=["e"],
                                                   extra_body={"include_stop_str_in_output": True})
    assert completion.choices[0].finish_reason == "stop" and completion.choices[0].text.endswith("e")


def test_echo_puts_the_continued_message_in_front_of_the_answer(stack):
    start = "one"
    messages = [user(Q[0], IMAGE), assistant(start)]
    body = {"continue_final_message": True, "echo": True}
    r = ask(stack, messages, extra_body=body)
    plain = ask(stack, messages, extra_body={"continue_final_message": True})
    assert r.choices[0].message.content == start + plain.choices[0].message.content
    chunks = list(ask(stack, messages, extra_body=body, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    # a final user message is not the answer's role: nothing is echoed (vLLM's rule)
    assert ask(stack, [user(Q[0], IMAGE)], extra_body={"echo": True}).choices[0].message.content.startswith("one ")


def test_request_id_names_the_response(stack):
    assert ask(stack, [user(Q[0])], max_tokens=2, extra_body={"request_id": "abc-1"}).id == "chatcmpl-abc-1"
    c = stack.openai().completions.create(model=MODEL, prompt="red", max_tokens=2, extra_body={"request_id": "x"})
    assert c.id == "cmpl-x"


def test_vllms_off_values_are_off(stack):
    greedy = ask(stack, [user(Q[0], IMAGE)])
    off = ask(stack, [user(Q[0], IMAGE)], extra_body={"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0})
    assert off.choices[0].message.content == greedy.choices[0].message.content


ASKING = {"best_of": 2, "use_beam_search": True, "length_penalty": 0.5, "truncate_prompt_tokens": 10,
          "prompt_logprobs": 1, "allowed_token_ids": [1, 2], "bad_words": ["red"], "chat_template": "{{ 'x' }}",
          "documents": [{"text": "a"}], "priority": 1, "cache_salt": "s", "return_tokens_as_token_ids": True}


@pytest.mark.parametrize("name", list(openai_fields.REFUSED_EXTRAS))
def test_a_vllm_extension_that_cannot_be_honoured_is_400_naming_it(stack, name):
    for path, body in (("/chat/completions", {"messages": [user("hi")]}), ("/completions", {"prompt": "hi"})):
        with pytest.raises(openai.BadRequestError) as e:
            stack.openai().post(path, body={"model": MODEL, "max_tokens": 2, **body, name: ASKING[name]},
                                cast_to=object)
        err = e.value.response.json()["error"]
        assert err["param"] == name and err["code"] == "unsupported_parameter"
        assert f"{name} is not supported" in err["message"]


def test_neutral_values_of_the_vllm_extensions_pass(stack):
    neutral = {name: field.neutral[-1] for name, field in openai_fields.REFUSED_EXTRAS.items()}
    r = ask(stack, [user("hi")], max_tokens=2, extra_body={**neutral, "skip_special_tokens": True,
                                                           "spaces_between_special_tokens": True,
                                                           "add_generation_prompt": True, "echo": False})
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_rebuilt_session_renders_its_history_with_the_same_options(stack):
    """The turn log keeps each turn's render options: a session rebuilt elsewhere re-prefills its images at the
    pixel range they were sent with (at the default range the scene would be 80 tokens more)."""
    small = {"mm_processor_kwargs": {"max_pixels": 256 * 256}}

    def two_turns(rebuild: bool):
        stack.settle()
        first = ask(stack, [user(Q[0], IMAGE)], max_tokens=4, extra_body=small)
        if rebuild:
            stack.settle()
            stack.worker.runtime.close(first.model_extra["raincheck"]["session_id"])     # its cache is gone
        history = [user(Q[0], IMAGE), assistant(first.choices[0].message.content), user(Q[1])]
        return first, ask(stack, history, max_tokens=4, extra_body=small)

    first, kept = two_turns(rebuild=False)
    first_again, rebuilt = two_turns(rebuild=True)
    assert first_again.choices[0].message.content == first.choices[0].message.content
    assert kept.usage.prompt_tokens_details.cached_tokens > 0
    assert rebuilt.model_extra["raincheck"]["match"] == "continued"
    assert rebuilt.usage.prompt_tokens_details.cached_tokens == 0           # re-prefilled from the turn log
    assert rebuilt.usage.prompt_tokens == kept.usage.prompt_tokens
