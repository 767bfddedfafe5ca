"""What a step's forward hands its update (engine/update.py applies it; engine/runner.py makes it): the
sampled rows' logits, the GDN slots to commit and state writes, the deferred joins' records, the tracked
rows' factors, the prefills' checkpoints and the kept hidden states."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..ops.gdn_traffic import GDNTraffic
from .plan import Segment


@dataclass
class StateWrite:
    """New GDN states the update copies into `slots`' current rows, every layer's; conv or ssm may be None
    (left as they are). Only what no kernel wrote into a slot's other row: a join's corrected live state
    where no decode row of its turn ran in the step, and a hand-off's states."""

    slots: list[int]
    conv: torch.Tensor | None     # [N, layers, K-1, conv dim]
    ssm: torch.Tensor | None      # [N, layers, H, Dk, Dv] fp32


@dataclass
class Tracked:
    """A generated token of a turn whose GDN map is tracked: its factors per layer and, for the first
    `kernel - 1` (the lead), the state after it; later tokens only extend P_rest."""

    segment: Segment
    u: torch.Tensor | None          # [layers, conv dim], for a lead token only
    k: torch.Tensor                 # [layers, H, Dk]
    v: torch.Tensor | None          # [layers, H, Dv], when the join keeps factors for audits
    g: torch.Tensor                 # [layers, H]
    beta: torch.Tensor              # [layers, H]
    state: torch.Tensor | None      # [layers, H, Dk, Dv], for a lead token only (the join's S_lead)
    row: int = 0                    # its row in its segment: a verify segment's rows past the kept ones are
                                    # rejected, and extend no join (engine/update.py)


@dataclass
class StepOutputs:
    logits: torch.Tensor                                  # [sampled segments, vocab] fp32, in plan order
    # the GDN slots whose new states the forward wrote into their other rows: the update makes them current
    committed: list[int] = field(default_factory=list)
    writes: list[StateWrite] = field(default_factory=list)
    joined: list[tuple[Segment, torch.Tensor]] = field(default_factory=list)   # chunk, S_lead' [layers, H, Dk, Dv]
    tracked: list[Tracked] = field(default_factory=list)
    gdn_traffic: GDNTraffic | None = None      # bytes of GDN state the step moved and had to (None: no GDN)
    # per prefill with `Segment.checkpoints`, in plan order: (it, conv histories [m, layers, K-1, C], states
    # [m, layers, H, Dk, Dv] after its checkpoint rows)
    checkpoints: list[tuple[Segment, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # with `ModelRunner.keep_hidden`: the final-norm hidden states of the input and answer rows (`KEPT`), in
    # plan order `[rows, hidden]`
    hidden: torch.Tensor | None = None

    def detached(self) -> StepOutputs:
        """A copy owning its tensors (outputs read from a graph's buffers, which the next replay rewrites)."""
        def own(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.clone()
        return StepOutputs(
            self.logits.clone(), list(self.committed),
            [StateWrite(list(w.slots), own(w.conv), own(w.ssm)) for w in self.writes],
            [(seg, s.clone()) for seg, s in self.joined],
            # a tracked row's factors are the step's own (`_tracked` stacks or gathers them out of the layers'
            # buffers) and its lead state a pool row: nothing a replay rewrites, so not copied (a copy per row
            # and factor is a launch each on a GPU)
            list(self.tracked), self.gdn_traffic,
            [(seg, conv.clone(), ssm.clone()) for seg, conv, ssm in self.checkpoints], own(self.hidden))
