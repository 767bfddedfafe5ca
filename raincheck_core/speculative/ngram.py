"""Prompt-lookup drafts (n-gram): the tokens that followed the latest earlier occurrence of the history's
last n tokens, for the longest n that occurs. Free to run, no model; it does well where answers repeat
their context (quoting, code edits, structured output) and proposes nothing elsewhere.

The history is the session's whole token stream (every turn's input and answer, accepted tokens only),
so nothing needs to be observed or rolled back: the drafter keeps no state of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .config import SpeculativeConfig


class NgramDrafter:
    needs_hidden = False

    def __init__(self, config: SpeculativeConfig):
        self.min_n = config.ngram_min
        self.max_n = config.ngram_max
        self.window = config.ngram_window

    def observe(self, session: str, next_tokens: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None) -> None:
        pass

    def propose(self, session: str, history: Sequence[int], k: int) -> list[int]:
        return lookup(np.asarray(history[-self.window:], dtype=np.int64), k, self.min_n, self.max_n)

    def rollback(self, session: str, length: int) -> None:
        pass

    def release(self, session: str) -> None:
        pass


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """`k` tokens that followed the latest earlier occurrence of the last n of `tokens`, for the largest n
    in [min_n, max_n] that occurs earlier (and has a follower); [] if none does. Where the followers run
    into the end of `tokens` the match says the text repeats with period `len(tokens) - follower`, and
    the drafts go on repeating it (a loop, a list of the same item)."""
    size = tokens.shape[0]
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = tokens[size - n:]
        # windows ending before the tail's last token, so that each match has at least one follower
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:size - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            drafts = tokens[start:start + k].tolist()
            period = size - start
            while len(drafts) < k:
                drafts.append(drafts[len(drafts) - period])
            return drafts
    return []
