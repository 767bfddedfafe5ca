"""The session-free routes with the official openai client and plain HTTP: `/v1/completions` (strings,
token ids, lists, echo, logprobs, streaming, stop strings), lm-eval's loglikelihood through echo +
logprobs equal to the engine's (<= 1e-5), `/v1/models/{id}`, `/tokenize` / `/detokenize`, `/metrics`."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from raincheck_core import Prompt, SamplingParams
from tests.demo.helpers import FOLDER, engine

from .helpers import KEYS, MODEL

# the demo model answers chat-formatted text (its vocabulary is its synthetic world's words)
CONTEXT = "<|im_start|>user\nwhat colour is the object in row one column one ?<|im_end|>\n<|im_start|>assistant\n"
CONTINUATION = "red"
HEADERS = {"authorization": f"Bearer {KEYS[0]}"}


def ids_of(text: str) -> list[int]:
    return engine(FOLDER).formatter.encode(text)


def test_completion_answers_as_the_engine_does(stack):
    prompt = ids_of(CONTEXT)
    want = engine(FOLDER).open_session().turn(Prompt(prompt), SamplingParams(max_new_tokens=6)).result()
    client = stack.openai()
    by_text = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=6)
    by_ids = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6)
    assert want.text == "red"
    assert by_text.object == "text_completion" and by_text.choices[0].text == want.text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(prompt) and by_text.usage.completion_tokens == len(want.token_ids)
    both = client.completions.create(model=MODEL, prompt=[CONTEXT, "a blue"], max_tokens=6)
    assert [c.index for c in both.choices] == [0, 1] and both.choices[0].text == want.text
    streamed = list(client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=6, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text
    assert streamed[-1].usage.completion_tokens == len(want.token_ids)
    assert stack.worker.runtime.engine.sessions == {}     # stateless: nothing stays open


def test_loglikelihood_through_echo_and_logprobs_equals_the_engines(stack):
    """As lm-eval scores a continuation: echo the whole text with logprobs, sum the continuation's."""
    context, whole = ids_of(CONTEXT), ids_of(CONTEXT + CONTINUATION)
    r = stack.openai().completions.create(model=MODEL, prompt=CONTEXT + CONTINUATION, max_tokens=0, echo=True,
                                          logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == CONTEXT + CONTINUATION and lp.token_logprobs[0] is None
    assert len(lp.tokens) == len(whole) and lp.text_offset[0] == 0
    logp = torch.log_softmax(engine(FOLDER).forward_logits(torch.tensor(whole)), -1)
    want = [float(logp[i - 1, whole[i]]) for i in range(1, len(whole))]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want, strict=True)) <= 1e-5
    n = len(whole) - len(context)
    assert abs(sum(lp.token_logprobs[-n:]) - sum(want[-n:])) <= 1e-5
    greedy = [int(logp[i - 1].argmax()) == whole[i] for i in range(len(context), len(whole))]
    assert [max(top, key=top.get) == tok for top, tok in zip(lp.top_logprobs[-n:], lp.tokens[-n:],
                                                             strict=True)] == greedy
    # max_tokens 1, as older lm-eval asks: the prompt's logprobs, then one answer token's
    one = stack.openai().completions.create(model=MODEL, prompt=whole, max_tokens=1, echo=True, logprobs=0)
    assert one.choices[0].logprobs.token_logprobs[:len(whole)] == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert len(one.choices[0].logprobs.tokens) == len(whole) + 1


def test_a_stop_string_ends_a_completion(stack):
    full = stack.openai().completions.create(model=MODEL, prompt=CONTEXT, max_tokens=8).choices[0].text
    assert full == "red"
    r = stack.openai().completions.create(model=MODEL, prompt=CONTEXT, max_tokens=8, stop=["e"])
    assert (r.choices[0].finish_reason, r.choices[0].text) == ("stop", "r")


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(prompt=CONTEXT, best_of=3), "best_of is not supported"),
    (dict(prompt=CONTEXT, suffix="x"), "suffix is not supported"),
    (dict(prompt=CONTEXT, n=2), "n is not supported"),
    (dict(prompt=[10**8]), "token ids must be in"),
    (dict(prompt=CONTEXT, max_tokens=0), "max_tokens 0 asks for nothing"),
    (dict(prompt=CONTEXT, logprobs=21), "logprobs"),
])
def test_bad_completions_are_400(stack, kwargs, message):
    with pytest.raises(openai.BadRequestError) as e:
        stack.openai().completions.create(model=MODEL, **{"max_tokens": 4, **kwargs})
    assert message in e.value.response.json()["error"]["message"]


def test_models_retrieve_tokenize_detokenize_metrics(stack):
    client = stack.openai()
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    url = stack.http.url
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": CONTEXT}, headers=HEADERS).json()
    assert r["tokens"] == ids_of(CONTEXT) and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    back = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]}, headers=HEADERS).json()
    assert back["prompt"] == CONTEXT
    assert httpx.post(url + "/tokenize", json={"prompt": CONTEXT}).status_code == 401
    metrics = httpx.get(url + "/metrics")
    assert metrics.status_code == 200 and "raincheck:http_session_matches" in metrics.text


def test_a_final_assistant_message_is_continued(stack):
    from .helpers import assistant, user

    question = "what colour is the object in row one column one ?"
    client = stack.openai()
    with pytest.raises(openai.BadRequestError, match="send continue_final_message: true"):
        client.chat.completions.create(model=MODEL, messages=[user(question), assistant("it is")], max_tokens=8)
    r = client.chat.completions.create(model=MODEL, messages=[user(question), assistant("blue and")], max_tokens=8,
                                       extra_body={"continue_final_message": True})
    prompt = engine(FOLDER).formatter.encode(CONTEXT + "blue and")
    want = engine(FOLDER).open_session().turn(Prompt(prompt), SamplingParams(max_new_tokens=8)).result()
    assert want.text == " orange square"
    assert r.choices[0].message.content == want.text and r.usage.prompt_tokens == len(prompt)
    with pytest.raises(openai.BadRequestError, match="needs a final assistant message"):
        client.chat.completions.create(model=MODEL, messages=[user(question)], max_tokens=8,
                                       extra_body={"continue_final_message": True})
