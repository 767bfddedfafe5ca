"""Streaming an answer's text (multimodal/detokenize.py): the deltas join to the whole answer's text as one
decode gives it, at every step, for a byte-level tokenizer (characters split across tokens), a
SentencePiece-style one (a word marker that is a space except at a text's start) and the demo model's,
while each token decodes only a short window, not the answer so far."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from raincheck_core.multimodal.chat import ChatFormatter
from raincheck_core.multimodal.detokenize import REPLACEMENT, IncrementalText

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-v2"


class Recording:
    """A decode function that records how many tokens each call decoded."""

    def __init__(self, decode):
        self.decode, self.lengths = decode, []

    def __call__(self, ids: list[int]) -> str:
        self.lengths.append(len(ids))
        return self.decode(ids)


def stream(decode, ids: list[int]) -> list[str]:
    """The deltas of `ids` fed a token at a time; asserts after each that they join to the text decoded at
    once, or to a prefix of it while that ends in an incomplete character."""
    text, deltas = IncrementalText(decode), []
    for n in range(1, len(ids) + 1):
        deltas.append(text.delta(ids[:n]))
        whole, got = decode(ids[:n]), "".join(deltas)
        assert got == whole or (whole.endswith(REPLACEMENT) and whole.startswith(got))
    return deltas


def byte_chars() -> dict[int, str]:
    """The byte-level alphabet's character of each byte (printable bytes stand for themselves, the others
    for the characters from U+0100 on, in order)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = (b for b in range(256) if b not in kept)
    return {b: chr(b) for b in kept} | {b: chr(256 + i) for i, b in enumerate(rest)}


def byte_level() -> Tokenizer:
    """One token per byte (no merges), as a byte-level BPE tokenizer splits text it has no merge for."""
    chars = byte_chars()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def test_characters_split_across_byte_tokens_are_emitted_whole():
    tok = byte_level()
    text = "héllo wörld, 世界 🙂!"
    ids = tok.encode(text).ids
    assert len(ids) > len(text)             # some characters are several tokens
    deltas = stream(tok.decode, ids)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in d for d in deltas)
    assert deltas[ids.index(tok.encode("世").ids[0])] == ""     # its first byte alone: nothing yet


def test_a_word_marker_is_a_space_except_at_the_start():
    words = ["hello", "world", "again", "."]
    tok = Tokenizer(models.WordLevel({f"▁{w}": i for i, w in enumerate(words)} | {"<unk>": len(words)},
                                     unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    ids = [0, 1, 2, 1, 3]
    assert tok.decode(ids[1:2]) == "world"       # alone, a text's first word has no space
    deltas = stream(tok.decode, ids)
    assert deltas == ["hello", " world", " again", " world", " ."]
    assert "".join(deltas) == tok.decode(ids)


@pytest.mark.skipif(not (DEMO / "tokenizer.json").is_file(), reason="no demo-v2 tokenizer")
def test_the_demo_tokenizer_streams_its_whole_text_decoding_short_windows():
    formatter = ChatFormatter.from_checkpoint(DEMO)
    rng = random.Random(0)
    vocab = len(formatter.tokenizer)
    for _ in range(20):     # any ids, special ones (which decode to nothing) and stray bytes among them
        stream(formatter.decode, [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))])
    text = formatter.encode("the red circle is left of the blue square, and two green triangles are above it")
    decode = Recording(formatter.decode)
    text_deltas = IncrementalText(decode)
    joined = "".join(text_deltas.delta(text[:n]) for n in range(1, len(text) + 1))
    assert joined == formatter.decode(text)
    assert max(decode.lengths) <= 4          # a window of the last tokens, not the answer so far
