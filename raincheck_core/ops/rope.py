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
    """cos/sin `[R, rotary_dim]` for 3-D positions `[3, R]`, computed in fp32 and cast to `dtype`."""
    pos = positions.to(inv_freq.device).float()[axes]          # [rd/2, R]: each frequency's own axis
    angle = (pos * inv_freq[:, None]).transpose(0, 1)          # [R, rd/2]
    emb = torch.cat((angle, angle), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of each head of `x [R, heads, head_dim]`; the rest pass through."""
    rd = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
