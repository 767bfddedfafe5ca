"""Speculative decoding's verification (docs/mechanism.md §13): which rows of a verify segment a turn
keeps, and the tokens they emit.

Row i of a segment `token, d_1 .. d_k` holds the target's logits for the token after `d_i` (row 0: after
`token`). The turn draws from row 0 with d_1 as the draft; while the draw equals its draft the next row
is drawn, with the next draft (the last row, after every draft was accepted, with none). The first draw
that differs, or that ends the answer (a stop token, the length limit), is the last: the answer never
runs past a stop or the limit, and the sampler's rules and grammar see exactly the tokens plain decoding
would have fed them. Greedy draws are the row's argmax, so the emitted tokens are those of plain greedy
decoding; sampled draws accept a draft with its target probability and otherwise draw from the rest
(`Sampler.__call__`), so each emitted token has the target's distribution.

A draw that emits e tokens keeps rows 0 .. e-1 (their inputs: `token` and the accepted drafts); the
rows after them are rejected: their K/V slots are never filled, the GDN state kept is the one after row
e-1, and the last emitted token is fed by the next step as in plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SamplingError
from .plan import Segment
from .request import TurnRequest


@dataclass
class Verified:
    """What a verify segment's draws gave its turn."""

    kept: int                                   # rows kept (= tokens emitted, at least 1)
    accepted: int                               # drafts accepted
    error: SamplingError | None = None          # a draw failed: the turn fails


def verify(seg: Segment, req: TurnRequest, logits: torch.Tensor, maxima: list[tuple[float, int]], now: float,
           restoring: bool) -> Verified:
    """Draw `req`'s tokens from the segment's rows `logits [rows, vocab]` (`maxima`: each row's largest
    logit and its index), emitting each as it is drawn (`TurnRequest.accept`)."""
    req.drafts_proposed += len(seg.drafts)
    req.step_tokens = 0
    accepted = 0
    for i in range(seg.rows):
        draft = seg.drafts[i] if i < len(seg.drafts) else None
        try:
            token = req.sample(logits[i], maxima[i], draft)
        except Exception as e:   # this turn's sampling only
            return Verified(max(i, 1), accepted, e if isinstance(e, SamplingError) else
                            SamplingError(f"sampling failed: {e}"))
        accepted += token == draft
        req.drafts_accepted += token == draft     # before `accept`: the turn's metrics are taken when it ends
        req.drafts_tried += draft is not None     # drafts a draw was compared with: the acceptance rate's base
        req.step_tokens += 1
        req.accept(token, logits[i], now, restoring=restoring and i == 0)
        if token != draft or req.finished:
            break
    return Verified(req.step_tokens, accepted)
