"""What the engine's hand-off verbs do: a turn's deferred residual prefilled on another worker (docs/mechanism.md
§8). The facade's verbs run these under the engine lock and across its ranks (engine/handoff_verbs.py).

Decode side: `Recovery.hold` keeps local gap recovery off a recovery (and, if asked, fused chunks too),
`export` ships what its remaining rows may see (once the turn's I0 is in; a receiver that holds part of
the context gets only the rest), `apply` joins what comes back (mid-answer only past the guard, by the
same rule as fused chunks: `Recovery.past_guard`) by an ordinary step of its own, whose one segment is
the recovery's rows (`Kind.HANDOFF`: the runner computes the join, the update applies it as a chunk's),
`Recovery.take_back` gives it to local recovery again, `Recovery.race` lets a barrier recover it locally
while the result may still come.
Deferred-worker side: `prefill` runs the shipped rows through the ordinary step, as a scratch session's
residual segments (engine/stepper.py `prefill_scratch`).

The split between local and shipped rows is made at the join: a result covers D from the cursor at its
export; fused chunks (or a racing barrier) may have restored a prefix of that since, and `apply` joins
only the rows after the cursor, so no row is restored twice. A recovery is named by its turn index (the
*ticket*) and checked by its serial, so a late result for an earlier recovery, or for an undone attempt
of the same turn, is refused, never applied. Mid-answer, a result is joined only where a fused chunk
could be (policy `raincheck`, past the guard); otherwise `apply` says "not yet".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..deferral.handoff import Joined, ResidualPayload, ResidualResult
from ..deferral.recovery import Recovery
from ..errors import RecoveryStateError
from ..multimodal.turn_input import TurnInput
from .session_cache import SessionCache

if TYPE_CHECKING:
    from .core import EngineCore
    from .stepper import Stepper


def current(cache: SessionCache, ticket: int | None = None, *, held: bool | None = None) -> Recovery:
    """The cache's recovery, if it is the one named by `ticket` (any when None) and, with `held`, in
    that hand-off state; else RecoveryStateError."""
    rec = cache.recovery
    if rec is None or rec.done:
        raise RecoveryStateError("the session has no deferred input left to recover")
    if ticket is not None and rec.turn != ticket:
        raise RecoveryStateError(f"the recovery of turn {ticket} is over (the session is at turn {rec.turn})")
    if held is not None and rec.held != held:
        raise RecoveryStateError("the recovery is " + ("not " if held else "") + "held for a deferred worker")
    return rec


def visible_positions(cache: SessionCache) -> torch.Tensor:
    """Positions in the cache (0 .. length - 1) of the slots deferred rows may read, ascending."""
    slots = cache.table.slots(0, cache.length)
    return torch.isin(slots, cache.visible_slots()).nonzero().flatten()


def export(core: EngineCore, cache: SessionCache, ticket: int, have: torch.Tensor | None = None) -> ResidualPayload:
    rec = current(cache, ticket, held=True)
    req = core.turn(cache.session)
    if req is not None and not req.decoding:
        raise RecoveryStateError("the turn's input is still being prefilled: hand off once it is in")
    positions = visible_positions(cache)
    shipped = positions
    if have is not None:
        held = torch.isin(positions, have)
        if int(held.sum()) != have.numel() or have.unique().numel() != have.numel():
            raise RecoveryStateError("the receiver holds context rows this session's cache does not have visible")
        shipped = positions[~held]
    slots = cache.table.slots(0, cache.length)[shipped]
    rows = rec.rows.subset(torch.arange(rec.cursor, rec.total))
    join, kv, gdn = rec.join, core.kv, core.gdn
    return ResidualPayload(
        context_k=kv.k[:, slots].clone(), context_v=kv.v[:, slots].clone(), context_index=shipped,
        visible=len(positions),
        prefix_conv=gdn.conv[join.prefix].clone() if join is not None else None,
        prefix_ssm=gdn.ssm[join.prefix].clone() if join is not None else None,
        embeds=rows.embeds.clone(), positions=rows.positions.clone(),
        deepstack_index=rows.deepstack_index.clone(), deepstack=[d.clone() for d in rows.deepstack],
        recovery=rec.serial, first=rec.cursor,
    )


def prefill(stepper: Stepper, payload: ResidualPayload) -> ResidualResult:
    """Prefill the residual rows on top of the shipped context, on a scratch session."""
    core = stepper.core
    ctx, r = payload.context_k.shape[1], payload.rows
    if ctx != payload.visible:
        raise RecoveryStateError(f"the payload ships {ctx} of the {payload.visible} context rows its residual sees")
    kv, gdn = core.kv, core.gdn
    rows = TurnInput([0] * r, payload.embeds.to(core.device, core.dtype), payload.positions, 0, None,
                     payload.deepstack_index, [d.to(core.device, core.dtype) for d in payload.deepstack])
    with core.scratch_session(rows) as cache:
        slots = cache.table.append(ctx)
        kv.k[:, slots] = payload.context_k.to(kv.k.dtype)
        kv.v[:, slots] = payload.context_v.to(kv.v.dtype)
        if gdn is not None:
            gdn.conv[cache.gdn_slot] = payload.prefix_conv.to(gdn.conv.dtype)
            gdn.ssm[cache.gdn_slot] = payload.prefix_ssm.float()
        stepper.prefill_scratch(cache)
        new = cache.table.slots(ctx, ctx + r)
        ssm = conv = None
        if gdn is not None:
            ssm = gdn.ssm[cache.gdn_slot].clone()
            conv = gdn.conv[cache.gdn_slot].clone()
        return ResidualResult(kv.k[:, new].clone(), kv.v[:, new].clone(), ssm, conv,
                              recovery=payload.recovery, first=payload.first)


def apply(stepper: Stepper, cache: SessionCache, ticket: int, result: ResidualResult) -> Joined | None:
    """Join the result's rows from the cursor on, by a step of their own (engine/step.py `run_handoff`):
    their K/V go in, the prefix state is the result's, the lead is repaired and joined as after a local
    chunk; the recovery is done. None (nothing changed) while the answer streams and a chunk could not be
    fused now (policy without fused chunks, or within the guard): try again later."""
    rec = current(cache, ticket, held=True)
    if result.recovery != rec.serial:
        raise RecoveryStateError(f"the result was made for another recovery of turn {ticket} (an undone attempt)")
    if not result.first <= rec.cursor or result.first + result.rows != rec.total:
        raise RecoveryStateError(f"the result covers deferred rows {result.first}..{result.first + result.rows}; "
                                 f"the recovery has {rec.cursor}..{rec.total} left")
    req = stepper.core.turn(cache.session)
    if req is not None and not (req.decoding if req.turn > rec.turn else rec.past_guard(req.answer_fed)):
        return None     # late rows join once the follow-up's input is in (docs/mechanism.md §10)
    offset, start = rec.cursor - result.first, cache.length
    stepper.hand_in(cache, result)
    return Joined(offset, torch.arange(start, start + result.rows - offset))
