"""The affine state map of a GDN token run, for joining deferred prefill (MECHANISM.md §5).

With transformers' state layout `S [H, Dk, Dv]`, token t acts from the LEFT:
`S ← A_t S + B_t`, `A_t = e^{g_t} (I − β_t k_t k_tᵀ)` (`[Dk, Dk]`, symmetric). A run of tokens is
`S ↦ P S + Q` with `P = A_n ⋯ A_1`; `Q` cancels in the join and is never needed. When the state the
run started from changes by `Δ`, the state after the run changes by exactly `P Δ`.

Orientation matters and fails silently: because Dk = Dv in Qwen3.5, `Δ P` or `Pᵀ Δ` have valid shapes
but are wrong (14–53 % error, research/gdn_state_join.md §7.1). Keep `P` in fp32: rounding it to bf16
per token gives O(1) error after ~1000 tokens. All functions return new tensors and modify nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor


def identity_map(num_heads: int, dk: int, device: torch.device | str | None = None) -> Tensor:
    """The map of an empty run: `[H, Dk, Dk]` fp32 identity matrices."""
    return torch.eye(dk, dtype=torch.float32, device=device).repeat(num_heads, 1, 1)


def extend_map(P: Tensor, k: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """Append T tokens to the run: P ← A_t P for t in order.

    k `[T, H, Dk]` (L2-normalised, as fed to the delta rule), g `[T, H]`, beta `[T, H]`.
    Each step is the rank-1 update `P ← e^{g_t} (P − β_t k_t (k_tᵀ P))`, O(Dk²) per head, rather
    than a product with a built A_t, which is O(Dk³).
    """
    k, g, beta = k.float(), g.float(), beta.float()
    P = P.to(dtype=torch.float32, copy=True)  # updated in place below
    alpha = g.exp()
    k_beta = k * beta.unsqueeze(-1)
    for t in range(k.shape[0]):
        kP = torch.bmm(k[t].unsqueeze(1), P)  # k_tᵀ P as [H, 1, Dk]
        P.baddbmm_(k_beta[t].unsqueeze(2), kP, alpha=-1.0).mul_(alpha[t, :, None, None])
    return P


def join_state(S_live: Tensor, P: Tensor, delta: Tensor) -> Tensor:
    """The live state after the run's starting state changed by `delta`: `S_live + P @ delta` per head.

    S_live, delta `[H, Dk, Dv]`, P `[H, Dk, Dk]`, all fp32 (keep TF32 off for this product on GPUs).
    """
    return torch.baddbmm(S_live, P, delta)
