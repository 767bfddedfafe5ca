"""The sampling fields through a real engine: logprobs equal the engine's logits' log softmax, min_tokens
holds back the stop tokens, and one session's rules never reach another's row of the same step."""

from __future__ import annotations

import pytest
import torch

from raincheck_core import Engine, InvalidInputError, Prompt, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    return Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1], num_pages=96)    # a hybrid (GDN) model


def test_logprobs_match_the_engines_logits(engine):
    session = engine.open_session()
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=5)
    events = session.turn(Prompt([5, 9, 12, 30]), params, return_logits=True).tokens()
    session.close()
    for e in events:
        want = torch.log_softmax(e.logits.float(), -1)
        assert abs(e.logprob - float(want[e.token_id])) <= 1e-5
        values, ids = torch.topk(want, 5)
        assert [t for t, _ in e.top_logprobs] == ids.tolist()
        assert max(abs(v - float(w)) for (_, v), w in zip(e.top_logprobs, values, strict=True)) <= 1e-5


def test_min_tokens_holds_back_a_stop_token(engine):
    session = engine.open_session()
    first = session.turn(Prompt([5, 9, 12]), SamplingParams(max_new_tokens=1)).tokens()[0].token_id
    session.close()
    stop = SamplingParams(max_new_tokens=8, stop_token_ids=(first,))
    assert len(engine.open_session().turn(Prompt([5, 9, 12]), stop).tokens()) == 1
    held = SamplingParams(max_new_tokens=8, stop_token_ids=(first,), min_tokens=5)
    tokens = [e.token_id for e in engine.open_session().turn(Prompt([5, 9, 12]), held).tokens()]
    assert len(tokens) >= 5 and first not in tokens[:5]


def test_a_sessions_bias_stays_in_its_row(engine):
    plain = SamplingParams(max_new_tokens=4, ignore_eos=True)
    biased = SamplingParams(max_new_tokens=4, ignore_eos=True, logit_bias=((17, 100.0),))
    alone = [e.token_id for e in engine.open_session().turn(Prompt([5, 9, 12]), plain).tokens()]
    a, b = engine.open_session(), engine.open_session()
    sa, sb = a.turn(Prompt([5, 9, 12]), plain), b.turn(Prompt([5, 9, 12]), biased)
    while not (sa.request.finished and sb.request.finished):
        engine.step()        # both turns in the same steps
    assert [e.token_id for e in sa.tokens()] == alone
    assert [e.token_id for e in sb.tokens()] == [17] * 4


def test_token_ids_outside_the_vocabulary_are_refused(engine):
    with pytest.raises(InvalidInputError, match="logit_bias names token ids outside the vocabulary"):
        engine.open_session().turn(Prompt([5]), SamplingParams(logit_bias=((10**7, 1.0),)))
