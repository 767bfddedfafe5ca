"""Resolving a step's plan just before its forward: what the forward reads of the sessions, put into the
plan's segments, so that the runner reads the plan and the pools and never a session."""

from __future__ import annotations

import functools
from collections.abc import Mapping

from ..deferral.handoff import ResidualResult
from ..multimodal.turn_input import TurnInput
from ..ops.backend import GDNOps
from .plan import ANSWERING, JoinInputs, Kind, Segment, StepPlan, Tracking
from .step_sessions import StepSessions


def resolve(plan: StepPlan, sessions: StepSessions, handoffs: Mapping[str, ResidualResult],
            gdn_ops: GDNOps) -> StepPlan:
    """`plan` with what its forward reads of the sessions put into its segments, read now (just before
    the forward, as the step's earlier passes left the sessions): their rows (`handoffs`: a hand-off's
    result), a joining chunk's join inputs (its join's buffered factors folded first, by the step's
    `gdn_ops`: the one change this makes, explicitly), a tracked row's facts about the joins it extends."""
    return StepPlan([_resolved(seg, sessions, handoffs, gdn_ops) for seg in plan.segments])


def rows_of(segment: Segment, sessions: StepSessions) -> TurnInput:
    """The rows `segment` takes [first, first + rows) of: its turn's input, its recovery's D, or a
    scratch session's rows."""
    if segment.kind is Kind.PREFILL:
        return sessions.turn(segment.session).input
    if segment.kind is Kind.RESIDUAL:
        return sessions.scratch(segment.session).input
    return sessions.cache(segment.session).recovery.rows


# the few values a tracked row's facts take, made once each (a step of tracked decode rows asks per row)
_tracking = functools.cache(Tracking)


def _resolved(seg: Segment, sessions: StepSessions, handoffs: Mapping[str, ResidualResult],
              gdn_ops: GDNOps) -> Segment:
    if seg.kind in ANSWERING and not seg.tracked:
        return seg      # its tokens and position are in the plan: nothing of the session to read
    cache = sessions.cache(seg.session)
    join_inputs = tracking = None
    if seg.joins:
        join = cache.recovery.join
        # folded here, explicitly: the forward only reads the map
        p_rest = join.fold_buffered(gdn_ops)
        join_inputs = JoinInputs(join.lead_u[:, :seg.lead], join.lead_g[:, :seg.lead], join.lead_beta[:, :seg.lead],
                                 p_rest, join.s_lead, join.fed < join.lead)
    if seg.tracked:
        recs = [r for r in cache.recoveries() if r.join is not None and not r.done]
        pending = [r.join for r in recs]
        # the joins these rows extend: a follow-up's input only earlier turns' (its own begins after it); a
        # verify segment's may reach into a younger join's lead while the older one's is complete
        extended = pending if seg.kind is not Kind.PREFILL else \
            [r.join for r in recs if r.turn < cache.latest_turn]
        tracking = _tracking(max([0, *(j.lead - j.fed for j in extended)]), any(j.fed < j.lead for j in pending),
                             any(j.factors is not None for j in pending))
    source = result = None
    if seg.kind is Kind.HANDOFF:
        result = handoffs[seg.session]
    elif seg.kind not in ANSWERING:
        source = rows_of(seg, sessions)
    return seg.resolved(source, result, join_inputs, tracking)
