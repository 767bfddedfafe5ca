"""RMSNorm variants, each matching its transformers counterpart's rounding order."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps)


class RMSNorm(nn.Module):
    """Qwen3-VL: `w * x̂`, statistic in fp32, the product in the model dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * _normalize(x, self.eps).to(x.dtype)


class OffsetRMSNorm(nn.Module):
    """Qwen3.5: `(1 + w) * x̂` in fp32; checkpoints store `w - 1`, so the weight starts at zero."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """GDN output norm: `w * x̂ * silu(z)`, per value head, gate applied in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = self.weight * _normalize(x, self.eps).to(x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)
