"""SwiGLU feed-forward block; with a rank group, gate/up column-parallel and down row-parallel over a
block of the intermediate width."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.group import RankGroup
from .linear import Linear, MergedLinear
from .parallel import RowParallelLinear


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int, tp: RankGroup | None = None, reduce: bool = True):
        super().__init__()
        if tp is None:
            self.gate_up_proj = MergedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate})
            self.down_proj = Linear(intermediate, hidden, bias=False)
            return
        width = tp.shard.even(intermediate, "the MLP's intermediate size")
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate},
                                         select={"gate_proj": [width], "up_proj": [width]})
        self.down_proj = RowParallelLinear(intermediate, hidden, width, tp, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate) * up)
