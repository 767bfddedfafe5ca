"""Applies one step's results to the sessions it ran, and says what happened.

In order: fill the claimed slots (and the tokens they hold), write the new GDN states, do the deferred
join's bookkeeping (the new `S_lead`, the lead of a turn's first generated tokens, `P_rest` extended by
each later one), move cursors, then sample each turn's next token. What ends here is only reported: the
turns whose answer is over, the turns whose sampling failed (one turn's failure is its own), the
recoveries that are complete, the `n > 1` turns whose prompt is in (their other answers fork now). The
engine core settles them (engine/core.py): it alone ends, fails and undoes turns, forks answers and
finishes recoveries. Only sampling reads values the forward computed (a speculative step's verification
first), so on a GPU everything before it runs while the forward is still computing.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..cache.prefix import ROW_KEY_WIDTH
from ..errors import SamplingError
from ..sampling import row_maxima
from .packing import KEPT
from .plan import ANSWERING, CHUNKS, RESTORING, Kind, Segment, StepPlan
from .step_outputs import StepOutputs
from .step_sessions import StepSessions
from .verify import Verified, verify

if TYPE_CHECKING:
    from ..cache.gdn_state import GDNStatePool
    from ..deferral.recovery import Recovery
    from ..ops.backend import GDNOps
    from .request import TurnRequest
    from .session_cache import SessionCache

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What a step's update found ended, for the engine core to settle."""

    ended: list[TurnRequest] = field(default_factory=list)                 # answer over (stop, length)
    failed: list[tuple[TurnRequest, Exception]] = field(default_factory=list)   # sampling failed
    recovered: list[tuple[SessionCache, Recovery]] = field(default_factory=list)   # D is all in
    grown: list[SessionCache] = field(default_factory=list)    # completed full pages of their prefix chain
    forked: list[tuple[TurnRequest, torch.Tensor]] = field(default_factory=list)   # n > 1: prompt in, logits

    def extend(self, other: StepResult) -> None:
        self.ended += other.ended
        self.failed += other.failed
        self.recovered += other.recovered
        self.grown += other.grown
        self.forked += other.forked


