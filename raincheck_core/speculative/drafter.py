"""What the engine asks of a draft proposer for speculative decoding.

The engine verifies a turn's k draft tokens in its ordinary step (a segment of k + 1 rows: the last
accepted token and the drafts) and keeps the longest prefix the target agrees with, plus one token of its
own. A drafter only proposes; whatever it proposes, the answer is the target's (greedy: token-identical;
sampled: rejection sampling keeps the target's distribution). So a drafter may see less than the target
does (an MTP head never sees deferred rows): that lowers acceptance, never correctness.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Drafter(Protocol):
    """One per engine; keyed by the engine core's session ids."""

    # observe() is given the target's last-layer hidden states (as the checkpoint's MTP module reads them)
    needs_hidden: bool

    def observe(self, session: str, next_tokens: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None) -> None:
        """Rows of `session` the target ran and kept this step (input rows, the accepted rows of a verify
        segment; not deferred rows), in order: `positions` `[3, n]` as the decoder's rope takes them,
        `hidden` `[n, hidden_size]` the target's hidden states at those rows (None unless `needs_hidden`),
        `next_tokens` `[n]` the token that follows each row (the next input token, or the one the step
        sampled or accepted after it)."""

    def propose(self, session: str, history: Sequence[int], k: int) -> list[int]:
        """Up to `k` draft tokens to follow `history` (the session's token ids so far, accepted only);
        fewer or none where it has no guess."""

    def rollback(self, session: str, length: int) -> None:
        """Forget what was observed or proposed past the first `length` tokens of the session (rejected
        drafts, an undone turn)."""

    def release(self, session: str) -> None:
        """The session is gone."""
