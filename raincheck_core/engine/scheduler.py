"""Chooses each step's rows under one row budget, with no prefill or decode phase (vLLM-style).

Order of claims on a step: every turn in decode gets its one row, plus a deferred chunk of its own
input when its policy fuses one (after the guard, within the per-step deferred budget that bounds
TPOT); then turns still prefilling share what is left, oldest first; then sessions recovering after
their answer fill the gap with larger prefill-only chunks — the whole remaining budget in a step
with no decode rows, else only the deferred budget left over.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..deferral.recovery import Recovery
from .request import TurnRequest
from .sequence import Sequence


@dataclass(frozen=True)
class Work:
    request: TurnRequest | None = None   # a prefill chunk or decode row of a running turn
    rows: int = 0
    recovery: Recovery | None = None     # deferred rows riding in this step
    deferred: int = 0
    seq: Sequence | None = None


class Scheduler:
    def __init__(self, max_rows_per_step: int, deferred_budget: int, recovery_chunk: int):
        self.max_rows = max_rows_per_step
        self.deferred_budget = deferred_budget
        self.recovery_chunk = recovery_chunk
        self.running: list[TurnRequest] = []
        self.recovering: list[Sequence] = []    # answer done, deferred rows left

    def add(self, request: TurnRequest) -> None:
        self.running.append(request)

    def remove(self, request: TurnRequest) -> None:
        if request in self.running:
            self.running.remove(request)

    def add_recovering(self, seq: Sequence) -> None:
        if seq not in self.recovering:
            self.recovering.append(seq)

    def remove_recovering(self, seq: Sequence) -> None:
        if seq in self.recovering:
            self.recovering.remove(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.recovering)

    def schedule(self, only: Sequence | None = None) -> list[Work]:
        """This step's work; `only` restricts post-answer recovery to one session (a barrier wait)."""
        budget, deferred_budget = self.max_rows, self.deferred_budget
        work: list[Work] = []
        decoding = [r for r in self.running if r.decoding]
        for req in decoding:
            if budget <= 0:
                break
            rec, c = req.recovery, 0
            if rec is not None and rec.fuses_now(len(req.generated) - 1):
                c = max(0, min(rec.cfg.chunk_size, rec.pending, deferred_budget, budget - 1))
            work.append(Work(req, 1, rec if c else None, c, req.seq))
            budget -= 1 + c
            deferred_budget -= c
        for req in self.running:
            if not req.decoding and budget > 0:
                n = min(req.input_remaining, budget)
                work.append(Work(req, n, seq=req.seq))
                budget -= n
        # a barrier wait (`only`) is blocking a user's next turn: it may take the whole remaining budget
        gap = budget if not decoding or only is not None else min(budget, deferred_budget)
        for seq in self.recovering:
            if gap <= 0:
                break
            if (only is not None and seq is not only) or seq.recovery.handed_off:
                continue
            n = min(seq.recovery.pending, self.recovery_chunk, gap)
            work.append(Work(recovery=seq.recovery, deferred=n, seq=seq))
            gap -= n
        return work
