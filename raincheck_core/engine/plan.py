"""A step as data: which rows of which sessions run, where their K/V go, what each may read.

The scheduler builds a `StepPlan` (deciding and claiming slots, changing nothing else); the model
runner turns it into tensors and runs the forward; the engine's update applies the results. The plan
is plain data, so a failed forward can be dropped (`cancel`), a step can be split into passes, and a
test can compare a plan's outputs with a reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..deferral.recovery import Recovery
    from ..multimodal.turn_input import TurnInput
    from .request import TurnRequest
    from .session_cache import SessionCache


class Kind(StrEnum):
    PREFILL = "prefill"        # a running turn's input rows (I0)
    DECODE = "decode"          # a running turn's one generated-token row
    DEFERRED = "deferred"      # deferred rows fused into their turn's decode step (raincheck)
    RECOVERY = "recovery"      # deferred rows after the answer (idle gaps, the barrier)
    RESIDUAL = "residual"      # rows prefilled for a hand-off on a deferred worker


@dataclass(eq=False)
class Segment:
    """Contiguous rows of one session in the packed step."""

    kind: Kind
    cache: SessionCache
    rows: int
    write_slots: torch.Tensor             # [rows] claimed KV slots
    read_slots: torch.Tensor              # slots the rows may read, own last (bottom-right causal)
    gdn_slot: int | None                  # the state the rows start from and advance
    source: TurnInput | None = None       # rows [first, first + rows) of it; None for a decode row
    first: int = 0
    token: int | None = None              # a decode row's input token and position
    position: int = 0
    request: TurnRequest | None = None    # the turn a prefill/decode segment advances
    recovery: Recovery | None = None      # deferred/recovery: the recovery it advances;
                                          # decode: the recovery whose GDN map it extends (if any)
    sample: bool = False                  # the turn samples its next token from the last row's logits
    lead: int = 0                         # deferred/recovery with a GDN join: lead rows appended
    live_slot: int | None = None          # … and the live state the join corrects


@dataclass
class StepPlan:
    segments: list[Segment] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.segments)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    def caches(self) -> list[SessionCache]:
        """The sessions in this step, in order, once each."""
        return list(dict.fromkeys(s.cache for s in self.segments))

    def passes(self) -> list[StepPlan]:
        """Serial comparison mode (`DeferralConfig.fused=False`): deferred chunks of such turns run in a
        pass of their own before the rest. Fused (the default): one pass."""
        serial = [s for s in self.segments if s.kind is Kind.DEFERRED and not s.recovery.cfg.fused]
        if not serial:
            return [self]
        return [StepPlan(serial), StepPlan([s for s in self.segments if all(s is not t for t in serial)])]

    def cancel(self) -> None:
        """Drop the plan: the claimed slots go back to their sessions' tables unfilled."""
        for cache in self.caches():
            cache.cancel_claims()
