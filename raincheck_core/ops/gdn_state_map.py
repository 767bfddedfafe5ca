"""The affine state map of a GDN token run, for joining deferred prefill (docs/mechanism.md §5).

With transformers' state layout `S [H, Dk, Dv]`, token t acts from the LEFT:
`S ← A_t S + B_t`, `A_t = e^{g_t} (I − β_t k_t k_tᵀ)` (`[Dk, Dk]`, symmetric). A run of tokens is
`S ↦ P S + Q` with `P = A_n ⋯ A_1`; `Q` cancels in the join and is never needed. When the state the
run started from changes by `Δ`, the state after the run changes by exactly `P Δ`.

Orientation matters and fails silently: because Dk = Dv in Qwen3.5, `Δ P` or `Pᵀ Δ` have valid shapes
but are wrong (27–53 % and 7–19 % error at the 9B layer shape, docs/mechanism.md §5.6–5.7). Keep `P` in
fp32: rounding it to bf16 per token gives O(1) error after ~1000 tokens. All functions return new tensors
and modify nothing, except `extend_map_` and `extend_map_torch_`, which update their map in place (torch's
trailing underscore).

Two ways to extend a map in place, each a backend's fold (ops/backend.py `GDNOps.fold`): `extend_map_`,
the native backend's, takes the native kernel where it applies (ops/gdn_kernel.py `fold_maps_`) and the
torch ops elsewhere; `extend_map_torch_`, every other backend's, the torch ops alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import gdn_kernel


def identity_map(num_heads: int, dk: int, device: torch.device | str | None = None) -> Tensor:
    """The map of an empty run: `[H, Dk, Dk]` fp32 identity matrices."""
    return torch.eye(dk, dtype=torch.float32, device=device).repeat(num_heads, 1, 1)


def extend_map(P: Tensor, k: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """Append T tokens to the run: P ← A_t P for t in order.

    P `[..., Dk, Dk]` (any number of maps: heads, layers, sessions), k `[T, ..., Dk]` (L2-normalised,
    as fed to the delta rule), g `[T, ...]`, beta `[T, ...]`. Tokens are applied in blocks (`extend_map_`).
    """
    return extend_map_(P.to(dtype=torch.float32, copy=True), k, g, beta)


BLOCK = 64      # tokens per block of `extend_map_torch_`: the triangular system stays small and well conditioned


def extend_map_(P: Tensor, k: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """`extend_map` in place, for a contiguous fp32 `P` (a session's running P_rest: no copy): on the CPU
    token by token, each map in L1, in one native call; elsewhere (or without the kernel)
    `extend_map_torch_`."""
    k, g, beta = _token_major(P, k, g, beta)
    if gdn_kernel.fold_maps_(P, k, g, beta):
        return P
    return extend_map_torch_(P, k, g, beta)


def extend_map_torch_(P: Tensor, k: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """`extend_map_` by torch ops alone.

    A block of n tokens in one product, the WY form the chunked delta rule uses: the scalar decays
    commute, so `A_n ⋯ A_1 = e^{Σg} (I − β_n k_n k_nᵀ) ⋯ (I − β_1 k_1 k_1ᵀ) = e^{Σg} (I − Kᵀ W)` with the
    rows of W from the unit lower-triangular system `(I + diag(β) tril(K Kᵀ, −1)) W = diag(β) K`.
    Then `P ← e^{Σg} (P − Kᵀ (W P))`: O(n Dk² + n² Dk) per map in a few batched calls, instead of n
    rank-1 updates of three calls each.
    """
    dk = P.shape[-1]
    flat = P.view(-1, dk, dk)
    k, g, beta = _token_major(P, k, g, beta)
    if k.shape[0] == 1:     # one token (a join read right after a decode step): the rank-1 form, no system
        kt = k[0].unsqueeze(1)                                           # [M, 1, Dk]
        flat.baddbmm_(kt.mT * -beta[0][:, None, None], kt @ flat).mul_(g[0].exp()[:, None, None])
        return P
    for start in range(0, k.shape[0], BLOCK):
        kb = k[start:start + BLOCK].transpose(0, 1)                   # [M, n, Dk]
        bb = beta[start:start + BLOCK].transpose(0, 1).unsqueeze(-1)  # [M, n, 1]
        a = torch.tril(kb @ kb.mT, diagonal=-1).mul_(bb)
        w = torch.linalg.solve_triangular(a, bb * kb, upper=False, unitriangular=True)
        flat.baddbmm_(kb.mT, w @ flat, alpha=-1.0).mul_(g[start:start + BLOCK].sum(0).exp()[:, None, None])
    return P


def _token_major(P: Tensor, k: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """k `[T, M, Dk]`, g and beta `[T, M]` (fp32) for the M maps of `P [..., Dk, Dk]`."""
    dk = P.shape[-1]
    m = P.view(-1, dk, dk).shape[0]
    return k.float().reshape(-1, m, dk), g.float().reshape(-1, m), beta.float().reshape(-1, m)


def join_state(S_live: Tensor, P: Tensor, delta: Tensor) -> Tensor:
    """The live state after the run's starting state changed by `delta`: `S_live + P @ delta` per map.

    S_live, delta `[..., Dk, Dv]`, P `[..., Dk, Dk]`, all fp32 (keep TF32 off for this product on GPUs).
    """
    dk, dv = delta.shape[-2], delta.shape[-1]
    return torch.baddbmm(S_live.reshape(-1, dk, dv), P.reshape(-1, dk, dk), delta.reshape(-1, dk, dv)
                         ).view(S_live.shape)
