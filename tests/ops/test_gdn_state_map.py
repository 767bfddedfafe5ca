"""The GDN affine state map: the join must equal rerunning the suffix from the changed state."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from raincheck_core.ops import gdn_kernel, native
from raincheck_core.ops.gdn import l2norm, recurrent_gated_delta_rule
from raincheck_core.ops.gdn_state_map import extend_map, identity_map, join_state

# Dk = Dv as in Qwen3.5, so a wrongly oriented join still has valid shapes and only the values expose it.
H, D = 4, 32


@pytest.fixture(autouse=True, params=["native", "torch"])
def fold_path(request, monkeypatch):
    """Every test on both ways of extending a map: the native fold (token by token, csrc) and the torch
    ops (the rank-1 form, or blocks in the WY form)."""
    if request.param == "torch":
        monkeypatch.setattr(gdn_kernel, "fold_maps_", lambda *a: False)
    elif not native.gated_deltanet_available("cpu", torch.float32):
        pytest.skip("the native kernel cannot be built here (no C compiler)")
    return request.param


def _suffix(n: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Random delta-rule inputs for n tokens: q, k (normalised), v, g ≤ 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(n, H, D, generator=gen)) * D**-0.5
    k = l2norm(torch.randn(n, H, D, generator=gen))
    v = torch.randn(n, H, D, generator=gen)
    # Slow decays keep P large enough over 64 tokens for the orientation check to be meaningful.
    g = -0.05 * torch.rand(n, H, generator=gen)
    beta = torch.rand(n, H, generator=gen)
    return q, k, v, g, beta


def _states(seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(H, D, D, generator=gen), torch.randn(H, D, D, generator=gen)


def _rel(a: Tensor, b: Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _runs(n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(S after the suffix from S0, S after it from S0 + Δ, Δ, P of the suffix)."""
    q, k, v, g, beta = _suffix(n, seed=n)
    s0, delta = _states(seed=100 + n)
    _, s_live = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    _, s_rerun = recurrent_gated_delta_rule(q, k, v, g, beta, s0 + delta)
    p = extend_map(identity_map(H, D), k, g, beta)
    return s_live, s_rerun, delta, p


@pytest.mark.parametrize("n", [1, 7, 33, 64])
def test_join_equals_rerun(n: int) -> None:
    s_live, s_rerun, delta, p = _runs(n)
    # The correction must be a sizeable part of the state, or matching it would prove little.
    assert _rel(s_live, s_rerun) > 0.1
    assert _rel(join_state(s_live, p, delta), s_rerun) <= 1e-5


@pytest.mark.parametrize("n", [7, 33, 64])
def test_transposed_join_fails(n: int) -> None:
    """Both wrong orientations (Δ P and Pᵀ Δ) must fail the check above, so the check can fail."""
    s_live, s_rerun, delta, p = _runs(n)
    assert _rel(s_live + delta @ p, s_rerun) > 1e-2
    assert _rel(s_live + p.mT @ delta, s_rerun) > 1e-2


def test_extend_in_two_pieces_equals_one() -> None:
    _, k, _, g, beta = _suffix(50, seed=7)
    whole = extend_map(identity_map(H, D), k, g, beta)
    pieces = extend_map(extend_map(identity_map(H, D), k[:19], g[:19], beta[:19]), k[19:], g[19:], beta[19:])
    assert (pieces - whole).abs().max().item() <= 1e-6


def test_extend_token_by_token_equals_one_call() -> None:
    """One token at a time takes the rank-1 form (a join read after each decode step), on a map that is
    not the identity."""
    _, k, _, g, beta = _suffix(12, seed=11)
    whole = extend_map(identity_map(H, D), k, g, beta)
    p = identity_map(H, D)
    for t in range(k.shape[0]):
        p = extend_map(p, k[t:t + 1], g[t:t + 1], beta[t:t + 1])
    assert (p - whole).abs().max().item() <= 1e-6


@pytest.mark.parametrize("n", [1, 9, 150])
def test_extend_is_left_product_of_token_maps(n: int) -> None:
    """P = A_n ⋯ A_1 with A_t = e^{g_t}(I − β_t k_t k_tᵀ), built explicitly in fp64 (150 tokens: across
    the blocks the extension is computed in)."""
    _, k, _, g, beta = _suffix(n, seed=9)
    eye = torch.eye(D, dtype=torch.float64)
    expected = eye.repeat(H, 1, 1)
    for t in range(k.shape[0]):
        kt, bt = k[t].double(), beta[t].double()[:, None, None]
        a = g[t].double().exp()[:, None, None] * (eye - bt * kt[:, :, None] * kt[:, None, :])
        expected = a @ expected
    p = extend_map(identity_map(H, D), k, g, beta)
    assert p.dtype == torch.float32
    assert (p.double() - expected).abs().max().item() <= 1e-6


def test_inputs_not_modified_and_empty_extension() -> None:
    _, k, _, g, beta = _suffix(5, seed=3)
    p0 = identity_map(H, D)
    p0_copy = p0.clone()
    extend_map(p0, k, g, beta)
    assert torch.equal(p0, p0_copy)
    assert torch.equal(extend_map(p0, k[:0], g[:0], beta[:0]), p0)
    s_live, _, delta, p = _runs(3)
    s_copy = s_live.clone()
    join_state(s_live, p, delta)
    assert torch.equal(s_live, s_copy)
