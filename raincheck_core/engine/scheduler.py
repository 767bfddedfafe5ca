"""Chooses each step's rows under one row budget, with no prefill or decode phase (vLLM-style), and
describes them as a `StepPlan` (claiming their slots; nothing else changes until the step's update).

Order of claims on a step: every turn in decode gets its one row, plus a deferred chunk of its own
input when its policy fuses one (after the guard, within the per-step deferred budget; the chunk goes
right before the row, so the row sees it — docs/mechanism.md §6), and, with speculation, its drafts
(beside the chunk, or instead of it while a GDN join of its session is pending: whichever is worth more,
engine/draft_choice.py, §13); then turns still prefilling share what
is left, oldest first; then sessions recovering after their answer fill the gap with larger
prefill-only chunks — the whole remaining budget in a step with no decode rows, else only the deferred
budget left over.

The TPOT objective (docs/mechanism.md §7): deferred rows on a step with decode rows make that step
slower for every turn in it. With objectives, such a step carries only as many deferred rows as the
cost model (engine/cost_model.py) predicts the tightest turn's saved slack can pay for, in chunk buckets;
what does not fit waits for a later step or the gap after the answer. A turn without an objective
(`tpot_slo=None`) fuses its fixed `chunk_size` and bounds nothing.

A previous turn's rows still pending when a follow-up was admitted past its bounded barrier
(docs/mechanism.md §10): up to one recovery chunk of them go ahead of the follow-up's input in its first
step, where the row budget leaves room (`ahead_rows`), and the input sees them; the rest are late rows,
which ride on the follow-up's decode steps once its input is in (`fused_rows`) and wait while it
prefills; they are never a post-answer chunk beside their own session's decode row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cached_property

from ..deferral.policy import CHUNK_SIZES
from .cost_model import ChunkCost, StepCostModel
from .draft_choice import Prices, acceptance, drafts_win
from .plan import ANSWERING, Kind, StepPlan
from .prefill_cuts import aligned, attention_splits, checkpoint_rows
from .segment_claims import (
    CacheView,
    TurnView,
    decode_segment,
    deferred_segment,
    prefill_segment,
    scratch_segment,
    verify_segment,
)
from .speculation import Speculation, join_pending
from .step_sessions import ScratchWork


class Scheduler:
    def __init__(self, max_rows_per_step: int, deferred_budget: int, recovery_chunk: int,
                 cost: StepCostModel | None = None, align: tuple[int, int | None] | None = None,
                 cut_for_hits: bool = False, speculation: Speculation | None = None):
        self.max_rows = max_rows_per_step
        self.speculation = speculation           # None: every decoding turn runs one decode row a step
        # (page, every): where prefix hits resume (`attention_splits`; None: no prefix cache), and where a
        # hybrid model's prefills keep GDN checkpoints (`checkpoint_rows`; every None: no GDN layers)
        self.align = align
        # whether a prefill of n rows must also end its step where a hit resumes (`prefill_cuts.aligned`): its GDN
        # rows would not run token by token, so the rows after would not get the hit's arithmetic
        self.cut_for_hits = cut_for_hits
        self.deferred_budget = deferred_budget
        self.recovery_chunk = recovery_chunk
        self.cost = cost or StepCostModel()
        self.running: list[TurnView] = []
        self.recovering: list[CacheView] = []    # answer done, deferred rows left
        self.scratch: list[ScratchWork] = []     # scratch rows to prefill (beside the turns' input rows)
        self._rotation = 0                       # whose step is next among the isolated groups

    def add(self, request: TurnView) -> None:
        self.running.append(request)

    def remove(self, request: TurnView) -> None:
        if request in self.running:
            self.running.remove(request)

    def add_recovering(self, cache: CacheView) -> None:
        if cache not in self.recovering:
            self.recovering.append(cache)

    def remove_recovering(self, cache: CacheView) -> None:
        if cache in self.recovering:
            self.recovering.remove(cache)

    def add_scratch(self, work: ScratchWork) -> None:
        self.scratch.append(work)

    def remove_scratch(self, work: ScratchWork) -> None:
        if work in self.scratch:
            self.scratch.remove(work)

    def has_work(self) -> bool:
        return bool(self.running or self.recovering or self.scratch)

    def running_turn(self, cache: CacheView) -> TurnView | None:
        """The session's turn whose answer is still streaming, if any."""
        return next((r for r in self.running if r.cache is cache), None)

    def schedule(self, only: CacheView | None = None, solo: CacheView | None = None, fed_ahead: int = 0) -> StepPlan:
        """This step's plan. `only` restricts post-answer recovery to one session (a barrier wait);
        `solo` restricts the whole step to one session (re-running a failed step session by session).
        A deterministic session's rows never share a step: steps take turns between each such session and
        the shared group of all others (`_isolated`). `fed_ahead`: answer rows each running turn will have been
        fed beyond what it shows when the plan runs (1: the next step planned during this one, engine/ahead.py;
        they move its fused chunks' guard)."""
        if solo is None:
            solo = self._isolated(only)
        shared = solo is None
        running = [r for r in self.running if (not r.cache.deterministic if shared else r.cache is solo)]
        recovering = [c for c in self.recovering if (not c.deterministic if shared else c is solo)]
        scratch = [w for w in self.scratch if shared or w.cache is solo]
        budget, deferred_budget = self.max_rows, self.deferred_budget
        plan = StepPlan()
        decoding: list[TurnView] = []
        prefilling: list[TurnView] = []
        for r in running:       # `decoding` is a property: read once a turn
            (decoding if r.decoding else prefilling).append(r)
        decoding = decoding[:budget]
        fit = _Fit(self.cost, decoding)
        prices = Prices.of(self.cost, len(decoding), self.recovery_chunk) if self.speculation is not None else None
        for req in decoding:
            if budget <= 0:
                break
            if self.speculation is None and req.cache.recovery is None:     # most rows: the row alone
                plan.segments.append(decode_segment(req))
                budget -= 1
                continue
            drafts, c = self._answer_rows(req, fit, prices, budget - 1, deferred_budget, fed_ahead)
            if c:
                plan.segments.append(deferred_segment(req.cache, c, Kind.DEFERRED))
            plan.segments.append(verify_segment(req, drafts) if drafts else decode_segment(req))
            budget -= 1 + len(drafts) + c
            deferred_budget -= c
        for req in prefilling:
            if budget > 0:
                ahead = ahead_rows(req, min(self.recovery_chunk, budget - req.input_remaining))
                if ahead:
                    plan.segments.append(deferred_segment(req.cache, ahead, Kind.RECOVERY, ahead=True))
                    budget -= ahead
                n = min(req.input_remaining, budget)
                checkpoints: tuple[int, ...] = ()
                splits: tuple[int, ...] = ()
                if self.align is not None:
                    start = req.cache.length + ahead
                    marks = [start - req.cursor + b for b in req.boundaries]   # the input's, as session slots
                    last = start + req.input_remaining - 1           # a repeat's hit resumes before it
                    if self.cut_for_hits:
                        n = aligned(start, n, self.align[0], marks[-1:])
                    checkpoints = checkpoint_rows(start, n, self.align, [*marks, last])
                    splits = attention_splits(start, n, self.align[0], [*marks[-1:], last])
                plan.segments.append(prefill_segment(req, n, checkpoints, splits))
                budget -= n
        for work in scratch:       # like a prefill: rows of nobody's answer, no objective of their own
            if budget > 0 and work.pending:
                n = min(work.pending, budget)
                plan.segments.append(scratch_segment(work, n))
                budget -= n
        # a barrier wait (`only`) is blocking a user's next turn: it may take the whole remaining budget,
        # whatever the other turns' objectives
        gap = budget if not decoding or only is not None else min(budget, deferred_budget)
        for cache in recovering:
            if gap <= 0:
                break
            # nothing pending: complete in the step now running, not yet settled (only a step planned ahead sees one)
            if (only is not None and cache is not only) or cache.recovery.handed_off or self.running_turn(cache) \
                    or not cache.recovery.pending:
                continue
            n = min(cache.recovery.pending, self.recovery_chunk, gap)
            if decoding and only is None:
                n = fit.rows(n)
                if not n:
                    break
            plan.segments.append(deferred_segment(cache, n, Kind.RECOVERY))
            gap -= n
        return plan

    def _answer_rows(self, req: TurnView, fit: _Fit, prices: Prices | None, room: int, deferred_budget: int,
                     fed_ahead: int) -> tuple[tuple[int, ...], int]:
        """A decoding turn's drafts and fused deferred rows beside its one row (`room`: the rows the budget
        leaves besides it). Where it could carry both, the one of higher expected value takes its rows
        first (engine/draft_choice.py); on a session with a GDN join pending, only that one: a chunk that
        joins would seed the verify rows' state inside the fused kernel (docs/mechanism.md §13). `fed_ahead`: as
        `schedule`'s."""
        limit = min(deferred_budget, room)
        if self.speculation is None:        # past the step's deferred budget (most sessions restoring D): none
            return (), fused_rows(req, fit, limit, fed_ahead=fed_ahead) if limit > 0 else 0
        drafts = self.speculation.drafts(req, room)
        alone = fused_rows(req, fit, limit, take=False, fed_ahead=fed_ahead) if drafts else 0
        exclusive = bool(drafts) and join_pending(req.cache)
        if alone and not drafts_win(prices, len(drafts), acceptance(req.drafts_accepted, req.drafts_tried), alone,
                                    fit.carried, exclusive):
            c = fused_rows(req, fit, limit, fed_ahead=fed_ahead)
            drafts = () if exclusive else drafts[:room - c]
            fit.fixed(len(drafts))
            return drafts, c
        fit.fixed(len(drafts))      # verify rows cost rows: deferred rows are predicted on top of them
        return drafts, 0 if exclusive else fused_rows(req, fit, min(deferred_budget, room - len(drafts)),
                                                      fed_ahead=fed_ahead)

    def handoff(self, cache: CacheView) -> StepPlan:
        """The step that joins a deferred worker's result into the cache's recovery: its pending rows as one
        hand-off segment, in a step of their own (they are applied between steps, as they arrive; a decode
        row of the session in the same step would run from the live state before the join)."""
        return StepPlan([deferred_segment(cache, cache.recovery.pending, Kind.HANDOFF)])

    def _isolated(self, only: CacheView | None) -> CacheView | None:
        """The deterministic session whose step this is, or None for the shared group's step. A barrier
        wait (`only`) steps its own group; otherwise the groups with work take turns."""
        if only is not None:
            return only if only.deterministic else None
        alone = [r.cache for r in self.running if r.cache.deterministic]
        alone += [c for c in self.recovering if c.deterministic and c not in alone and not c.recovery.handed_off]
        if not alone:
            return None
        others = any(not r.cache.deterministic for r in self.running) or self.scratch or any(
            not c.deterministic and not c.recovery.handed_off for c in self.recovering)
        groups: list[CacheView | None] = [None, *alone] if others else alone
        self._rotation = (self._rotation + 1) % len(groups)
        return groups[self._rotation]

    def account(self, plan: StepPlan, seconds: float, turn: Callable[[str], TurnView | None]) -> None:
        """The step `plan` took `seconds`: teach the cost model (steps of decode rows only, without other
        turns' prefill, are clean samples) and charge each decoding turn (`turn`: a session's running
        turn) for its objective."""
        decode = [s for s in plan.segments if s.kind in ANSWERING]
        if not decode:
            return
        prefill = plan.count(Kind.PREFILL)
        tracked = any(s.tracked for s in decode)
        extra = _extra_rows(plan)
        if not prefill:
            self.cost.observe(len(decode), extra, seconds, tracked)
        plain = self.cost.plain_s(len(decode))
        charged = seconds if plain is None or prefill else self._expected(len(decode), extra, tracked, seconds)
        for seg in decode:
            req = turn(seg.session)
            if req is not None:     # a step that emitted several tokens stands for as many plain steps
                req.charge(charged, (seconds if plain is None else plain) * max(req.step_tokens, 1))

    def _expected(self, batch: int, extra: int, tracked: bool, seconds: float) -> float:
        """What a step of `batch` decode rows and `extra` deferred or draft rows only (none of other turns'
        prefill, which is charged as measured: the load it saw) is charged to its turns' objectives: what the
        cost model expects of it (its estimates, frozen at calibration), so that no step's timing (a page
        fault, a noisy neighbour) moves the next decisions and the same request on an idle server gets the
        same chunks."""
        expected = self.cost.expected_s(batch, extra, tracked)
        return seconds if expected is None else expected


