"""Chooses each step's rows under one row budget, with no prefill or decode phase (vLLM-style), and
describes them as a `StepPlan` (claiming their slots; nothing else changes until the step's update).

Order of claims on a step: every turn in decode gets its one row, plus a deferred chunk of its own
input when its policy fuses one (after the guard, within the per-step deferred budget that bounds
TPOT; the chunk goes right before the row, so the row sees it — docs/mechanism.md §6); then turns still
prefilling share what is left, oldest first; then sessions recovering after their answer fill the gap
with larger prefill-only chunks — the whole remaining budget in a step with no decode rows, else only
the deferred budget left over.
"""

from __future__ import annotations

from ..deferral.recovery import Recovery
from .plan import Kind, Segment, StepPlan
from .request import TurnRequest
from .session_cache import SessionCache


class Scheduler:
    def __init__(self, max_rows_per_step: int, deferred_budget: int, recovery_chunk: int):
        self.max_rows = max_rows_per_step
        self.deferred_budget = deferred_budget
        self.recovery_chunk = recovery_chunk
        self.running: list[TurnRequest] = []
        self.recovering: list[SessionCache] = []    # answer done, deferred rows left

    def add(self, request: TurnRequest) -> None:
        self.running.append(request)

    def remove(self, request: TurnRequest) -> None:
        if request in self.running:
            self.running.remove(request)

    def add_recovering(self, cache: SessionCache) -> None:
        if cache not in self.recovering:
            self.recovering.append(cache)

    def remove_recovering(self, cache: SessionCache) -> None:
        if cache in self.recovering:
            self.recovering.remove(cache)

    def has_work(self) -> bool:
        return bool(self.running or self.recovering)

    def schedule(self, only: SessionCache | None = None, solo: SessionCache | None = None) -> StepPlan:
        """This step's plan. `only` restricts post-answer recovery to one session (a barrier wait);
        `solo` restricts the whole step to one session (re-running a failed step session by session)."""
        running = [r for r in self.running if solo is None or r.cache is solo]
        recovering = [c for c in self.recovering if solo is None or c is solo]
        budget, deferred_budget = self.max_rows, self.deferred_budget
        plan = StepPlan()
        decoding = [r for r in running if r.decoding]
        for req in decoding:
            if budget <= 0:
                break
            rec, c = req.recovery, 0
            if rec is not None and rec.fuses_now(len(req.generated) - 1):
                c = max(0, min(rec.cfg.chunk_size, rec.pending, deferred_budget, budget - 1))
            if c:
                plan.segments.append(deferred_segment(req.cache, rec, c, Kind.DEFERRED))
            plan.segments.append(decode_segment(req))
            budget -= 1 + c
            deferred_budget -= c
        for req in running:
            if not req.decoding and budget > 0:
                n = min(req.input_remaining, budget)
                plan.segments.append(prefill_segment(req, n))
                budget -= n
        # a barrier wait (`only`) is blocking a user's next turn: it may take the whole remaining budget
        gap = budget if not decoding or only is not None else min(budget, deferred_budget)
        for cache in recovering:
            if gap <= 0:
                break
            if (only is not None and cache is not only) or cache.recovery.handed_off:
                continue
            n = min(cache.recovery.pending, self.recovery_chunk, gap)
            plan.segments.append(deferred_segment(cache, cache.recovery, n, Kind.RECOVERY))
            gap -= n
        return plan


def prefill_segment(req: TurnRequest, n: int) -> Segment:
    cache = req.cache
    write = cache.claim(n)
    return Segment(Kind.PREFILL, cache, n, write, cache.readable(n), cache.gdn_slot, source=req.input,
                   first=req.cursor, request=req, sample=req.cursor + n == len(req.input))


def decode_segment(req: TurnRequest) -> Segment:
    cache = req.cache
    rec = req.recovery if req.recovery is not None and not req.recovery.done else None
    write = cache.claim(1)
    return Segment(Kind.DECODE, cache, 1, write, cache.readable(1), cache.gdn_slot, token=req.last_token,
                   position=cache.next_position, request=req, recovery=rec, sample=True)


def deferred_segment(cache: SessionCache, rec: Recovery, n: int, kind: Kind) -> Segment:
    """`n` deferred rows from the recovery's cursor: they read every non-GEN slot, run on the prefix
    GDN state, and (GDN models) carry the turn's conv lead for the join."""
    write = cache.claim(n)
    join = rec.join
    return Segment(kind, cache, n, write, cache.readable(n, hide_generated=True),
                   join.prefix if join is not None else None, source=rec.rows, first=rec.cursor, recovery=rec,
                   lead=join.lead_rows if join is not None else 0, live_slot=join.live if join is not None else None)
