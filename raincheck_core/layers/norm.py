"""RMSNorm variants, each matching its transformers counterpart's rounding order."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def _to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)` without the call (a dispatch, several per norm) where it would return `x`."""
    return x if x.dtype == dtype else x.to(dtype)


def normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x̂` in fp32 over the last dim, before any weight (a norm's `scale` applies it)."""
    x = _to(x, torch.float32)
    if not x.is_cpu:
        return F.rms_norm(x, (x.shape[-1],), eps=eps)
    # torch's CPU rms_norm is these ops in this order (x² by pow, mean as sum then division), bit for bit,
    # but it wraps its two Python scalars in tensors at every call: prebuilt, a norm costs ~2/3. addcdiv
    # is `eps + 1 · (sum / count)`, the division and the addition each rounded as before (times one is exact)
    count, eps_t = _scalars(x.shape[-1], eps)
    return x * torch.rsqrt(torch.addcdiv(eps_t, (x * x).sum(-1, keepdim=True), count))


@functools.cache
def _scalars(count: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode(False):       # usable outside inference mode too (autograd saves them)
        return torch.tensor(float(count), dtype=torch.float32), torch.tensor(eps, dtype=torch.float32)


class RMSNorm(nn.Module):
    """Qwen3-VL: `w * x̂`, statistic in fp32, the product in the model dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(normalize(x, self.eps), self.weight, x.dtype)

    @staticmethod
    def scale(x_hat: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`normalize`'s fp32 `x̂` times `weight` (broadcast over its leading dims), in `dtype`."""
        return weight * _to(x_hat, dtype)


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
        return _to(x_hat * (1.0 + weight.float()), dtype)


class GatedRMSNorm(nn.Module):
    """GDN output norm: `w * x̂ * silu(z)`, per value head, gate applied in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = RMSNorm.scale(normalize(x, self.eps), self.weight, x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)
