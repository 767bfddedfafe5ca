"""A turn held to a grammar (llguidance): the mask is the parser's own (no token the sampler can draw is one
the parser refuses), what the vocabulary cannot write is refused up front naming it, a dead end met while
answering fails that turn alone, and on the demo checkpoint sampled answers follow the schema in their own row
of a batched step.

Three vocabularies: the demo's (letters, digits, a few punctuation marks; no braces or quotes: of JSON it
can write `true`, `false`, `null` and numbers), the tiny random checkpoint's (every printable ASCII
character, nothing else) and a byte-level one that can write every byte but NFC-normalizes what it
tokenizes (as Qwen's tokenizer does), which once made llguidance force tokens that spell other text."""

from __future__ import annotations

import json
import random
import re

import pytest
from transformers import AutoTokenizer

from raincheck_core import Engine, GrammarError, InvalidInputError, Message, SamplingParams
from raincheck_core.grammar import Grammars, grammar_from, json_schema_grammar
from services.common.random_model import save_random_model
from tests.demo.helpers import FOLDER, engine, needs_checkpoint

QUESTION = "what colour is the object in row one column one ?"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
GRAMMARS = [json_schema_grammar(s) for s in (
    PERSON, {"type": "object"}, {"type": "boolean"}, {"enum": [1, 22, None]},
    {"type": "object", "required": ["tags", "score"], "properties": {
        "tags": {"type": "array", "items": {"type": "string"}}, "score": {"type": "number"}}},
    {"type": "object", "required": ["colour"], "properties": {"colour": {"enum": ["red box", "blue", "cafe\u0301"]}}},
)] + [grammar_from("regex", r"(yes|no) [0-9]{2}\."), grammar_from("choice", ["red box", "blue", "x{y"]),
      grammar_from("grammar", 'start: "a" b+ "."\nb: "be" | "bo"')]


def nfc_byte_tokenizer():
    """A byte-level BPE that can write every byte, with a few merges and an NFC normalizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [("c", "a"), ("ca", "f"), ("{", '"'), ("Ã", "©")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges=merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("grammar-tiny"), "tiny")


@pytest.fixture(scope="module", params=["demo", "tiny", "nfc-bytes"])
def grammars(request, tiny_folder) -> tuple[Grammars, int]:
    """(Grammars over the vocabulary, its stop token)."""
    if request.param == "nfc-bytes":
        tok = nfc_byte_tokenizer()
    else:
        tok = AutoTokenizer.from_pretrained(str(FOLDER if request.param == "demo" else tiny_folder))
    return Grammars(tok, len(tok)), tok.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("grammar", range(len(GRAMMARS)))
def test_the_mask_is_the_parsers_own(grammars, grammar):
    """Random walks through the mask: every allowed token is one the parser takes, and a walk ends at the
    stop token, never at a dead end, unless the grammar was refused up front (what it cannot write named)."""
    g, stop = grammars
    try:
        g.constraint(GRAMMARS[grammar], stop)
    except GrammarError as e:
        assert "vocabulary cannot write any answer this grammar accepts" in str(e)
        assert not g.vocabulary.byte_complete
        return
    ended = 0
    for seed in range(12):
        rng = random.Random(seed)
        c = g.constraint(GRAMMARS[grammar], stop, check=False)
        for _ in range(40):
            token = rng.choice(c.allowed().nonzero().flatten().tolist())
            c.consume(token)                  # GrammarError if the parser refused what the mask allowed
            if token == stop:
                ended += 1
                break
    assert ended > 0


def test_what_the_vocabulary_cannot_write_is_refused_naming_it():
    tok = AutoTokenizer.from_pretrained(str(FOLDER))
    g, stop = Grammars(tok, len(tok)), tok.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(GrammarError, match=re.escape("""at the start the grammar requires '{"name":"', and no token """
                                                     "writes '{'")):
        g.constraint(json_schema_grammar(PERSON), stop)
    with pytest.raises(GrammarError, match=re.escape("after 'a' the grammar requires '{b', and no token writes '{'")):
        g.constraint(grammar_from("choice", ["c{", "a{b"]), stop)     # every branch dies
    c = g.constraint(grammar_from("choice", ["blue", "x{y"]), stop)   # one can be written: not refused
    allowed = {tok.convert_ids_to_tokens(t) for t in c.allowed().nonzero().flatten().tolist()}
    assert "b" in allowed and "x" not in allowed                      # the dead branch is never drawn


def test_greedy_random_weights_are_held_to_the_schema(tiny_folder):
    e = Engine.from_pretrained(tiny_folder, num_threads=2)
    params = SamplingParams(max_new_tokens=200, grammar=json_schema_grammar(PERSON))
    end = e.open_session().turn(Message("who is it ?"), params).result()
    value = json.loads(end.text)
    assert end.finish_reason == "stop" and set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_a_dead_end_met_while_answering_fails_that_turn_only(tiny_folder):
    """A key the tiny vocabulary cannot write, after a free string the search does not see past: the turn
    that reaches it fails naming it; a turn in the same steps and the session's next turn go on."""
    e = Engine.from_pretrained(tiny_folder, num_threads=2)
    schema = {"type": "object", "additionalProperties": False, "required": ["a", "é"],
              "properties": {"a": {"type": "string"}, "é": {"type": "integer"}}}
    quote = e.formatter.tokenizer.convert_tokens_to_ids('"')
    bad_params = SamplingParams(max_new_tokens=40, grammar=json_schema_grammar(schema), logit_bias=((quote, 100.0),))
    a, b = e.open_session(), e.open_session()
    bad = a.turn(Message("who ?"), bad_params)
    good = b.turn(Message("who ?"), SamplingParams(max_new_tokens=8))
    with pytest.raises(GrammarError, match=re.escape("""cannot finish this answer: after '{"a":"","' the grammar """
                                                     """requires 'é":', and no token writes 'é'""")):
        bad.result()
    assert good.result().finish_reason == "length" and a.turns == 0
    assert a.turn(Message("who ?"), SamplingParams(max_new_tokens=4)).result().text


@needs_checkpoint
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


@needs_checkpoint
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


@needs_checkpoint
@pytest.mark.parametrize(("grammar", "error", "message"), [
    (json_schema_grammar({"type": "string", "minLength": "x"}), InvalidInputError, "invalid grammar"),
    (json_schema_grammar({"type": "object"}), GrammarError, "requires '{', and no token writes '{'"),
])
def test_what_cannot_work_is_refused_up_front(grammar, error, message):
    session = engine(FOLDER).open_session()
    with pytest.raises(error, match=message):
        session.turn(Message(QUESTION), SamplingParams(grammar=grammar))
    assert session.turns == 0
