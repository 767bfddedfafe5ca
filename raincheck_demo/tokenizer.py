"""The demo model's tokenizer: Qwen3.5's own tokenizer class with a tiny vocabulary of whole words.

transformers loads every `qwen3_5` checkpoint's tokenizer as `Qwen3_5Tokenizer` (byte-level BPE with
Qwen's pre-tokenizer regex), whatever class `tokenizer_config.json` names; a WordLevel `tokenizer.json`
would lose its words on that path. So the vocabulary is byte-level: every world word appears as `Ġword`
(after a space) and, where it can open a text, as `word`, built up by BPE merges one character at a
time, so each word is one token. Training builds the same class, so training and serving tokenize alike.
Qwen's special tokens come last; the config's image/video/vision ids are fixed by `SPECIALS`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from raincheck_core.multimodal.chat import chatml_template

from .world import answer_starts, vocabulary

if TYPE_CHECKING:
    from transformers import Qwen3_5Tokenizer

SPACE, NEWLINE = "Ġ", "Ċ"      # byte-level forms of " " and "\n"
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>")
OPENERS = ("system", "user", "assistant", "what", "how", "list", "in", *answer_starts())   # words that start a text
# A video's temporal patches are announced as "<0.2 seconds>" (transformers' Qwen3-VL processor, mirrored by
# the engine): the pre-tokenizer splits that into "<", digits, ".", " seconds" and ">".
TIMESTAMP_PIECES = ("<", ">", ".", *"0123456789", SPACE + "seconds")


def _vocab_and_merges(pieces: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Single characters, then each piece's prefixes; a piece's merges extend it one character at a time."""
    tokens = {c: i for i, c in enumerate(sorted({c for piece in pieces for c in piece} | {NEWLINE}))}
    merges: list[tuple[str, str]] = []
    for piece in pieces:
        for end in range(2, len(piece) + 1):
            if piece[:end] not in tokens:
                tokens[piece[:end]] = len(tokens)
                merges.append((piece[:end - 1], piece[end - 1]))
    return tokens, merges


def _ordered_pieces() -> list[str]:
    """Every whole-word token (`Ġword`, and `word` for openers), longest first; a piece that a lower-ranked
    merge of another word would split (e.g. `re` of "red" inside "three") moves to the front until none is."""
    from transformers import Qwen3_5Tokenizer

    pieces = sorted(dict.fromkeys([SPACE + w for w in [*vocabulary(), *OPENERS]] + [*OPENERS, *TIMESTAMP_PIECES]),
                    key=len, reverse=True)
    for _ in range(len(pieces)):
        vocab, merges = _vocab_and_merges(pieces)
        tok = Qwen3_5Tokenizer(vocab=vocab, merges=merges, unk_token=None)
        split = [p for p in pieces if len(tok.tokenize(p.replace(SPACE, " "))) != 1]
        if not split:
            return pieces
        pieces = split + [p for p in pieces if p not in split]
    raise RuntimeError(f"cannot make every word one token: {split}")


VOCAB, MERGES = _vocab_and_merges(_ordered_pieces())
VOCAB = {**VOCAB, **{s: len(VOCAB) + i for i, s in enumerate(SPECIALS)}}
VOCAB_SIZE = len(VOCAB)
PAD, IM_START, IM_END = VOCAB["<|endoftext|>"], VOCAB["<|im_start|>"], VOCAB["<|im_end|>"]
VISION_START, VISION_END = VOCAB["<|vision_start|>"], VOCAB["<|vision_end|>"]
IMAGE_PAD, VIDEO_PAD = VOCAB["<|image_pad|>"], VOCAB["<|video_pad|>"]

# Qwen ChatML without a default system prompt.
CHAT_TEMPLATE = chatml_template()


def build_tokenizer() -> Qwen3_5Tokenizer:
    """transformers' Qwen3_5Tokenizer over the demo vocabulary, with the chat template."""
    from tokenizers import AddedToken
    from transformers import Qwen3_5Tokenizer

    tok = Qwen3_5Tokenizer(vocab=dict(VOCAB), merges=list(MERGES), unk_token=None, eos_token="<|im_end|>",
                           pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(s, special=True, normalized=False)
                                                          for s in SPECIALS]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tokenizer(folder: Path) -> None:
    build_tokenizer().save_pretrained(folder)
