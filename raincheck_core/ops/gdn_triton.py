"""A decode row's short convolution and gated delta rule on the GDN state pool's rows in place, as
Triton kernels of this project's own: decode rows on a GPU (the `fla` backend) read each conv history
and state from its slot's current row and write the new ones into the slot's other row by index
(cache/gdn_state.py), so a decode step moves each state once in and once out. fla 0.6's recurrent kernel
takes states in sequence order and returns new ones (a gather before it and a copy back after); vLLM's
and SGLang's forks of it, and their causal-conv update, take state indices, as these do (`POOLED`, the
kernels ops/gdn_varlen.py `gated_deltanet_rows` takes).

Imported only where triton is (ops/backend.py `fla_gdn`); `make test-kernels` runs it on the CPU under
`TRITON_INTERPRET=1` against the torch step (tests/kernels).

The convolution, per sequence n and channel c, with the history `[K-1, C]` in row `read[n]` of
`conv_pool [rows, K-1, C]` and weight `[C, K]`: taps oldest first, in fp32, as ops/gdn_varlen_torch.py
`conv_step` accumulates them; the history shifted by the new row goes to row `write[n]`.
The delta rule, per sequence n and value head h, with S the `[Dk, Dv]` state in row `read[n]` of `ssm_pool [rows, H, Dk,
Dv]` (fp32), q, k `[N, H, Dk]` (prepared: normalised, q scaled, expanded to the value heads), v `[N, H,
Dv]` (any float dtype; the kernel computes in fp32), g (log space), beta `[N, H]`:
    S <- e^g S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q;   row write[n] <- S.
Each program takes one value-column block of one head of one sequence: its columns of S are independent
of the others', so the block is read once, updated in registers and written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .gdn_varlen import PooledKernels


@triton.jit
def _conv_step_pooled(u, ld_u, w, x, pool, read, write, row_stride, C: tl.constexpr, K: tl.constexpr,
                      BC: tl.constexpr):
    n = tl.program_id(0)
    cs = tl.program_id(1) * BC + tl.arange(0, BC)
    ok = cs < C
    src = tl.load(read + n).to(tl.int64)
    dst = tl.load(write + n).to(tl.int64)
    acc = tl.zeros([BC], dtype=tl.float32)
    for j in tl.static_range(K - 1):    # history rows, oldest first; each read before its slot is rewritten
        row = tl.load(pool + src * row_stride + j * C + cs, mask=ok, other=0.0)
        acc += row.to(tl.float32) * tl.load(w + cs * K + j, mask=ok, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(pool + dst * row_stride + (j - 1) * C + cs, row, mask=ok)
    new = tl.load(u + n * ld_u + cs, mask=ok, other=0.0)
    acc += new.to(tl.float32) * tl.load(w + cs * K + K - 1, mask=ok, other=0.0).to(tl.float32)
    tl.store(pool + dst * row_stride + (K - 2) * C + cs, new, mask=ok)
    tl.store(x + n * C + cs, acc, mask=ok)


def conv_step_pooled(u: Tensor, weight: Tensor, conv_pool: Tensor, read: Tensor, write: Tensor) -> Tensor:
    """The short convolution of one new row `u [N, C]` per sequence (weight `[C, K]`) over the histories in
    pool rows `read [N]` of `conv_pool [rows, K-1, C]`, the shifted histories written into rows `write
    [N]` in place (a row may be both: it is read before it is written); returns `[N, C]` in u's dtype,
    rounded as ops/gdn_varlen_torch.py `conv_step` rounds."""
    n, channels = u.shape
    kernel = weight.shape[1]
    if conv_pool.shape[1:] != (kernel - 1, channels) or not conv_pool[0].is_contiguous() or u.stride(-1) != 1 \
            or kernel < 2:
        raise ValueError("conv_step_pooled: pool rows [rows, K-1, C], each contiguous, for rows u [N, C]")
    x = torch.empty(n, channels, dtype=torch.float32, device=u.device)
    if n:
        bc = min(256, triton.next_power_of_2(channels))
        _conv_step_pooled[(n, triton.cdiv(channels, bc))](u, u.stride(0), weight.contiguous(), x, conv_pool, read,
                                                          write, conv_pool.stride(0), C=channels, K=kernel, BC=bc)
    return x.to(weight.dtype).to(u.dtype)


@triton.jit
def _delta_step_pooled(q, k, v, g, beta, o, pool, read, write, row_stride, H: tl.constexpr, DK: tl.constexpr,
                       DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    head = tl.program_id(0)             # sequence * H + value head
    block = tl.program_id(1)            # value-column block
    n = head // H
    h = head % H
    ks = tl.arange(0, BK)
    vs = block * BV + tl.arange(0, BV)
    k_ok = ks < DK
    v_ok = vs < DV
    at = h * DK * DV + ks[:, None] * DV + vs[None, :]
    mask = k_ok[:, None] & v_ok[None, :]
    src = tl.load(read + n).to(tl.int64)
    dst = tl.load(write + n).to(tl.int64)
    state = tl.load(pool + src * row_stride + at, mask=mask, other=0.0)
    qn = tl.load(q + head * DK + ks, mask=k_ok, other=0.0).to(tl.float32)
    kn = tl.load(k + head * DK + ks, mask=k_ok, other=0.0).to(tl.float32)
    vn = tl.load(v + head * DV + vs, mask=v_ok, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g + head).to(tl.float32))
    strength = tl.load(beta + head).to(tl.float32)
    state = state * decay
    delta = strength * (vn - tl.sum(state * kn[:, None], axis=0))
    state = state + kn[:, None] * delta[None, :]
    tl.store(o + head * DV + vs, tl.sum(state * qn[:, None], axis=0), mask=v_ok)
    tl.store(pool + dst * row_stride + at, state, mask=mask)


def delta_step_pooled(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_pool: Tensor, read: Tensor,
                      write: Tensor) -> Tensor:
    """One token for each of N sequences from pool rows `read [N]` into pool rows `write [N]` of `ssm_pool
    [rows, H, Dk, Dv]` (fp32, each row contiguous: a layer's view of the engine's pool); returns o `[N, H,
    Dv]` fp32. Nothing is gathered or copied: the kernel reads and writes the rows in place."""
    n, heads, dk = k.shape
    dv = v.shape[-1]
    if ssm_pool.dtype != torch.float32 or ssm_pool.shape[1:] != (heads, dk, dv) \
            or not ssm_pool[0].is_contiguous() or read.shape != (n,) or write.shape != (n,):
        raise ValueError("delta_step_pooled: fp32 pool rows [rows, H, Dk, Dv], each contiguous; one read and "
                         "one write row per sequence")
    o = torch.empty(n, heads, dv, dtype=torch.float32, device=v.device)
    if n:
        bv = min(32, triton.next_power_of_2(dv))
        _delta_step_pooled[(n * heads, triton.cdiv(dv, bv))](
            q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(), beta.float().contiguous(), o,
            ssm_pool, read, write, ssm_pool.stride(0), H=heads, DK=dk, DV=dv, BK=triton.next_power_of_2(dk),
            BV=bv)
    return o


POOLED = PooledKernels(conv_step_pooled, delta_step_pooled)
