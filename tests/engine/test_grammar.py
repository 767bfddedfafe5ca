"""A turn held to a grammar (llguidance) on the demo checkpoint: sampled answers follow the schema, the
mask stays in its own row of a batched step, and what cannot work is an InvalidInputError up front.

The demo vocabulary has letters and a few punctuation marks but no braces, quotes or digits: of JSON it
can only write `true`, `false` and `null`, so the schemas here are the ones it can express."""

from __future__ import annotations

import json

import pytest

from raincheck_core import InvalidInputError, Message, SamplingParams
from raincheck_core.grammar import json_schema_grammar
from tests.demo.helpers import FOLDER, engine, needs_checkpoint

pytestmark = needs_checkpoint
QUESTION = "what colour is the object in row one column one ?"


def test_sampled_answers_follow_the_schema():
    e = engine(FOLDER)
    grammar = json_schema_grammar({"type": "boolean"})
    answers = []
    for seed in range(10):
        params = SamplingParams(temperature=1.5, seed=seed, max_new_tokens=8, grammar=grammar)
        end = e.open_session().turn(Message(QUESTION), params).result()
        answers.append(json.loads(end.text))
        assert end.finish_reason == "stop"
    assert set(answers) <= {True, False}


def test_a_grammar_stays_in_its_row():
    e = engine(FOLDER)
    plain = SamplingParams(max_new_tokens=6)
    alone = e.open_session().turn(Message(QUESTION), plain).result().text
    a, b = e.open_session(), e.open_session()
    sa = a.turn(Message(QUESTION), plain)
    sb = b.turn(Message(QUESTION), SamplingParams(max_new_tokens=6, grammar=json_schema_grammar({"enum": [None]})))
    while not (sa.request.finished and sb.request.finished):
        e.step()
    assert (sa.text(), sb.text()) == (alone, "null")


@pytest.mark.parametrize(("grammar", "message"), [
    (json_schema_grammar({"type": "string", "minLength": "x"}), "invalid grammar"),
    (json_schema_grammar({"type": "object"}), "vocabulary cannot start"),     # no "{" in the vocabulary
])
def test_what_cannot_work_is_refused_up_front(grammar, message):
    session = engine(FOLDER).open_session()
    with pytest.raises(InvalidInputError, match=message):
        session.turn(Message(QUESTION), SamplingParams(grammar=grammar))
    assert session.turns == 0
