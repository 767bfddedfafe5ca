"""The sampling fields through the official openai client: logprobs equal the engine's log softmax
(<= 1e-5), streamed or not; min_tokens and logit_bias change the answer as asked."""

from __future__ import annotations

import pytest
import torch

from raincheck_core import Message, SamplingParams
from tests.demo.helpers import FOLDER, engine

from .helpers import MODEL, user

QUESTION = "what colour is the object in row one column one ?"


def reference(max_tokens: int):
    """The question's answer on an in-process engine of the same checkpoint, with its logits."""
    session = engine(FOLDER).open_session()
    events = session.turn(Message(QUESTION), SamplingParams(max_new_tokens=max_tokens), return_logits=True).tokens()
    session.close()
    return events


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_match_the_engines_logits(stack, stream):
    kwargs = dict(model=MODEL, messages=[user(QUESTION)], max_tokens=8, logprobs=True, top_logprobs=5)
    client = stack.openai()
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    want = reference(8)
    assert len(content) == len(want)
    for got, event in zip(content, want, strict=True):
        logp = torch.log_softmax(event.logits, -1)
        assert abs(got.logprob - float(logp[event.token_id])) <= 1e-5
        top = torch.topk(logp, 5)
        assert [round(a.logprob, 5) for a in got.top_logprobs] == [round(v, 5) for v in top.values.tolist()]
        assert got.top_logprobs[0].logprob >= got.logprob - 1e-6 and got.bytes == list(got.token.encode())


def test_min_tokens_is_honoured(stack):
    client = stack.openai()
    short = client.chat.completions.create(model=MODEL, messages=[user(QUESTION)], max_tokens=48)
    assert short.usage.completion_tokens < 30 and short.choices[0].finish_reason == "stop"
    held = client.chat.completions.create(model=MODEL, messages=[user(QUESTION)], max_tokens=48,
                                          extra_body={"min_tokens": 30})
    assert held.usage.completion_tokens >= 30


def test_logit_bias_forces_a_token(stack):
    token = engine(FOLDER).formatter.encode(" blue")[-1]
    r = stack.openai().chat.completions.create(model=MODEL, messages=[user(QUESTION)], max_tokens=3,
                                               logit_bias={str(token): 100}, logprobs=True)
    assert [e.token for e in r.choices[0].logprobs.content] == [engine(FOLDER).formatter.decode([token])] * 3
