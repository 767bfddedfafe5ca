"""Gated DeltaNet (GDN) kernels as pure tensor functions.

They reproduce the torch fallbacks of transformers 5.23.0 (`Qwen3_5GatedDeltaNet`): the depthwise
causal convolution over the pre-conv `[q | k | v]` channels, the L2 norm, and the gated delta rule in
its per-token and chunked (WY/UT transform) forms. The engine runs the packed (varlen) forms in
`ops/gdn_varlen.py`, many sequences per call; the one-sequence forms here are their slow references
and the building blocks of the state-map tests, and they run a sequence's recorded rows again outside
the forward (`replay`: the torch ops' `GDNOps.replay`, ops/backend.py).

State layout is transformers': `S` is `[H, Dk, Dv]` fp32 (key index first), and a token acts as
`S ← e^g S;  S ← S + k ⊗ (β (v − Sᵀk));  o = Sᵀq`.

CPU note: strong decays make the chunked form produce subnormal floats, which x86 CPUs process tens of
times slower (measured: 20 ms → 0.2–1.4 s for one 1024-token call, transformers alike). Calling
`torch.set_flush_denormal(True)` at process start, before the first multi-threaded op so that the
intra-op threads inherit it, removes this; it only drops magnitudes below 1.2e-38.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# Below this many new rows F.conv1d's fixed cost (~150 µs for 8192 channels on CPU) dominates;
# K fused multiply-adds are several times cheaper and give the same bits (see causal_conv1d).
_CONV_FMA_MAX_ROWS = 16


def causal_conv1d(x: Tensor, weight: Tensor, history: Tensor | None) -> tuple[Tensor, Tensor]:
    """Depthwise causal convolution without bias or activation.

    x `[T, C]`, weight `[C, K]`, history `[K-1, C]` (the pre-conv inputs just before x; None = zeros).
    With full = cat(history, x): out[t, c] = Σ_j weight[c, j] · full[t + j, c].
    Returns (out `[T, C]` in x's dtype, new history `[K-1, C]` = the last K-1 rows of full).
    """
    num_rows, channels = x.shape
    kernel = weight.shape[1]
    if history is None:
        history = x.new_zeros(kernel - 1, channels)
    full = torch.cat([history.to(x.dtype), x])
    new_history = full[num_rows:].clone()  # a copy, so the caller does not pin all of `full`
    # transformers casts the inputs to the weight dtype and convolves in it, then casts back.
    full = full.to(weight.dtype)
    if num_rows <= _CONV_FMA_MAX_ROWS:
        # F.conv1d accumulates in fp32 with one FMA per tap in tap order (also for bf16); the same
        # addcmul chain reproduces it bit for bit on CPU.
        full32, weight32 = full.float(), weight.t().float()
        acc = full32[:num_rows] * weight32[0]
        for j in range(1, kernel):
            acc.addcmul_(full32[j : j + num_rows], weight32[j])
        out = acc.to(weight.dtype)
    else:
        out = F.conv1d(full.t().unsqueeze(0), weight.unsqueeze(1), groups=channels)[0].t()
    return out.to(x.dtype), new_history


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """L2-normalise the last dimension as transformers/FLA do: eps inside the rsqrt."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def split_qkv(conv: Tensor, key_heads: int, dk: int, value_heads: int, dv: int) -> tuple[Tensor, Tensor, Tensor]:
    """A Gated DeltaNet layer's q, k, v (fp32, prepared for the delta rule) from its conv outputs
    `[T, 2·key_heads·dk + value_heads·dv]`: SiLU, then q and k L2-normalised per key head, q scaled by
    dk^-1/2, both expanded to the value heads (value head j reads key head j // (value_heads / key_heads))."""
    c = F.silu(conv)
    q, k, v = torch.split(c, [key_heads * dk, key_heads * dk, value_heads * dv], dim=-1)
    t, rep = c.shape[0], value_heads // key_heads
    q = l2norm(q.reshape(t, key_heads, dk).float()) * dk**-0.5
    k = l2norm(k.reshape(t, key_heads, dk).float())
    return q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1), v.reshape(t, value_heads, dv).float()


def _initial_state(state: Tensor | None, k: Tensor, v: Tensor) -> Tensor:
    """A private fp32 copy of the state (zeros when None), safe to update in place."""
    if state is None:
        return k.new_zeros(k.shape[1], k.shape[2], v.shape[2], dtype=torch.float32)
    return state.to(device=k.device, dtype=torch.float32, copy=True)


def recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Gated delta rule token by token.

    q `[T, H, Dk]` (L2-normalised, scaled by Dk^-0.5), k `[T, H, Dk]` (L2-normalised), v `[T, H, Dv]`,
    g `[T, H]` (log decay ≤ 0), beta `[T, H]`; state `[H, Dk, Dv]` or None (zeros).
    Returns (o `[T, H, Dv]` fp32, final state `[H, Dk, Dv]` fp32). The input state is not modified.
    """
    # transformers upcasts everything (beta arrives in model dtype) before the recurrence.
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = _initial_state(state, k, v)
    alpha = g.exp()
    o = v.new_empty(v.shape)
    for t in range(q.shape[0]):
        S.mul_(alpha[t, :, None, None])  # decay first: the delta rule reads the decayed state
        read = torch.bmm(k[t].unsqueeze(1), S)  # Sᵀk as [H, 1, Dv]
        delta = (v[t].unsqueeze(1) - read) * beta[t, :, None, None]
        S.baddbmm_(k[t].unsqueeze(2), delta)  # rank-1 write k ⊗ delta
        o[t] = torch.bmm(q[t].unsqueeze(1), S).squeeze(1)
    return o, S


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None, chunk_size: int = 64
) -> tuple[Tensor, Tensor]:
    """Gated delta rule in chunks (WY/UT transform), same inputs and results as the recurrent form.

    Within a chunk everything is batched matmuls over heads and chunks; only the scan that carries
    the state from chunk to chunk is a Python loop. The input state is not modified.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = _initial_state(state, k, v)
    num_tokens, num_heads, dk = k.shape
    dv = v.shape[2]
    if num_tokens == 0:
        return v.new_empty(0, num_heads, dv), S
    # A chunk longer than the sequence would only add padding.
    chunk_size = min(chunk_size, num_tokens)
    pad = -num_tokens % chunk_size
    num_chunks = (num_tokens + pad) // chunk_size

    # Padded rows have k = v = beta = 0 and g = 0 (no decay), so they neither write nor decay the state.
    def chunked(x: Tensor) -> Tensor:
        """[T, H, ...] -> [H, N, chunk, ...], zero-padded at the end."""
        x = x.movedim(0, 1)
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(num_heads, num_chunks, chunk_size, *x.shape[2:])

    q, k, v, g, beta = (chunked(t) for t in (q, k, v, g, beta))
    cum = g.cumsum(-1)  # log of the decay from the chunk start to each position
    # decay[i, j] = exp(cum_i - cum_j) for j <= i, else 0 (masked before exp: cum_i - cum_j > 0 there).
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill_(~causal, float("-inf")).exp_()
    k_beta = k * beta.unsqueeze(-1)

    # UT transform: with L = strict lower part of (β k kᵀ ⊙ decay), solve (I + L) [u | w] = [β v | β k e^cum].
    # u are the chunk's values as written on a zero state, w turns the incoming state into their correction.
    system = (k_beta @ k.mT).mul_(decay)
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split([dv, dk], dim=-1)

    intra = (q @ k.mT).mul_(decay)  # within-chunk attention, causal incl. the diagonal
    # One matmul per chunk reads the incoming state for both the correction (w) and the output (q e^cum).
    readers = torch.cat([w, q * cum.exp().unsqueeze(-1)], dim=-2)
    last = cum[..., -1:]
    k_to_end = (k * (last - cum).exp().unsqueeze(-1)).mT  # keys decayed to the chunk end
    chunk_decay = last.exp().unsqueeze(-1)  # [H, N, 1, 1]

    o = torch.empty(num_heads, num_chunks, chunk_size, dv, dtype=torch.float32, device=q.device)
    for n in range(num_chunks):
        read = torch.bmm(readers[:, n], S)
        v_new = u[:, n] - read[:, :chunk_size]  # delta-rule values given the incoming state
        o[:, n] = torch.baddbmm(read[:, chunk_size:], intra[:, n], v_new)
        S = torch.baddbmm(S * chunk_decay[:, n], k_to_end[:, n], v_new)
    o = o.reshape(num_heads, -1, dv)[:, :num_tokens].movedim(0, 1).contiguous()
    return o, S


@dataclass
class Replayed:
    """One sequence's recorded rows run again (`replay`)."""

    history: Tensor             # [K-1, C] the conv history after every row
    k: Tensor                   # [T, key heads, Dk] as the delta rule read them, per key head
    v: Tensor                   # [T, H, Dv]
    states: Tensor | None       # [n, H, Dk, Dv] the state after each of the first n rows (None: n = 0)


def replay(u: Tensor, g: Tensor, beta: Tensor, conv_weight: Tensor, history: Tensor, state: Tensor, key_heads: int,
           rows: int) -> Replayed:
    """A sequence's recorded rows (pre-conv inputs `u [T, C]`, gates `g, beta [T, H]`) run again outside
    the forward, from the conv `history [K-1, C]` and `state [H, Dk, Dv]` given (conv weight `[C, K]`,
    `key_heads` key heads): the delta rule over the first `rows` rows only, as the rest need only their k
    and v. The hand-off's lead re-run (engine/runner.py) and a follow-up's input factors
    (deferral/suffix.py). Nothing is modified."""
    heads, dk, dv = state.shape
    conv, new_history = causal_conv1d(u, conv_weight, history)
    q, k, v = split_qkv(conv, key_heads, dk, heads, dv)
    after = []
    for j in range(rows):
        _, state = recurrent_gated_delta_rule(q[j:j + 1], k[j:j + 1], v[j:j + 1], g[j:j + 1], beta[j:j + 1], state)
        after.append(state)
    # split_qkv repeated k per value head
    return Replayed(new_history, k[:, ::heads // key_heads], v, torch.stack(after) if after else None)
