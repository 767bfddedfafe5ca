"""The engine's hand-off verbs: a turn's post-answer residual prefilled on another worker (docs/mechanism.md §8).

Decode side: `hold` keeps local gap recovery off a recovery, `export` ships what its rows may see,
`apply` joins what comes back, `take_back` gives it to local recovery again. Deferred-worker side:
`prefill` runs the shipped rows through the ordinary step on a scratch cache. A recovery is named by
its turn index (the *ticket*), so a late result for an earlier recovery is refused, never applied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..deferral.handoff import ResidualPayload, ResidualResult
from ..deferral.recovery import Recovery
from ..errors import RecoveryStateError
from ..multimodal.turn_input import TurnInput
from ..ops.gdn_state_map import join_state
from .plan import Kind, Segment, StepPlan
from .session_cache import SessionCache
from .update import apply_step

if TYPE_CHECKING:
    from .engine import Engine


def current(cache: SessionCache, ticket: int | None = None, *, held: bool | None = None) -> Recovery:
    """The cache's recovery, if it is the one named by `ticket` (any when None) and, with `held`, in
    that hand-off state; else RecoveryStateError."""
    rec = cache.recovery
    if rec is None or rec.done:
        raise RecoveryStateError("the session has no deferred input left to recover")
    if ticket is not None and rec.turn != ticket:
        raise RecoveryStateError(f"the recovery of turn {ticket} is over (the session is at turn {rec.turn})")
    if held is not None and rec.handed_off != held:
        raise RecoveryStateError("the recovery is " + ("not " if held else "") + "held for a deferred worker")
    return rec


def export(engine: Engine, cache: SessionCache, ticket: int) -> ResidualPayload:
    rec = current(cache, ticket, held=True)
    if not rec.answer_done:
        raise RecoveryStateError("the answer is still streaming; hand off after it ends")
    slots = cache.visible_slots()
    rows = rec.rows.subset(torch.arange(rec.cursor, rec.total))
    join, kv, gdn = rec.join, engine.kv, engine.gdn
    return ResidualPayload(
        context_k=kv.k[:, slots].clone(), context_v=kv.v[:, slots].clone(),
        prefix_conv=gdn.conv[join.prefix].clone() if join is not None else None,
        prefix_ssm=gdn.ssm[join.prefix].clone() if join is not None else None,
        embeds=rows.embeds.clone(), positions=rows.positions.clone(),
        deepstack_index=rows.deepstack_index.clone(), deepstack=[d.clone() for d in rows.deepstack],
    )


def prefill(engine: Engine, payload: ResidualPayload) -> ResidualResult:
    """Prefill the residual rows on top of the shipped context, on a scratch cache."""
    ctx, r = payload.context_k.shape[1], payload.rows
    cache = SessionCache(engine.kv, engine.gdn, engine.kv.num_pages)
    try:
        slots = cache.table.append(ctx)
        engine.kv.k[:, slots] = payload.context_k.to(engine.kv.k.dtype)
        engine.kv.v[:, slots] = payload.context_v.to(engine.kv.v.dtype)
        if engine.gdn is not None:
            engine.gdn.conv[cache.gdn_slot] = payload.prefix_conv.to(engine.gdn.conv.dtype)
            engine.gdn.ssm[cache.gdn_slot] = payload.prefix_ssm.float()
        rows = TurnInput([0] * r, payload.embeds.to(engine.device, engine.dtype), payload.positions, 0, None,
                         payload.deepstack_index, [d.to(engine.device, engine.dtype) for d in payload.deepstack])
        step = engine.config.max_rows_per_step
        for first in range(0, r, step):
            n = min(step, r - first)
            write = cache.claim(n)
            plan = StepPlan([Segment(Kind.RESIDUAL, cache, n, write, cache.readable(n), cache.gdn_slot,
                                     source=rows, first=first)])
            apply_step(engine, plan, engine.runner.run(plan))
        new = cache.table.slots(ctx, ctx + r)
        delta = conv = None
        if engine.gdn is not None:
            delta = engine.gdn.ssm[cache.gdn_slot] - payload.prefix_ssm.float()
            conv = engine.gdn.conv[cache.gdn_slot].clone()
        return ResidualResult(engine.kv.k[:, new].clone(), engine.kv.v[:, new].clone(), delta, conv)
    finally:
        cache.release()


def apply(engine: Engine, cache: SessionCache, ticket: int, result: ResidualResult) -> None:
    """Append the residual's K/V, rebuild the prefix state, repair the lead and join; the recovery is done."""
    rec = current(cache, ticket, held=True)
    r = result.k.shape[1]
    if r != rec.pending:
        raise RecoveryStateError(f"the result covers {r} rows, {rec.pending} are pending")
    slots = cache.claim(r)
    engine.kv.k[:, slots] = result.k.to(device=engine.device, dtype=engine.kv.k.dtype)
    engine.kv.v[:, slots] = result.v.to(device=engine.device, dtype=engine.kv.v.dtype)
    cache.fill(r)
    rec.slots.append(slots)
    if rec.join is not None:
        gdn = engine.gdn
        gdn.ssm[rec.join.prefix] += result.delta_ssm.to(gdn.ssm.device)
        gdn.conv[rec.join.prefix] = result.conv.to(device=gdn.conv.device, dtype=gdn.conv.dtype)
        _join(engine, rec)
    rec.advance(r)
    engine._recovery_done(cache)


def _join(engine: Engine, rec: Recovery) -> None:
    """The lead repair and join for a prefix state set from outside a step (layer by layer; the step
    does the same inside its forward)."""
    join, pool = rec.join, engine.gdn
    n = join.lead_rows
    for layer in engine.model.gdn_layers():
        i = layer.gdn_index
        conv, state = pool.conv[join.prefix, i], pool.ssm[join.prefix, i]
        if n:
            conv, state = layer.rerun(join.lead_u[i, :n], join.lead_g[i, :n], join.lead_beta[i, :n], conv, state)
        pool.ssm[join.live, i] = join_state(pool.ssm[join.live, i], join.p_rest[i], state - join.s_lead[i])
        join.s_lead[i] = state
        if join.fed < join.lead:     # the live conv window still reaches back across the boundary
            pool.conv[join.live, i] = conv