def apply_step(plan: StepPlan, out: StepOutputs, sessions: StepSessions, gdn: GDNStatePool | None,
               gdn_ops: GDNOps, now: float, restoring: set[str] | None = None,
               reading: Callable[[], None] | None = None, void: Set[str] = frozenset()) -> StepResult:
    """Apply `out`, the outputs of `plan` (one pass of a step, run with the GDN ops `gdn_ops`, which also
    fold the joins' maps here) at time `now`. `restoring`: the sessions whose deferred rows the whole step
    carried (default: those in this pass; a serial step runs its chunks in a pass of their own), whose next
    token's gap counts as a restoring one. `reading`: called once, just before the first read of a value the
    forward computed (instrumentation: `Hooks.on_read`). `void`: sessions whose decode row the forward ran for a
    turn that ended meanwhile (a step staged ahead, engine/ahead.py): nothing of it is kept, as if it had
    failed (its slot claimed and not filled, its GDN state written to the row that stays the other one)."""
    result = StepResult()
    # by session and first row: the forward ran the plan's segments as resolved (copies, engine/core.py)
    checkpoints = {(seg.session, seg.first): (conv, ssm) for seg, conv, ssm in out.checkpoints}
    if restoring is None:
        restoring = chunk_carriers(plan)
    # each sampling segment's rows of the step's logits
    starts = itertools.accumulate((s.logit_rows for s in plan.segments), initial=0)
    logit_at = dict(zip(plan.segments, starts, strict=False))     # `starts` has one more: the total
    # each segment's cache and running turn (None: a scratch session's, a recovery's after its answer), looked
    # up once: the phases below each visit every segment
    owners = [(seg, sessions.cache(seg.session), sessions.turn(seg.session)) for seg in plan.segments
              if seg.session not in void]
    for seg in plan.segments:
        if seg.session in void:
            sessions.cache(seg.session).cancel_claims()
    # the logits' values are read where tokens are drawn: a verify segment's before anything is filled, the
    # others' after the bookkeeping of phases 1-3, which needs no result of the forward, so on a GPU it runs
    # while the forward computes (the first read of a value waits for it)
    maxima = None
    if any(seg.kind is Kind.VERIFY for seg in plan.segments):
        if reading is not None:
            reading()
        maxima = row_maxima(out.logits)
    # 0. verify segments first: how many of their rows are kept decides what is filled and committed
    verified: dict[str, Verified] = {}
    for seg, _, req in owners:
        if seg.kind is Kind.VERIFY:
            at = logit_at[seg]
            if req.finished:      # cancelled meanwhile: its last token is fed, as a decode row's would be
                verified[seg.session] = Verified(1, 0)
                continue
            v = verified[seg.session] = verify(seg, req, out.logits[at:at + seg.rows], maxima[at:at + seg.rows], now,
                                               seg.session in restoring)
            if v.error is not None:
                result.failed.append((req, v.error))
            elif req.finished:
                result.ended.append(req)
    # 1. the claimed slots now hold K/V (labelled when claimed)
    text_keys = text_row_keys([seg for seg, _, _ in owners if seg.kind in ANSWERING])
    key_at = 0      # the next answer segment's first row of `text_keys` (they are in plan order)
    for seg, cache, req in owners:
        if seg.kind is Kind.VERIFY:
            # the kept rows only; the rejected rows' slots were claimed, never filled: the next step claims them
            # again and overwrites them, nobody reads them meanwhile
            kept = verified[seg.session].kept
            keys = text_keys[key_at:key_at + kept] if cache.recovery is None else None
            key_at += seg.rows
            grown = cache.fill(kept, tokens=list(seg.tokens[:kept]), next_position=seg.position + kept, keys=keys)
            cache.cancel_claims()
        elif seg.kind is Kind.PREFILL:
            rows = req.input
            end, start = seg.first + seg.rows, cache.length
            keys = rows.row_keys[seg.first:end] if rows.row_keys is not None else None
            grown = cache.fill(seg.rows, tokens=rows.token_ids[seg.first:end], keys=keys,
                               next_position=rows.next_position if end == len(rows) else None)
            if (seg.session, seg.first) in checkpoints:     # the states after its checkpoint rows
                cache.keep_checkpoints([start + r + 1 for r in seg.checkpoints], *checkpoints[seg.session, seg.first])
        elif seg.kind is Kind.DECODE:
            # a token generated while deferred rows are pending ends the prefix chain: the rows restored
            # after it do not see it, so no request processes these slots in this order
            key = text_keys[key_at:key_at + 1] if cache.recovery is None else None
            key_at += 1
            grown = cache.fill(1, tokens=[seg.token], next_position=seg.position + 1, keys=key)
        else:
            grown = cache.fill(seg.rows)
        if grown:
            result.grown.append(cache)
    # 2. new GDN states: those the forward wrote into their slots' other rows become current (nothing is
    # copied), then what no kernel wrote is copied in (no slot is both: see `ModelRunner.collect`)
    if gdn is not None:
        # a verify segment that kept fewer than all its rows: the state after its last kept row, which the
        # forward kept (`Segment.verify`), instead of the state after all of them
        cut = {}
        for seg, conv, ssm in out.checkpoints:
            if seg.kind is Kind.VERIFY and (kept := verified[seg.session].kept) < seg.rows:
                cut[seg.gdn_slot] = (conv[kept - 1], ssm[kept - 1])
        voided = {seg.gdn_slot for seg in plan.segments if seg.session in void}
        gdn.commit([slot for slot in out.committed if slot not in cut and slot not in voided])
        for slot, (conv, ssm) in cut.items():
            gdn.conv[slot].copy_(conv)
            gdn.ssm[slot].copy_(ssm)
        for w in out.writes:
            for slot, conv, ssm in zip(w.slots, _rows(w.conv, len(w.slots)), _rows(w.ssm, len(w.slots)),
                                       strict=True):
                if slot in voided:
                    continue
                if conv is not None:
                    gdn.conv[slot].copy_(conv)
                if ssm is not None:
                    gdn.ssm[slot].copy_(ssm)
        _join_bookkeeping(out, sessions, gdn_ops, verified)
    # 3. cursors
    for seg, cache, req in owners:
        if seg.kind is Kind.RESIDUAL:
            work = sessions.scratch(seg.session)
            if work is not None:
                work.cursor += seg.rows
            continue
        if seg.kind in CHUNKS:
            cache.recovery.advance(seg.rows, now)
            cache.recovery.slots.append(seg.write_slots)
            continue
        if seg.kind in ANSWERING:       # a decoding turn's rows: nothing begins
            req.fed(seg.rows, now)
            continue
        was_prefilling = not req.decoding
        req.fed(seg.rows, now)
        if not was_prefilling or not req.decoding:
            continue
        own = cache.own_recovery(req.turn)
        if own is not None and own.join is not None:
            # I0 is in: the live state is the insertion boundary (moved later by a previous turn's join)
            own.join.begin(cache.recovery.join if cache.recovery is not own else None, gdn_ops)
    # 4. sample (verify segments drew theirs first)
    if maxima is None:
        if reading is not None:
            reading()
        maxima = row_maxima(out.logits) if len(out.logits) else []
    views: list[torch.Tensor] = []

    def row(at: int) -> torch.Tensor:
        # the logits' rows as views, made at once when a draw first needs one (indexing is a tensor op per
        # row): a plain greedy draw, most decode rows', needs only its row's maximum
        if not views:
            views.extend(out.logits.unbind(0))
        return views[at]
    for seg, _, req in owners:
        if not seg.sample or seg.kind is Kind.VERIFY:
            continue
        at = logit_at[seg]
        if req.finished:
            continue
        try:
            token = req.drawn(maxima[at])
            if token is None:
                token = req.sample(row(at), maxima[at])
        except Exception as e:   # this turn's sampling only: the others in the step go on
            result.failed.append((req, e if isinstance(e, SamplingError) else SamplingError(f"sampling failed: {e}")))
            continue
        req.step_tokens = 1
        req.accept(token, row(at) if req.return_logits else None, now, restoring=seg.session in restoring)
        if req.branches and len(req.generated) == 1:    # the other answers start from the same logits
            result.forked.append((req, row(at)))
        if req.finished:
            result.ended.append(req)
    if sessions.drafter is not None:
        try:
            _observe(plan, out, sessions, verified, {req for req, _ in result.failed})
        except Exception:   # the step is applied: a drafter's failure only costs its next drafts
            log.exception("the drafter failed to observe a step")
    # 5. recoveries that are complete
    for sid in dict.fromkeys(s.session for s in plan.segments if s.kind in RESTORING):
        cache = sessions.cache(sid)
        if cache.recovery is not None and cache.recovery.done:
            result.recovered.append((cache, cache.recovery))
    # 6. a turn whose answer is over feeds its joins no more tokens for now: they fold the factors they keep,
    # which hold the tensors of the steps that handed them over (every tracked row's, not this session's
    # alone) until folded, however long the recovery then waits for a gap or a deferred worker
    for req in result.ended:
        for rec in req.cache.recoveries():
            if rec.join is not None:
                rec.join.fold_buffered(gdn_ops)
    return result


