"""Complete, Tokenize and Detokenize through the frontend: a stateless completion answers as an
engine session given the same token ids does, echo scores the prompt with the engine's full-prefill
logits (<= 1e-5), nothing stays open on the worker, and bad prompts are INVALID_ARGUMENT."""

from __future__ import annotations

import grpc
import pytest
import torch

from raincheck_client._gen import chat_pb2, chat_pb2_grpc
from raincheck_core import Engine, Prompt, SamplingParams


@pytest.fixture
def stub(embedded):
    _, frontend, _ = embedded
    with grpc.insecure_channel(frontend.address) as channel:
        yield chat_pb2_grpc.ChatServiceStub(channel)


def test_completion_with_echo_and_logprobs(stub, embedded, checkpoint):
    worker = embedded[2]
    ids = stub.Tokenize(chat_pb2.TokenizeRequest(text="what is this ? a red square")).token_ids
    assert stub.Detokenize(chat_pb2.DetokenizeRequest(token_ids=ids)).text == "what is this ? a red square"
    events = list(stub.Complete(chat_pb2.CompleteRequest(
        token_ids=ids, echo=True, prompt_logprobs=2,
        sampling=chat_pb2.SamplingOptions(max_new_tokens=4, ignore_eos=True, logprobs=True))))
    prompt = events[0].prompt
    answer = [e.token for e in events if e.WhichOneof("event") == "token"]
    assert events[-1].final.token_ids == [t.token_id for t in answer] and len(answer) == 4
    assert worker.runtime.engine.sessions == {}        # the completion's session is gone

    engine = Engine.from_pretrained(checkpoint)
    logp = torch.log_softmax(engine.forward_logits(torch.tensor(list(ids))), -1)
    assert [t.token_id for t in prompt.tokens] == list(ids) and not prompt.tokens[0].HasField("logprob")
    for i, t in enumerate(prompt.tokens[1:], start=1):
        assert abs(t.logprob - float(logp[i - 1, ids[i]])) <= 1e-5
        assert [a.token_id for a in t.top_logprobs] == torch.topk(logp[i - 1], 2).indices.tolist()
    want = engine.open_session().turn(Prompt(list(ids)), SamplingParams(max_new_tokens=4, ignore_eos=True),
                                      return_logits=True).tokens()
    assert [t.token_id for t in answer] == [e.token_id for e in want]
    for got, e in zip(answer, want, strict=True):
        assert abs(got.logprob - float(torch.log_softmax(e.logits, -1)[e.token_id])) <= 1e-5


def test_scoring_alone_and_bad_prompts(stub):
    events = list(stub.Complete(chat_pb2.CompleteRequest(
        text="a red square", echo=True, prompt_logprobs=0, sampling=chat_pb2.SamplingOptions(max_new_tokens=0))))
    assert events[0].prompt.text == "a red square" and events[-1].final.token_ids == []
    for bad, message in [(dict(), "exactly one"), (dict(text="x", token_ids=[1]), "exactly one"),
                         (dict(token_ids=[10**7]), "token ids must be in"),
                         (dict(text="x", sampling=chat_pb2.SamplingOptions(n=2)), "n must be 1")]:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Complete(chat_pb2.CompleteRequest(**bad)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()