def _extra_rows(plan: StepPlan) -> int:
    """The rows a decode step carries beyond one per decoding turn: deferred rows and draft tokens, which
    the cost model prices alike (engine/cost_model.py)."""
    return plan.rows_of(Kind.DEFERRED, Kind.RECOVERY) + sum(len(s.drafts) for s in plan.segments)


class _Fit:
    """How many deferred rows the rest of this step may still carry under its turns' objectives."""

    def __init__(self, cost: StepCostModel, decoding: list[TurnView]):
        self.carried = 0
        self.cost = cost
        self.decoding = decoding

    @cached_property
    def predict(self) -> ChunkCost | None:
        """Once per step, if any chunk is weighed (most steps weigh none): the estimates do not change within it."""
        return self.cost.predictor(len(self.decoding))

    @cached_property
    def allowance(self) -> float:
        """The extra seconds the tightest objective lets this step cost (asked only if a chunk is weighed)."""
        bound = [r for r in self.decoding if r.tpot_slo is not None]
        if not bound:
            return math.inf
        plain = self.cost.plain_s(len(self.decoding))
        # nothing is known before a plain step was measured: fuse nothing yet
        return 0.0 if plain is None else min(r.slack_s(plain) for r in bound)

    def rows(self, limit: int, take: bool = True) -> int:
        """The largest chunk bucket (or all `limit` rows, when fewer) whose predicted extra cost, with what
        the step already carries, fits the allowance; 0 if none does. `take`: later chunks count them."""
        if self.allowance == math.inf:
            n = limit
        else:
            n = 0
            for size in (min(b, limit) for b in CHUNK_SIZES):
                if size > n and self.predict is not None and self.predict(self.carried + size) <= self.allowance:
                    n = size
        return self.fixed(n, take)

    def fixed(self, n: int, take: bool = True) -> int:
        """`n` rows whatever the allowance (a turn without an objective); `take`: later chunks count them."""
        n = max(n, 0)
        if take:
            self.carried += n
        return n


