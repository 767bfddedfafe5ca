"""What one turn's deferred recovery keeps for the GDN join (docs/mechanism.md §5).

Per GDN layer: the prefix state (recurrent state + conv history at the insertion boundary, a slot in
the GDN pool) that deferred chunks advance; the pre-conv inputs and factors of the first `kernel - 1`
generated tokens (the *lead*, whose conv windows reach back across the boundary) and `S_lead`, the live
state right after them; and `P_rest`, the product of the transitions of every later generated token,
fp32 throughout. A later token's factors are only kept (views of the step's own tensors, which nothing
writes again: engine/runner.py `_tracked`); they are folded into `P_rest` a block at a time by the op
set's fold (`GDNOps.fold`, ops/backend.py), when `BUFFER` wait, when the turn's answer ends (the views
hold every tracked row's tensors of their steps: engine/update.py folds then, not after the gap) or a
value that needs the whole map is about to be taken (`fold_buffered`: the engine core calls it before a
chunk's forward, and `begin`, `lead_done`, `rebase` and `snapshot` call it here), so a decode step pays
for a list append instead of a map update (or of three copies into a buffer: a decode step of 64 tracked
sessions spent ~0.5 ms on them). Reading `p_rest` folds nothing.

The join itself runs inside the forward (layers/gdn.py): a deferred chunk is run from the prefix state
with the lead appended (the boundary repair), which gives `S_lead'`, then `S_live += P_rest · (S_lead' −
S_lead)` (P on the left). This class only holds the state and records what the engine's update feeds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.gdn_state import GDNStatePool
from ..ops.backend import GDNOps
from ..ops.gdn_state_map import identity_map

# generated tokens whose factors wait to be folded into P_rest: their k, g and beta are a quarter of
# P_rest's size when Dk = 128 (Qwen3.5), and 32 tokens per fold already make the per-token cost small
BUFFER = 32


@dataclass
class Behind:
    """A join that began while an earlier turn's join was still pending (docs/mechanism.md §10.3): that
    join's map P when this one began (its prefix state absorbed the earlier rows through it) and when
    this one's lead was complete (likewise its `S_lead`; None until then)."""

    at_prefix: torch.Tensor
    at_lead: torch.Tensor | None = None


@dataclass(frozen=True)
class JoinSnapshot:
    conv: torch.Tensor
    ssm: torch.Tensor
    s_lead: torch.Tensor
    lead: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    p_rest: torch.Tensor
    fed: int
    audited: int


