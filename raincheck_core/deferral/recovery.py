"""One turn's deferred input D: what is still to prefill, in source order, and the state it needs.

D is prefilled in chunks fused with the turn's decode steps (raincheck, after the guard), then after
the answer in larger prefill-only chunks, until none is left; the session's next turn waits for that
(the completion barrier).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from .gdn_join import GDNJoin
from .policy import DeferralConfig

if TYPE_CHECKING:
    from ..multimodal.turn_input import TurnInput


class Recovery:
    def __init__(self, rows: TurnInput, cfg: DeferralConfig, join: GDNJoin | None, turn: int = 0):
        self.rows = rows
        self.turn = turn               # the session's turn index: names this recovery (hand-off results)
        self.cfg = cfg
        self.join = join
        self.cursor = 0
        self.slots: list[torch.Tensor] = []   # KV slots each processed chunk wrote, in order (pages to ship)
        self.answer_done = False
        self.handed_off = False        # a deferred worker is prefilling the rest (Engine.hold_residual)
        self.t_answer_end: float | None = None
        self.t_done: float | None = None
        self.failures = 0              # steps that failed on this recovery's own rows

    @property
    def total(self) -> int:
        return len(self.rows)

    @property
    def pending(self) -> int:
        return self.total - self.cursor

    @property
    def done(self) -> bool:
        return self.cursor >= self.total

    def fuses_now(self, fed: int) -> bool:
        """A chunk may ride on a decode step: raincheck policy, past the guard, rows left."""
        return self.cfg.fuses and not self.answer_done and fed >= self.cfg.guard and not self.done

    def mark_answer_done(self) -> None:
        self.answer_done = True
        self.t_answer_end = time.perf_counter()

    def advance(self, n: int) -> None:
        self.cursor += n
        if self.done:
            self.t_done = time.perf_counter()

    @property
    def completion_s(self) -> float | None:
        """Time from the answer's end to the last deferred row (0 if D was done before the answer)."""
        if self.t_done is None:
            return None
        return max(0.0, self.t_done - (self.t_answer_end or self.t_done))

    def release(self) -> None:
        if self.join is not None:
            self.join.release()
