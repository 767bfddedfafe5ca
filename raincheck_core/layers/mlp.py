"""SwiGLU feed-forward block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear, MergedLinear


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate})
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate) * up)
