"""What a recovery on another worker ships (docs/mechanism.md §8: PD-disaggregated mode).

Deferred rows never see the turn's generated tokens, so their inputs are independent of decoding: once
the turn's I0 is prefilled, the decode side can ship what they *can* see (the K/V of every non-GEN slot,
the GDN prefix state and conv history) with the residual rows themselves (D from the recovery's cursor).
A deferred worker holding the same checkpoint prefills them on top of that context and returns their K/V
and, per GDN layer, the final prefix state and conv history. The decode side joins the rows it has not
restored itself meanwhile (fused chunks may have restored a prefix of them: each row is restored once,
split at the join), sets the prefix state, repairs the lead and joins (exactly as after a local chunk),
and the recovery is complete.

A receiver that already holds some of the context (a deferred worker keeping a session's context from
its last recovery) is shipped only the rows it lacks: `context_index` gives each shipped row's position
in the session's cache, `visible` how many rows the residual sees in all, so the receiver can put them
together in cache order. Plain tensors and ints only: the services put them on the wire as bytes + dtype
+ shape, never pickle. The verbs that make and use them are the engine's (`Engine.hold_residual`,
`export_residual`, `prefill_residual`, `apply_residual`, `take_back`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ResidualPayload:
    context_k: torch.Tensor                  # [attn layers, S, kv heads, head dim]: shipped context rows, in order
    context_v: torch.Tensor
    context_index: torch.Tensor              # [S] each shipped row's position in the session's cache (ascending)
    visible: int                             # context rows the residual sees in all (S when all are shipped)
    prefix_conv: torch.Tensor | None         # [gdn layers, kernel - 1, conv dim]
    prefix_ssm: torch.Tensor | None          # [gdn layers, heads, dk, dv] fp32
    embeds: torch.Tensor                     # [R, hidden]: D's rows from `first` on
    positions: torch.Tensor                  # [3, R]
    deepstack_index: torch.Tensor            # [V] rows of R that carry DeepStack features
    deepstack: list[torch.Tensor]            # per level [V, hidden]
    recovery: int = 0                        # the recovery's serial (its result is refused by any other)
    first: int = 0                           # index in D of the first residual row

    @property
    def rows(self) -> int:
        return self.embeds.shape[0]

    def nbytes(self) -> int:
        parts = [self.context_k, self.context_v, self.context_index, self.prefix_conv, self.prefix_ssm, self.embeds,
                 self.positions, self.deepstack_index, *self.deepstack]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


@dataclass
class ResidualResult:
    k: torch.Tensor                          # [attn layers, R, kv heads, head dim]: D's rows from `first` on
    v: torch.Tensor
    ssm: torch.Tensor | None                 # [gdn layers, heads, dk, dv] fp32: the prefix state after D
    conv: torch.Tensor | None                # [gdn layers, kernel - 1, conv dim]: the conv history after D
    recovery: int = 0                        # the serial of the recovery it was made for
    first: int = 0

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.ssm, self.conv) if t is not None)


@dataclass
class Joined:
    """What `Engine.apply_residual` joined: the result's rows from `offset` on (the ones before it were
    restored by fused chunks meanwhile), now at `positions` in the session's cache."""

    offset: int
    positions: torch.Tensor
