"""`Session.abort`: a turn whose reader has gone is undone, whether it is still running or has ended
without its end being read; a turn whose end was read stays."""

from __future__ import annotations

import pytest

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.errors import TurnAbortedError
from tests.deferral.helpers import image_prompt

ANSWER = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("when", ["running", "ended_unread"])
def test_abort_undoes_a_turn_nobody_read_to_the_end(tiny_checkpoints, when):
    engine = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1])
    cfg = DeferralConfig("post_answer", selector="uniform")
    session = engine.open_session(deferral=cfg)
    first = session.turn(Prompt([11, 12, 13]), ANSWER).tokens()
    before = (session.turns, session.cached_tokens)
    stream = session.turn(image_prompt(engine, seed=5), ANSWER)
    next(stream)
    if when == "ended_unread":
        while not stream.request.finished:
            engine.step()
        assert session.pending_deferred > 0          # its recovery is pending too: dropped with it
    session.abort()
    assert (session.turns, session.cached_tokens, session.pending_deferred) == (*before, 0)
    if when == "running":
        with pytest.raises(TurnAbortedError):
            list(stream)
    again = session.turn(Prompt([14, 15]), ANSWER).tokens()
    other = engine.open_session(deferral=cfg)
    assert [e.token_id for e in other.turn(Prompt([11, 12, 13]), ANSWER).tokens()] == [e.token_id for e in first]
    assert [e.token_id for e in again] == [e.token_id for e in other.turn(Prompt([14, 15]), ANSWER).tokens()]


def test_a_turn_read_to_its_end_stays(tiny_checkpoints):
    engine = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1])
    session = engine.open_session()
    session.turn(Prompt([11, 12, 13]), ANSWER).result()
    kept = (session.turns, session.cached_tokens)
    session.abort()
    assert (session.turns, session.cached_tokens) == kept == (1, 8)