def fused_rows(req: TurnView, fit: _Fit, limit: int, take: bool = True, fed_ahead: int = 0) -> int:
    """Deferred rows of `req`'s session that ride on its decode step (at most `limit`): its own turn's
    once past the guard (docs/mechanism.md §7), or a previous turn's late rows from its first decode step
    on (§10), by the decoding turn's objective. `take`: the step carries them (else only asked);
    `fed_ahead`: answer rows the turn will have been fed beyond its `answer_fed` when the step runs."""
    rec = req.cache.recovery
    if rec is None:
        return 0
    if rec.turn == req.turn:
        if not rec.fuses_now(req.answer_fed + fed_ahead):
            return 0
    elif rec.done or rec.handed_off:
        return 0
    limit = min(rec.pending, limit)
    return fit.rows(limit, take) if req.tpot_slo is not None else fit.fixed(min(rec.cfg.chunk_size, limit), take)


def ahead_rows(req: TurnView, limit: int) -> int:
    """Rows of a previous turn's pending recovery that go ahead of `req`'s input in its first step (at
    most `limit`): the bounded barrier's one chunk, restored before the input as at a barrier, in the same
    step instead of steps of their own (docs/mechanism.md §10)."""
    rec = req.cache.recovery
    if req.cursor or rec is None or rec.turn >= req.turn or rec.done or rec.handed_off:
        return 0
    return max(0, min(rec.pending, limit))