def _observe(plan: StepPlan, out: StepOutputs, sessions: StepSessions, verified: dict[str, Verified],
             failed: set[TurnRequest]) -> None:
    """Tell the drafter the rows each turn ran and kept this step (speculative/drafter.py `observe`): input
    rows and kept answer rows, with the token after each and, if it asks, their hidden states; the rows a
    verify rejected are forgotten (`rollback`)."""
    drafter, at = sessions.drafter, 0
    for seg in plan.segments:
        if seg.kind not in KEPT:
            continue
        start, at = at, at + seg.rows
        req, cache = sessions.turn(seg.session), sessions.cache(seg.session)
        if req in failed or req.finish_reason == "cancelled":     # nothing was drawn after its rows
            continue
        if seg.kind is Kind.PREFILL:
            end = seg.first + seg.rows
            after = req.input.token_ids[seg.first + 1:end + 1]
            if end == len(req.input):
                after = [*after, req.generated[0]]
            positions = req.input.positions[:, seg.first:end]
            kept = seg.rows
        else:
            kept = verified[seg.session].kept if seg.kind is Kind.VERIFY else 1
            after = req.generated[len(req.generated) - kept:]
            positions = torch.arange(seg.position, seg.position + kept).expand(3, -1)
        hidden = out.hidden[start:start + kept] if out.hidden is not None else None
        drafter.observe(seg.session, torch.tensor(after, dtype=torch.long), positions, hidden)
        if seg.kind is Kind.VERIFY and kept < seg.rows:
            drafter.rollback(seg.session, len(cache.tokens) + 1)


