"""What a turn-boundary recovery on another worker ships (docs/mechanism.md §8: PD-disaggregated mode).

Deferred rows never see the turn's generated tokens, so their inputs are independent of decoding:
at the answer's end the decode side ships what they *can* see — the K/V of every non-GEN slot, the
GDN prefix state and conv history — with the residual rows themselves. A deferred worker holding the
same checkpoint prefills them on top of that context and returns their K/V and, per GDN layer, the
prefix-state delta and final conv history. The decode side appends the K/V, rebuilds the prefix
state, repairs the lead and joins (exactly as after a local chunk), and the recovery is complete.
Plain tensors only: the services put them on the wire as bytes + dtype + shape, never pickle. The
verbs that make and use them are the engine's (`Engine.hold_residual`, `export_residual`,
`prefill_residual`, `apply_residual`, `take_back`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
