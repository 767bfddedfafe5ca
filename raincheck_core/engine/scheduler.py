"""Chooses each step's rows under one row budget, with no prefill or decode phase (vLLM-style), and
describes them as a `StepPlan` (claiming their slots; nothing else changes until the step's update).

Order of claims on a step: every turn in decode gets its one row, plus a deferred chunk of its own
input when its policy fuses one (after the guard, within the per-step deferred budget; the chunk goes
right before the row, so the row sees it — docs/mechanism.md §6); then turns still prefilling share what
is left, oldest first; then sessions recovering after their answer fill the gap with larger
prefill-only chunks — the whole remaining budget in a step with no decode rows, else only the deferred
budget left over.

The TPOT objective (docs/mechanism.md §7): deferred rows on a step with decode rows make that step
slower for every turn in it. With objectives, such a step carries only as many deferred rows as the
cost model (engine/cost_model.py) predicts the tightest turn's saved slack can pay for, in chunk buckets;
what does not fit waits for a later step or the gap after the answer. A turn without an objective
(`tpot_slo=None`) fuses its fixed `chunk_size` and bounds nothing.
"""

from __future__ import annotations

import math

from ..deferral.policy import CHUNK_SIZES
from ..deferral.recovery import Recovery
from .cost_model import StepCostModel
from .plan import Kind, Segment, StepPlan
from .request import TurnRequest
from .session_cache import SessionCache


class Scheduler:
    def __init__(self, max_rows_per_step: int, deferred_budget: int, recovery_chunk: int,
                 cost: StepCostModel | None = None):
        self.max_rows = max_rows_per_step
        self.deferred_budget = deferred_budget
        self.recovery_chunk = recovery_chunk
        self.cost = cost or StepCostModel()
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
        decoding = [r for r in running if r.decoding][:budget]
        fit = _Fit(self.cost, decoding)
        for req in decoding:
            if budget <= 0:
                break
            rec, c = req.recovery, 0
            if rec is not None and rec.fuses_now(len(req.generated) - 1):
                limit = min(rec.pending, deferred_budget, budget - 1)
                c = fit.rows(limit) if rec.cfg.tpot_slo is not None else fit.fixed(min(rec.cfg.chunk_size, limit))
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
        # a barrier wait (`only`) is blocking a user's next turn: it may take the whole remaining budget,
        # whatever the other turns' objectives
        gap = budget if not decoding or only is not None else min(budget, deferred_budget)
        for cache in recovering:
            if gap <= 0:
                break
            if (only is not None and cache is not only) or cache.recovery.handed_off:
                continue
            n = min(cache.recovery.pending, self.recovery_chunk, gap)
            if decoding and only is None:
                n = fit.rows(n)
                if not n:
                    break
            plan.segments.append(deferred_segment(cache, cache.recovery, n, Kind.RECOVERY))
            gap -= n
        return plan

    def account(self, plan: StepPlan, seconds: float) -> None:
        """The step `plan` took `seconds`: teach the cost model (steps of decode rows only, without other
        turns' prefill, are clean samples) and charge each decoding turn for its objective."""
        decode = [s for s in plan.segments if s.kind is Kind.DECODE]
        if not decode:
            return
        if not any(s.kind is Kind.PREFILL for s in plan.segments):
            deferred = sum(s.rows for s in plan.segments if s.kind in (Kind.DEFERRED, Kind.RECOVERY))
            tracked = any(s.recovery is not None and s.recovery.join is not None for s in decode)
            self.cost.observe(len(decode), deferred, seconds, tracked)
        plain = self.cost.plain_s(len(decode))
        for seg in decode:
            seg.request.charge(seconds, seconds if plain is None else plain)


class _Fit:
    """How many deferred rows the rest of this step may still carry under its turns' objectives."""

    def __init__(self, cost: StepCostModel, decoding: list[TurnRequest]):
        self.carried = 0
        self.predict = cost.predictor(len(decoding))    # once per step: the medians do not change within it
        bound = [r for r in decoding if r.tpot_slo is not None]
        plain = cost.plain_s(len(decoding))
        if not bound:
            self.allowance = math.inf
        else:   # nothing is known before a plain step was measured: fuse nothing yet
            self.allowance = 0.0 if plain is None else min(r.slack_s(plain) for r in bound)

    def rows(self, limit: int) -> int:
        """The largest chunk bucket (or all `limit` rows, when fewer) whose predicted extra cost, with what
        the step already carries, fits the allowance; 0 if none does."""
        if self.allowance == math.inf:
            n = limit
        else:
            n = 0
            for size in (min(b, limit) for b in CHUNK_SIZES):
                if size > n and self.predict is not None and self.predict(self.carried + size) <= self.allowance:
                    n = size
        return self.fixed(n)

    def fixed(self, n: int) -> int:
        """`n` rows whatever the allowance (a turn without an objective); later chunks count them."""
        n = max(n, 0)
        self.carried += n
        return n


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
