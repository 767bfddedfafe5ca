"""The GDN affine state map of one turn's deferred recovery (MECHANISM.md §5).

Per GDN layer: the prefix state (recurrent state + conv history at the insertion boundary, a slot in
the GDN pool); the pre-conv inputs and factors of the first `kernel - 1` generated tokens (the
*lead*, whose conv windows reach back into the input) and the state after them from the prefix,
`S_lead`; and `P_rest`, the product of the transitions of every later generated token, extended
online with a rank-1 update per token, fp32 throughout.

After a deferred chunk advances the prefix slot: re-run the lead from the new boundary (boundary
repair) -> `S_lead'`, then `S_live += P_rest · (S_lead' − S_lead)` (P on the left).
"""

from __future__ import annotations

import torch

from ..cache.gdn_state import GDNStatePool
from ..ops.gdn import recurrent_gated_delta_rule
from ..ops.gdn_state_map import extend_map, identity_map, join_state


class GDNJoin:
    def __init__(self, pool: GDNStatePool, live_slot: int, kernel: int, keep_factors: bool = False):
        self.pool = pool
        self.live = live_slot
        self.prefix = pool.allocate()              # at admission, so a full pool fails the turn early
        layers, _, conv_dim = pool.conv.shape[1:]
        heads, dk = pool.ssm.shape[2], pool.ssm.shape[3]
        self.lead = kernel - 1
        self.lead_u = torch.zeros(layers, self.lead, conv_dim, dtype=pool.conv.dtype, device=pool.conv.device)
        self.lead_beta = torch.zeros(layers, self.lead, heads, device=pool.ssm.device)
        self.lead_g = torch.zeros(layers, self.lead, heads, device=pool.ssm.device)
        self.s_lead = torch.zeros_like(pool.ssm[live_slot])
        self.p_rest = identity_map(heads, dk, pool.ssm.device).expand(layers, heads, dk, dk).clone()
        self.fed = 0                                # generated tokens run on the live path so far
        # (k, v, g, beta) of every token folded into P_rest, per layer, for audits and tests
        self.factors: list[list[tuple[torch.Tensor, ...]]] | None = [[] for _ in range(layers)] \
            if keep_factors else None

    def begin(self) -> None:
        """The turn's I0 is prefilled: the live state is the insertion boundary (input-end insertion)."""
        self.pool.copy(self.live, self.prefix)
        self.s_lead.copy_(self.pool.ssm[self.live])

    def after_generated(self, layer, u: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                        k: torch.Tensor, v: torch.Tensor) -> None:
        """A generated token (one row) just ran on the live path of `layer`."""
        i = layer.gdn_index
        if self.fed < self.lead:
            self.lead_u[i, self.fed] = u[0]
            self.lead_beta[i, self.fed] = beta[0]
            self.lead_g[i, self.fed] = g[0]
            self.s_lead[i].copy_(self.pool.ssm[self.live, i])
        else:
            self.p_rest[i] = extend_map(self.p_rest[i], k, g, beta)
            if self.factors is not None:
                self.factors[i].append((k.clone(), v.clone(), g.clone(), beta.clone()))

    def after_chunk(self, layer, *_: torch.Tensor) -> None:
        """A deferred chunk just advanced the prefix slot of `layer`: repair the lead, join into live."""
        i = layer.gdn_index
        n = min(self.fed, self.lead)
        hist = self.pool.conv[self.prefix, i]
        s_prefix = self.pool.ssm[self.prefix, i]
        if n:
            q, k, v, _ = layer.factors(self.lead_u[i, :n], hist)
            _, s_lead = recurrent_gated_delta_rule(q, k, v, self.lead_g[i, :n], self.lead_beta[i, :n], s_prefix)
        else:
            s_lead = s_prefix.clone()
        live = self.pool.ssm[self.live, i]
        live.copy_(join_state(live, self.p_rest[i], s_lead - self.s_lead[i]))
        self.s_lead[i].copy_(s_lead)
        if self.fed < self.lead:   # the live conv window still reaches back across the boundary
            window = torch.cat([hist, self.lead_u[i, :n]])[-self.lead:]
            self.pool.conv[self.live, i].copy_(window)

    def advance(self) -> None:
        self.fed += 1

    def release(self) -> None:
        if self.prefix is not None:
            self.pool.release(self.prefix)
            self.prefix = None
