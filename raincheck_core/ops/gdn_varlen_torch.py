"""The torch path of the packed GDN ops (ops/gdn_varlen.py), for devices and dtypes the native kernel
does not cover: the short convolution as K gathered multiply-adds over all rows, the chunked delta rule
scanning over block *steps*, and, for one-row sequences, one batched recurrent step. Same arithmetic
as the one-sequence references in ops/gdn.py; layouts from `VarlenLayout` (ops/gdn_layout.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .gdn_layout import VarlenLayout


def causal_conv1d_varlen(x: Tensor, weight: Tensor, history: Tensor, layout: VarlenLayout
                         ) -> tuple[Tensor, Tensor, Tensor | None]:
    """Depthwise causal convolution of packed rows `x [R, C]` (weight `[C, K]`), each sequence after its
    own `history [N, K-1, C]`. Returns (out `[R, C]` in x's dtype, the histories after each sequence
    `[N, K-1, C]`, the histories at the splits `[J, K-1, C]` or None).

    The K multiply-adds accumulate in fp32 in tap order, as F.conv1d does (transformers casts to the
    weight dtype first and back after)."""
    lead, conv = layout.kernel - 1, layout.conv
    ext = x.new_empty(conv.ext_rows, x.shape[1])
    ext[conv.hist_at] = history.reshape(-1, x.shape[1]).to(x.dtype)
    ext[conv.row_at] = x
    tails = ext[conv.tail_at]
    split_tails = ext[conv.split_tail_at] if conv.split_tail_at is not None else None
    full32 = ext.to(weight.dtype).float()
    w32 = weight.t().float()
    base = conv.row_at - lead
    acc = full32[base] * w32[0]
    for j in range(1, layout.kernel):
        acc.addcmul_(full32[base + j], w32[j])
    return acc.to(weight.dtype).to(x.dtype), tails, split_tails


def chunk_gated_delta_rule_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                                  layout: VarlenLayout) -> tuple[Tensor, Tensor, Tensor | None]:
    """The chunked gated delta rule over packed rows (q, k `[R, H, Dk]` prepared, v `[R, H, Dv]`, g, beta
    `[R, H]`) from per-sequence states `[N, H, Dk, Dv]`. Returns (o `[R, H, Dv]` fp32, final states
    `[N, H, Dk, Dv]`, states at the splits `[J, H, Dk, Dv]` or None). Inputs are not modified."""
    blocks_of = layout.blocks
    C, B = blocks_of.chunk, blocks_of.num_blocks
    num_heads, dk, dv = k.shape[1], k.shape[2], v.shape[2]

    def blocked(x: Tensor) -> Tensor:
        """[R, H, ...] -> [B, H, C, ...], zero where no row (padding: no write, no decay)."""
        out = x.new_zeros(B * C, *x.shape[1:], dtype=torch.float32)
        out[blocks_of.row_slot] = x.float()
        return out.view(B, C, *x.shape[1:]).transpose(1, 2)

    qb, kb, vb, gb, bb = (blocked(t) for t in (q, k, v, g, beta))
    cum = gb.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill_(~causal, float("-inf")).exp_()
    k_beta = kb * bb.unsqueeze(-1)
    # UT transform (see ops/gdn.py chunk_gated_delta_rule): u = values written on a zero state, w turns
    # the incoming state into their correction.
    system = (k_beta @ kb.mT).mul_(decay)
    rhs = torch.cat([vb * bb.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    u, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([dv, dk], dim=-1)
    intra = (qb @ kb.mT).mul_(decay)
    readers = torch.cat([w, qb * cum.exp().unsqueeze(-1)], dim=-2)         # [B, H, 2C, Dk]
    last = cum[..., -1:]
    k_to_end = (kb * (last - cum).exp().unsqueeze(-1)).mT                  # [B, H, Dk, C]
    chunk_decay = last.exp().unsqueeze(-1)                                 # [B, H, 1, 1]

    S = state.to(device=q.device, dtype=torch.float32, copy=True)
    o = torch.empty(B, num_heads, C, dv, dtype=torch.float32, device=q.device)
    split_states = None
    if any(len(idx) for _, idx in blocks_of.captures):
        split_states = S.new_empty(sum(len(idx) for _, idx in blocks_of.captures), num_heads, dk, dv)
    for (blocks, seqs, in_order), (cap_pos, cap_idx) in zip(blocks_of.steps, blocks_of.captures, strict=True):
        nb = blocks.stop - blocks.start
        s_in = S if in_order else S[seqs]
        read = readers[blocks] @ s_in
        v_new = u[blocks] - read[:, :, :C]
        o[blocks] = torch.baddbmm(read[:, :, C:].flatten(0, 1), intra[blocks].flatten(0, 1),
                                  v_new.flatten(0, 1)).view(nb, num_heads, C, dv)
        s_out = torch.baddbmm((s_in * chunk_decay[blocks]).flatten(0, 1), k_to_end[blocks].flatten(0, 1),
                              v_new.flatten(0, 1)).view(nb, num_heads, dk, dv)
        if in_order:
            S = s_out
        else:
            S[seqs] = s_out
        if len(cap_idx):
            split_states[cap_idx] = s_out[cap_pos]
    out = o.transpose(1, 2).reshape(B * C, num_heads, dv)[blocks_of.row_slot]
    return out, S, split_states


def gated_delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One token for each of N sequences from `state [N, H, Dk, Dv]` (fp32, contiguous), which it updates
    IN PLACE: q, k `[N, H, Dk]` (prepared), v `[N, H, Dv]`, g, beta `[N, H]`. Returns (o `[N, H, Dv]` fp32,
    the new states: `state` itself; another backend's step may return a tensor of its own instead).
    (The callers pass states gathered from the pool, which are private copies.)"""
    n, h, dk = k.shape
    dv = v.shape[-1]
    S = state.view(n * h, dk, dv)
    S.mul_(g.float().exp().view(n * h, 1, 1))                             # decay first
    kf = k.float().reshape(n * h, 1, dk)
    read = torch.bmm(kf, S)                                                # Sᵀk as [NH, 1, Dv]
    delta = (v.float().reshape(n * h, 1, dv) - read).mul_(beta.float().reshape(n * h, 1, 1))
    S.addcmul_(kf.mT, delta)                                               # rank-1 write k ⊗ delta
    return torch.bmm(q.float().reshape(n * h, 1, dk), S).view(n, h, dv), state


def conv_step(x: Tensor, weight: Tensor, history: Tensor) -> tuple[Tensor, Tensor]:
    """The short convolution for one new row of each of N sequences: x `[N, C]`, history `[N, K-1, C]`.
    Returns (out `[N, C]`, new histories `[N, K-1, C]`); same arithmetic as `causal_conv1d_varlen`."""
    full = torch.cat([history.to(x.dtype), x[:, None]], dim=1)            # [N, K, C]
    full32, w32 = full.to(weight.dtype).float(), weight.t().float()
    acc = full32[:, 0] * w32[0]
    for j in range(1, weight.shape[1]):
        acc.addcmul_(full32[:, j], w32[j])
    return acc.to(weight.dtype).to(x.dtype), full[:, 1:]
