"""OpenAI's sampling fields through the SDK -> frontend -> decode worker: logprobs equal the engine's,
the rules reach the engine, and a bad value is INVALID_ARGUMENT before anything runs."""

from __future__ import annotations

import pytest
import torch

from raincheck_client import InvalidArgument, Sampling, Token
from raincheck_core import Engine, Message, SamplingParams


def test_logprobs_and_rules_through_the_sdk(embedded, checkpoint):
    cluster, frontend, _ = embedded
    session = cluster.client(frontend).create_session()
    turn = session.send("what is this ?", max_new_tokens=5, ignore_eos=True,
                        sampling=Sampling(logprobs=True, top_logprobs=3))
    tokens = [e for e in turn if isinstance(e, Token)]
    session.close()
    reference = Engine.from_pretrained(checkpoint).open_session().turn(
        Message("what is this ?"), SamplingParams(max_new_tokens=5, ignore_eos=True), return_logits=True).tokens()
    assert [t.token_id for t in tokens] == [e.token_id for e in reference]
    for got, want in zip(tokens, reference, strict=True):
        logp = torch.log_softmax(want.logits, -1)
        assert abs(got.logprob - float(logp[want.token_id])) <= 1e-5
        assert [a[0] for a in got.top_logprobs] == torch.topk(logp, 3).indices.tolist()
        assert all(isinstance(a[1], str) for a in got.top_logprobs)

    biased = cluster.client(frontend).create_session()
    ids = [e.token_id for e in biased.send("what is this ?", max_new_tokens=3, ignore_eos=True,
                                           sampling=Sampling(logit_bias={42: 100.0})) if isinstance(e, Token)]
    assert ids == [42, 42, 42]
    with pytest.raises(InvalidArgument, match="min_p must be in"):
        biased.send("again", sampling=Sampling(min_p=2.0)).text()
    biased.close()


def test_n_answers_through_the_sdk(embedded, checkpoint):
    """Sampling(n=3): every answer's tokens carry its choice (answer i = a one-answer turn with seed + i),
    each answer has its final, answer 0's comes last and the session continues it."""
    cluster, frontend, _ = embedded
    session = cluster.client(frontend).create_session()
    turn = session.send("what is this ?", max_new_tokens=4, ignore_eos=True, temperature=1.0, seed=5,
                        sampling=Sampling(n=3, logprobs=True))
    events = list(turn)
    assert sorted(turn.finals) == [0, 1, 2] and events[-1] is turn.final and turn.final.choice == 0
    engine = Engine.from_pretrained(checkpoint)
    for i in range(3):
        tokens = [e for e in events if isinstance(e, Token) and e.choice == i]
        assert all(t.logprob is not None for t in tokens)
        want = engine.open_session().turn(Message("what is this ?"), SamplingParams(
            max_new_tokens=4, ignore_eos=True, temperature=1.0, seed=5 + i)).result().token_ids
        assert [t.token_id for t in tokens] == turn.finals[i].token_ids == want
    assert session.send("again", max_new_tokens=2, ignore_eos=True).text() is not None
    session.close()
