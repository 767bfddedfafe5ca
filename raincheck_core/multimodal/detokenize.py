"""An answer's text a token at a time, decoding a short window per token instead of the whole answer.

Re-decoding every generated token on each step makes a turn's streaming cost quadratic in its length: with
the demo tokenizer, decoding 1,000 tokens takes ~0.2 ms, so 64 sessions 1,000 tokens into their answers
spend ~13 ms of host time per decode step on text alone, more than a GPU's whole decode step. Here each
token decodes only the tokens since the last emitted text (`read`) and the few before them (`prefix`), the
offsets TGI and vLLM use: a tokenizer that renders a token differently at the start of a text (a
SentencePiece word marker dropping its space) renders it the same way in both windows, so their difference
is the new text. A window whose text ends in U+FFFD holds an incomplete UTF-8 sequence: nothing is emitted
until a later token completes it. The deltas join to the text of the whole answer, decoded at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalText:
    """The text `decode` gives a growing token list, as deltas (`delta`, called after each new token)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.prefix = 0      # first token of the window whose text was emitted last
        self.read = 0        # tokens whose text has been emitted

    def delta(self, ids: Sequence[int], end: int | None = None) -> str:
        """The text the tokens after the last emitted ones add ("" while it ends in an incomplete
        character). `ids`: every token so far, the ones seen by earlier calls first; `end`: only its first
        `end` (a list that has grown meanwhile)."""
        end = len(ids) if end is None else end
        before = self.decode(list(ids[self.prefix:self.read])) if self.read > self.prefix else ""
        after = self.decode(list(ids[self.prefix:end]))
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, end
        return after[len(before):]
