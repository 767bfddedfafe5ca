"""Turn-boundary recovery on another worker (MECHANISM.md §8: PD-disaggregated mode).

Deferred rows never see the turn's generated tokens, so their inputs are independent of decoding:
at the answer's end the decode side ships what they *can* see — the K/V of every non-GEN slot, the
GDN prefix state and conv history — with the residual rows themselves. A deferred worker holding the
same checkpoint prefills them on top of that context and returns their K/V and, per GDN layer, the
prefix-state delta and final conv history. The decode side appends the K/V, rebuilds the prefix
state, repairs the lead and joins (exactly as after a local chunk), and the recovery is complete.
Plain tensors only: the services put them on the wire as bytes + dtype + shape, never pickle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidInputError
from .recovery import Recovery


@dataclass
class ResidualPayload:
    context_k: torch.Tensor                  # [attn layers, S, kv heads, head dim] — non-GEN slots, in order
    context_v: torch.Tensor
    prefix_conv: torch.Tensor | None         # [gdn layers, kernel - 1, conv dim]
    prefix_ssm: torch.Tensor | None          # [gdn layers, heads, dk, dv] fp32
    embeds: torch.Tensor                     # [R, hidden]
    positions: torch.Tensor                  # [3, R]
    deepstack_index: torch.Tensor            # [V] rows of R that carry DeepStack features
    deepstack: list[torch.Tensor]            # per level [V, hidden]

    @property
    def rows(self) -> int:
        return self.embeds.shape[0]

    def nbytes(self) -> int:
        parts = [self.context_k, self.context_v, self.prefix_conv, self.prefix_ssm, self.embeds, self.positions,
                 self.deepstack_index, *self.deepstack]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


@dataclass
class ResidualResult:
    k: torch.Tensor                          # [attn layers, R, kv heads, head dim]
    v: torch.Tensor
    delta_ssm: torch.Tensor | None           # [gdn layers, heads, dk, dv] fp32: final − shipped prefix state
    conv: torch.Tensor | None                # [gdn layers, kernel - 1, conv dim]: final conv history

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.delta_ssm, self.conv) if t is not None)


def export_residual(engine, session) -> ResidualPayload:
    """Decode side, after the answer: hand the session's remaining deferred rows out. Local gap
    recovery stops for this session until `apply_residual` or `take_back`."""
    with engine.lock:
        rec = _recovery(session)
        if not rec.answer_done:
            raise InvalidInputError("the answer is still streaming; hand off after it ends")
        seq = session.seq
        visible = (~seq._generated[: seq.length]).nonzero().flatten()
        slots = torch.cat([seq.table.slots(int(i), int(i) + 1) for i in visible]) if len(visible) else \
            torch.empty(0, dtype=torch.long)
        rows = rec.rows.subset(torch.arange(rec.cursor, rec.total))
        join = rec.join
        rec.handed_off = True
        return ResidualPayload(
            context_k=engine.kv.k[:, slots].clone(), context_v=engine.kv.v[:, slots].clone(),
            prefix_conv=engine.gdn.conv[join.prefix].clone() if join is not None else None,
            prefix_ssm=engine.gdn.ssm[join.prefix].clone() if join is not None else None,
            embeds=rows.embeds.clone(), positions=rows.positions.clone(),
            deepstack_index=rows.deepstack_index.clone(), deepstack=[d.clone() for d in rows.deepstack],
        )


def prefill_residual(engine, payload: ResidualPayload) -> ResidualResult:
    """Deferred-worker side: prefill the residual rows on top of the shipped context."""
    from ..engine.runner import _input_piece
    from ..engine.sequence import Sequence
    from ..engine.turn_input import TurnInput

    ctx, r = payload.context_k.shape[1], payload.rows
    with engine.lock:
        seq = Sequence(engine.kv, engine.gdn, engine.kv.num_pages)
        try:
            slots = seq.table.append(ctx)
            engine.kv.k[:, slots] = payload.context_k.to(engine.kv.k.dtype)
            engine.kv.v[:, slots] = payload.context_v.to(engine.kv.v.dtype)
            if engine.gdn is not None:
                engine.gdn.conv[seq.gdn_slot] = payload.prefix_conv.to(engine.gdn.conv.dtype)
                engine.gdn.ssm[seq.gdn_slot] = payload.prefix_ssm.float()
            rows = TurnInput([0] * r, payload.embeds.to(engine.dtype), payload.positions, 0, None,
                             payload.deepstack_index, [d.to(engine.dtype) for d in payload.deepstack])
            step = engine.config.max_rows_per_step
            for first in range(0, r, step):
                n = min(step, r - first)
                piece = _input_piece(rows, first, n, segment=lambda row, n=n: seq.add_rows(row, n),
                                     after=lambda: None)
                engine.runner._forward([piece])
            new = seq.table.slots(ctx, ctx + r)
            delta = conv = None
            if engine.gdn is not None:
                delta = engine.gdn.ssm[seq.gdn_slot] - payload.prefix_ssm.float()
                conv = engine.gdn.conv[seq.gdn_slot].clone()
            return ResidualResult(engine.kv.k[:, new].clone(), engine.kv.v[:, new].clone(), delta, conv)
        finally:
            seq.release()


def apply_residual(engine, session, result: ResidualResult) -> None:
    """Decode side: append the residual's K/V, rebuild the prefix state, repair + join; done."""
    with engine.lock:
        rec = _recovery(session)
        seq = session.seq
        r = result.k.shape[1]
        if r != rec.pending:
            raise InvalidInputError(f"the result covers {r} rows, {rec.pending} are pending")
        slots = seq.table.append(r)
        seq._label(seq.length - r, r, False)
        engine.kv.k[:, slots] = result.k.to(engine.kv.k.dtype)
        engine.kv.v[:, slots] = result.v.to(engine.kv.v.dtype)
        rec.slots.append(slots)
        join = rec.join
        if join is not None:
            engine.gdn.ssm[join.prefix] += result.delta_ssm.to(engine.gdn.ssm.device)
            engine.gdn.conv[join.prefix] = result.conv.to(engine.gdn.conv.dtype)
            for layer in engine.model.layers:
                if hasattr(layer, "linear_attn"):
                    join.after_chunk(layer.linear_attn)
        rec.advance(r)
        engine._recovery_done(seq)


def hold(engine, session) -> Recovery | None:
    """Reserve the session's current recovery for a deferred worker: local gap recovery leaves it
    alone (fused chunks during the answer still run), so what is left at the answer's end can be
    exported whole. Returns the recovery held, or None when nothing is left to recover."""
    with engine.lock:
        rec = session.seq.recovery
        if rec is None or rec.done:
            return None
        rec.handed_off = True
        return rec


def take_back(engine, session) -> None:
    """The deferred worker failed or timed out: recover locally again (a recovery is never lost)."""
    with engine.lock:
        rec = session.seq.recovery
        if rec is not None:
            rec.handed_off = False


def _recovery(session) -> Recovery:
    rec = session.seq.recovery
    if rec is None or rec.done:
        raise InvalidInputError(f"session {session.id} has no deferred input left to recover")
    return rec
