"""Applies one step's results: the only place where a step changes sessions.

In order: fill the claimed slots, write the new GDN states, do the deferred join's bookkeeping (the
new `S_lead`, the lead of a turn's first generated tokens, `P_rest` extended by each later one), move
cursors, then sample each turn's next token — one turn's sampling failure fails that turn alone — and
end turns and recoveries that are done.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import SamplingError
from .plan import Kind, StepPlan
from .runner import StepOutputs

if TYPE_CHECKING:
    from .engine import Engine
    from .session_cache import SessionCache

log = logging.getLogger(__name__)


def apply_step(engine: Engine, plan: StepPlan, out: StepOutputs,
               restoring: set[SessionCache] | None = None) -> None:
    """Apply `out`, the outputs of `plan` (one pass of a step). `restoring`: the sessions whose deferred
    rows the whole step carried (default: those in this pass; a serial step runs its chunks in a pass of
    their own), whose next token's gap counts as a restoring one."""
    now = engine.clock()
    # 1. the claimed slots now hold K/V; a tracked turn's generated tokens are GEN
    for seg in plan.segments:
        seg.cache.fill(seg.rows, generated=seg.kind is Kind.DECODE and seg.recovery is not None)
    # 2. new GDN states, in order (a decode row's state supersedes the join that preceded it)
    if engine.gdn is not None:
        pool = engine.gdn
        for w in out.writes:     # every layer's state of a slot in one copy
            if w.conv is not None:
                pool.conv.index_copy_(0, w.slots, w.conv.to(pool.conv.dtype))
            if w.ssm is not None:
                pool.ssm.index_copy_(0, w.slots, w.ssm.to(pool.ssm.dtype))
        _join_bookkeeping(out)
    # 3. cursors
    if restoring is None:
        restoring = chunk_carriers(plan)
    for seg in plan.segments:
        if seg.kind in (Kind.DEFERRED, Kind.RECOVERY, Kind.RESIDUAL):
            if seg.recovery is not None:
                seg.recovery.advance(seg.rows, now)
                seg.recovery.slots.append(seg.write_slots)
        elif seg.request is not None:
            req = seg.request
            was_prefilling = not req.decoding
            req.fed(seg.rows, now)
            if was_prefilling and req.decoding and req.recovery is not None and req.recovery.join is not None:
                req.recovery.join.begin()      # I0 is in: the live state is the insertion boundary
    # 4. sample; end turns
    for seg, logits in zip([s for s in plan.segments if s.sample], out.logits, strict=True):
        req = seg.request
        if req.finished:
            continue
        try:
            token = req.sampler(logits)
        except Exception as e:   # this turn's sampling only: the others in the step go on
            engine._fail_turn(req, e if isinstance(e, SamplingError) else SamplingError(f"sampling failed: {e}"))
            continue
        req.accept(token, logits, now, restoring=seg.cache in restoring)
        if req.finished:
            engine._turn_ended(req)
    # 5. recoveries that are complete
    for seg in plan.segments:
        rec = seg.cache.recovery
        if rec is not None and rec.done and (seg.recovery is rec):
            engine._recovery_done(seg.cache)


def chunk_carriers(plan: StepPlan) -> set[SessionCache]:
    return {s.cache for s in plan.segments if s.kind in (Kind.DEFERRED, Kind.RECOVERY, Kind.RESIDUAL)}


def _join_bookkeeping(out: StepOutputs) -> None:
    for seg, s_lead in out.joined:
        seg.recovery.join.set_joined(s_lead)
    for t in out.tracked:
        join = t.segment.recovery.join
        if t.state is not None:     # a lead token (the runner kept the state after it)
            join.record_lead(t.u, t.g, t.beta, t.state)
        else:
            join.fold(t.k, t.v, t.g, t.beta)
