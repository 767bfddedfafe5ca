"""Rotary position embedding with interleaved 3-D M-RoPE (Qwen3-VL / Qwen3.5).

Frequency i of the rotary half takes its angle from axis H if i % 3 == 1 and i < 3·section[1], from
axis W if i % 3 == 2 and i < 3·section[2], else from axis T (section[0] is never read). For text all
three axes are equal and this is ordinary RoPE. Pairing is "half" style: dims (i, i + rd/2).
"""

from __future__ import annotations

import torch


def inverse_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def mrope_axes(rotary_dim: int, section: tuple[int, int, int]) -> torch.Tensor:
    """Axis (0=T, 1=H, 2=W) that each of the rotary_dim/2 frequencies reads its position from."""
    idx = torch.arange(rotary_dim // 2)
    axes = torch.zeros_like(idx)
    axes[(idx % 3 == 1) & (idx < 3 * section[1])] = 1
    axes[(idx % 3 == 2) & (idx < 3 * section[2])] = 2
    return axes


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, axes: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin `[R, 1, rotary_dim]` for 3-D positions `[3, R]`, computed in fp32 and cast to
    `dtype`, as `apply_rope` reads them: once per step, so that each layer's rotation is four ops.

    The first half of sin is negated: rotate-half's `-x2 · sin` is `x2 · -sin` bit for bit (a sign flip
    is exact), so the rotation needs no negation and no concatenation per layer."""
    pos = positions.to(inv_freq.device).float()[axes]          # [rd/2, R]: each frequency's own axis
    angle = (pos * inv_freq[:, None]).transpose(0, 1)          # [R, rd/2]
    emb = torch.cat((angle, angle), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    sin[:, :angle.shape[1]].neg_()
    return cos[:, None], sin[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of each head of `x [R, heads, head_dim]` by `rope_cos_sin`'s
    cos/sin; the rest pass through. `roll` by half swaps the halves: `(x1, x2) -> (x2, x1)`."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + torch.roll(x, rd // 2, -1) * sin
    rot = x[..., :rd]
    return torch.cat((rot * cos + torch.roll(rot, rd // 2, -1) * sin, x[..., rd:]), dim=-1)
