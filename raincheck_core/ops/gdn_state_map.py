"""The affine state map of a GDN token run, for joining deferred prefill (docs/mechanism.md §5).

With transformers' state layout `S [H, Dk, Dv]`, token t acts from the LEFT:
`S ← A_t S + B_t`, `A_t = e^{g_t} (I − β_t k_t k_tᵀ)` (`[Dk, Dk]`, symmetric). A run of tokens is
`S ↦ P S + Q` with `P = A_n ⋯ A_1`; `Q` cancels in the join and is never needed. When the state the
run started from changes by `Δ`, the state after the run changes by exactly `P Δ`.

Orientation matters and fails silently: because Dk = Dv in Qwen3.5, `Δ P` or `Pᵀ Δ` have valid shapes
but are wrong (27–53 % and 7–19 % error at the 9B layer shape, docs/mechanism.md §5.6–5.7). Keep `P` in
fp32: rounding it to bf16 per token gives O(1) error after ~1000 tokens. All functions return new tensors
and modify nothing, except `extend_map_`, which updates its map in place (torch's trailing underscore).
"""

from __future__ import annotations

import torch
from torch import Tensor


def identity_map(num_heads: int, dk: int, device: torch.device | str | None = None) -> Tensor:
    """The map of an empty run: `[H, Dk, Dk]` fp32 identity matrices."""
    return torch.eye(dk, dtype=torch.float32, device=device).repeat(num_heads, 1, 1)


def extend_map(P: Tensor, k: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """Append T tokens to the run: P ← A_t P for t in order.

    P `[..., Dk, Dk]` (any number of maps: heads, layers, sessions), k `[T, ..., Dk]` (L2-normalised,
    as fed to the delta rule), g `[T, ...]`, beta `[T, ...]`. Each step is the rank-1 update
    `P ← e^{g_t} (P − β_t k_t (k_tᵀ P))`, O(Dk²) per map, rather than a product with a built A_t (O(Dk³)).
    """
    return extend_map_(P.to(dtype=torch.float32, copy=True), k, g, beta)


def extend_map_(P: Tensor, k: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """`extend_map` in place, for a contiguous fp32 `P` (a session's running P_rest: no copy per token)."""
    dk = P.shape[-1]
    out = P
    flat = out.view(-1, dk, dk)
    m = flat.shape[0]
    k, g, beta = k.float().reshape(-1, m, dk), g.float().reshape(-1, m), beta.float().reshape(-1, m)
    alpha = g.exp()
    k_beta = k * beta.unsqueeze(-1)
    for t in range(k.shape[0]):
        kP = torch.bmm(k[t].unsqueeze(1), flat)  # k_tᵀ P as [M, 1, Dk]
        flat.baddbmm_(k_beta[t].unsqueeze(2), kP, alpha=-1.0).mul_(alpha[t, :, None, None])
    return out


def join_state(S_live: Tensor, P: Tensor, delta: Tensor) -> Tensor:
    """The live state after the run's starting state changed by `delta`: `S_live + P @ delta` per map.

    S_live, delta `[..., Dk, Dv]`, P `[..., Dk, Dk]`, all fp32 (keep TF32 off for this product on GPUs).
    """
    dk, dv = delta.shape[-2], delta.shape[-1]
    return torch.baddbmm(S_live.reshape(-1, dk, dv), P.reshape(-1, dk, dk), delta.reshape(-1, dk, dv)
                         ).view(S_live.shape)