class GDNJoin:
    def __init__(self, pool: GDNStatePool, live_slot: int, kernel: int, keep_factors: bool = False):
        self.pool = pool
        self.live = live_slot
        self.prefix: int | None = pool.allocate()   # at admission, so a full pool fails the turn early
        layers, _, conv_dim = pool.conv.shape[1:]
        heads, dk = pool.ssm.shape[2], pool.ssm.shape[3]
        self.lead = kernel - 1
        self.lead_u = torch.zeros(layers, self.lead, conv_dim, dtype=pool.conv.dtype, device=pool.conv.device)
        self.lead_beta = torch.zeros(layers, self.lead, heads, device=pool.ssm.device)
        self.lead_g = torch.zeros(layers, self.lead, heads, device=pool.ssm.device)
        self.s_lead = torch.zeros_like(pool.ssm[live_slot])
        # [layers, H, Dk, Dk]: the map of every generated token past the lead folded so far
        self.p_rest = identity_map(heads, dk, pool.ssm.device).expand(layers, heads, dk, dk).clone()
        # (k, g, beta) of each token not folded into P_rest yet, as the runner handed them over (k per key
        # head: widened to value heads once per fold)
        self._waiting: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.fed = 0                                # generated tokens run on the live path so far
        # (k, v, g, beta) of every token folded into P_rest, per layer, for audits and tests
        self.factors: list[list[tuple[torch.Tensor, ...]]] | None = [[] for _ in range(layers)] \
            if keep_factors else None
        self.behind: Behind | None = None

    @property
    def lead_rows(self) -> int:
        """Lead tokens recorded so far: the rows a chunk's boundary repair re-runs."""
        return min(self.fed, self.lead)

    def begin(self, ahead: GDNJoin | None, gdn_ops: GDNOps) -> None:
        """The turn's I0 is prefilled: the live state is the insertion boundary (input-end insertion).
        `ahead`: an earlier turn's join still pending, whose later chunks will move this boundary too.
        `gdn_ops`: the step's GDN ops (here and below: they fold what a value read from a map needs)."""
        self.pool.copy(self.live, self.prefix)
        self.s_lead.copy_(self.pool.ssm[self.live])
        self.behind = Behind(ahead.fold_buffered(gdn_ops).clone()) if ahead is not None else None

    def lead_done(self, ahead: GDNJoin, gdn_ops: GDNOps) -> None:
        """This join's lead just completed while `ahead` is pending: fix the map `S_lead` moves by."""
        if self.behind is not None and self.behind.at_lead is None:
            self.behind.at_lead = ahead.fold_buffered(gdn_ops).clone()

    def rebase(self, ahead: GDNJoin, delta: torch.Tensor, gdn_ops: GDNOps) -> None:
        """`ahead`'s chunk just joined, moving the state at its lead by `delta [layers, H, Dk, Dv]`: the
        prefix state and `S_lead` here absorbed `ahead`'s recorded suffix up to them, so they move by that
        suffix's map times `delta`, as the live state did (while the lead is incomplete `S_lead` is the live
        state, so the map is `ahead`'s whole current one)."""
        b = self.behind
        prefix = self.pool.ssm[self.prefix]
        prefix.copy_(gdn_ops.join(prefix, b.at_prefix, delta))
        at_lead = b.at_lead if b.at_lead is not None else ahead.fold_buffered(gdn_ops)
        self.s_lead.copy_(gdn_ops.join(self.s_lead, at_lead, delta))

    @property
    def nbytes(self) -> int:
        """Bytes this join holds: its maps, lead records, factor buffers and its prefix state slot."""
        held = [self.p_rest, self.s_lead, self.lead_u, self.lead_g, self.lead_beta]
        held += [t for factors in self._waiting for t in factors]
        if self.behind is not None:
            held += [t for t in (self.behind.at_prefix, self.behind.at_lead) if t is not None]
        # a slot's memory is all of its rows (two in the live pool, used in turn: cache/gdn_state.py)
        slot = self.pool.rows_per_slot * self.pool.slot_bytes if self.prefix is not None else 0
        return sum(t.nbytes for t in held) + slot

    def snapshot(self, gdn_ops: GDNOps) -> JoinSnapshot:
        return JoinSnapshot(self.pool.conv[self.prefix].clone(), self.pool.ssm[self.prefix].clone(),
                            self.s_lead.clone(), (self.lead_u.clone(), self.lead_g.clone(), self.lead_beta.clone()),
                            self.fold_buffered(gdn_ops).clone(), self.fed,
                            len(self.factors[0]) if self.factors is not None else 0)

    def restore(self, snap: JoinSnapshot) -> None:
        """Back to `snap` (its prefix slot taken again if it was released meanwhile)."""
        if self.prefix is None:
            self.prefix = self.pool.allocate()
        self.pool.conv[self.prefix].copy_(snap.conv)
        self.pool.ssm[self.prefix].copy_(snap.ssm)
        self.s_lead.copy_(snap.s_lead)
        for mine, saved in zip((self.lead_u, self.lead_g, self.lead_beta), snap.lead, strict=True):
            mine.copy_(saved)
        self._waiting.clear()
        self.p_rest.copy_(snap.p_rest)
        self.fed = snap.fed
        if self.factors is not None:
            for layer in self.factors:
                del layer[snap.audited:]

    def record_lead(self, u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor) -> None:
        """Generated token number `fed` (< lead) ran: its per-layer pre-conv input `u [layers, conv dim]`,
        `g`, `beta [layers, H]`, and the live state after it `[layers, H, Dk, Dv]`."""
        self.lead_u[:, self.fed] = u
        self.lead_g[:, self.fed] = g
        self.lead_beta[:, self.fed] = beta
        self.s_lead.copy_(state)
        self.fed += 1

    def fold(self, k: torch.Tensor, v: torch.Tensor | None, g: torch.Tensor, beta: torch.Tensor,
             gdn_ops: GDNOps) -> None:
        """A generated token past the lead ran: its transition joins P_rest (buffered, folded a block at
        a time by `gdn_ops`). k `[layers, key heads, Dk]` (value head h reads key head h // (H / key heads);
        key heads may be H), v `[layers, H, Dv]` (read only when the join keeps factors for audits), g, beta
        `[layers, H]`: kept as they are until they are folded, so nothing may write them again."""
        if len(self._waiting) == BUFFER:
            self.fold_buffered(gdn_ops)
        self._waiting.append((k, g, beta))
        if self.factors is not None:
            if v is None:
                raise ValueError("a join that keeps factors for audits needs each token's v")
            for layer, f in zip(self.factors, zip(self._value_heads(k), v, g, beta, strict=True), strict=True):
                layer.append(tuple(t[None].clone() for t in f))
        self.fed += 1

    def _value_heads(self, k: torch.Tensor) -> torch.Tensor:
        heads = self.p_rest.shape[1]
        return k if k.shape[-2] == heads else k.repeat_interleave(heads // k.shape[-2], dim=-2)

    def fold_buffered(self, gdn_ops: GDNOps) -> torch.Tensor:
        """Fold the buffered tokens' factors into P_rest now, by `gdn_ops.fold`; returns P_rest. Called
        where the whole map is about to be read: by the engine core before a chunk's forward (so the
        forward, a stage that only reads, changes no join), and here before a value is taken from it."""
        if self._waiting:   # token-major factors over all layers' maps at once
            k, g, beta = (torch.stack(f) for f in zip(*self._waiting, strict=True))
            self._waiting.clear()
            gdn_ops.fold(self.p_rest, self._value_heads(k), g, beta)
        return self.p_rest

    def set_joined(self, s_lead: torch.Tensor) -> None:
        """A chunk was joined: `S_lead'` (the lead re-run from the new prefix) is the new reference."""
        self.s_lead.copy_(s_lead)

    def release(self) -> None:
        if self.prefix is not None:
            self.pool.release(self.prefix)
            self.prefix = None

