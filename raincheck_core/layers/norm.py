"""RMSNorm variants, each matching its transformers counterpart's rounding order."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x̂` in fp32 over the last dim, before any weight (a norm's `scale` applies it)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps)


class RMSNorm(nn.Module):
    """Qwen3-VL: `w * x̂`, statistic in fp32, the product in the model dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            # in fp32 torch's rms_norm with the weight is `scale(normalize(x))` bit for bit, in one call
            # instead of four ops (not in bf16 or fp16, where it rounds differently)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.scale(normalize(x, self.eps), self.weight, x.dtype)

    @staticmethod
    def scale(x_hat: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`normalize`'s fp32 `x̂` times `weight` (broadcast over its leading dims), in `dtype`."""
        return weight * x_hat.to(dtype)


class OffsetRMSNorm(nn.Module):
    """Qwen3.5: `(1 + w) * x̂` in fp32; checkpoints store `w - 1`, so the weight starts at zero."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(normalize(x, self.eps), self.weight, x.dtype)

    @staticmethod
    def scale(x_hat: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`normalize`'s fp32 `x̂` times `1 + weight` (broadcast over its leading dims), in `dtype`."""
        return (x_hat * (1.0 + weight.float())).to(dtype)


class GatedRMSNorm(nn.Module):
    """GDN output norm: `w * x̂ * silu(z)`, per value head, gate applied in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = RMSNorm.scale(normalize(x, self.eps), self.weight, x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)