def _rows(t: torch.Tensor | None, n: int) -> list[torch.Tensor | None]:
    return [None] * n if t is None else list(t.unbind(0))


def text_row_keys(segments: list[Segment]) -> np.ndarray:
    """The prefix cache's descriptions of answer segments' rows (text rows, as `turn_input.row_keys` writes
    them: token, its position thrice): one array for the step, the segments' rows in order."""
    tokens: list[int] = []
    positions: list[int] = []
    for seg in segments:
        if seg.rows == 1:       # a decode row (most of them): no tuple or range per row
            tokens.append(seg.token)
            positions.append(seg.position)
        else:
            tokens += seg.tokens
            positions += range(seg.position, seg.position + seg.rows)
    keys = np.zeros((len(tokens), ROW_KEY_WIDTH), dtype=np.int64)
    keys[:, 0] = tokens
    keys[:, 1:4] = np.array(positions, dtype=np.int64)[:, None]
    return keys


def chunk_carriers(plan: StepPlan) -> set[str]:
    """The sessions whose deferred rows `plan` carries."""
    return {s.session for s in plan.segments if s.kind in CHUNKS}


def _join_bookkeeping(out: StepOutputs, sessions: StepSessions, gdn_ops: GDNOps,
                      verified: dict[str, Verified]) -> None:
    for seg, s_lead in out.joined:
        cache = sessions.cache(seg.session)
        head = cache.recovery.join
        later = cache.queued.join if cache.queued is not None else None
        if later is not None and later.behind is not None:     # a later turn's join began behind this one
            later.rebase(head, s_lead - head.s_lead, gdn_ops)
        head.set_joined(s_lead)
    for t in out.tracked:
        if t.segment.kind is Kind.VERIFY and t.row >= verified[t.segment.session].kept:
            continue    # a rejected row: plain decoding never fed it, so it is no part of the recorded suffix
        cache = sessions.cache(t.segment.session)
        # a follow-up's input extends only earlier turns' joins (its own begins after it)
        joins = [r.join for r in cache.recoveries() if r.join is not None and not r.done
                 and (t.segment.kind is not Kind.PREFILL or r.turn < cache.latest_turn)]
        for i, join in enumerate(joins):
            if join.fed < join.lead:    # a lead token (the runner kept the state after it)
                join.record_lead(t.u, t.g, t.beta, t.state)
                if i and join.fed == join.lead:
                    join.lead_done(joins[0], gdn_ops)
            else:
                join.fold(t.k, t.v, t.g, t.beta, gdn_ops)
