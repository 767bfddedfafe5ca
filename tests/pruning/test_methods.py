"""Method-specific behaviour: reference parity, objectives, fallbacks."""

from __future__ import annotations

import pytest
import torch

from raincheck_core.errors import InvalidInputError
from raincheck_core.pruning import ExplicitSelector, SelectionContext, get_selector, mmtok
from raincheck_core.pruning.base import cosine_matrix
from raincheck_core.pruning.divprune import divprune_order
from raincheck_core.pruning.hiprune import buffers, calibrated_layers, spatial_spread
from raincheck_core.pruning.uniform import strided

from .spans import make_ctx


def _reference_divprune(x: torch.Tensor, keep: int) -> list[int]:
    """The reference loop: recompute min distance to the whole chosen set at every step."""
    u = x / x.norm(dim=1, keepdim=True)
    dist = 1 - u @ u.T
    n = x.shape[0]
    first = max(range(n), key=lambda j: (min(float(dist[i, j]) for i in range(n) if i != j), -j))
    chosen = [first]
    while len(chosen) < keep:
        best, best_gap = None, None
        for j in range(n):
            if j in chosen:
                continue
            gap = min(float(dist[i, j]) for i in chosen)
            if best_gap is None or gap > best_gap:
                best, best_gap = j, gap
        chosen.append(best)
    return chosen


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_divprune_matches_reference_loop(seed: int) -> None:
    x = torch.randn(40, 12, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    for keep in (1, 7, 20, 39):
        assert divprune_order(x, keep).tolist() == _reference_divprune(x, keep)


def test_divprune_duplicates_give_distinct_picks() -> None:
    x = torch.ones(10, 4)  # all identical: the reference could re-pick a token
    x[0] = 0.0  # all-zero row: no NaN
    order = divprune_order(x, 9)
    assert order.unique().numel() == 9


def test_mmtok_greedy_gains_are_objective_increments() -> None:
    ctx = make_ctx(grid=(1, 5, 6))
    c = mmtok.coverage_matrix(ctx.embeddings, ctx.vision_features, ctx.query)
    order, gains = mmtok.greedy_order(c, 20)
    assert (gains >= 0).all()
    objective = [c[:, order[: i + 1]].amax(dim=1).sum() for i in range(len(order))]
    values = torch.stack(objective)
    assert (values[1:] >= values[:-1] - 1e-7).all()  # monotone along the greedy sequence
    torch.testing.assert_close(values, gains.cumsum(0))
    # gains shrink: diminishing returns of a submodular objective under greedy
    assert (gains[1:] <= gains[:-1] + 1e-7).all()


def test_mmtok_without_query_is_pure_vision_coverage() -> None:
    ctx = make_ctx(m=None)
    sel = get_selector("mmtok")
    idx = sel.select(ctx, 9)
    assert "pure vision coverage" in sel.fallback_used
    c = 0.5 * torch.softmax(cosine_matrix(ctx.vision_features, ctx.vision_features) / 0.2, 1) / ctx.n
    assert torch.equal(idx, mmtok.greedy_order(c, 9)[0].sort().values)


def test_query_topk_picks_tokens_aligned_with_query() -> None:
    ctx = make_ctx(grid=(1, 5, 5), m=2)
    targets = [3, 11, 17, 20]
    for i, t in enumerate(targets):  # scaled copies of a query token: cosine 1
        ctx.embeddings[t] = (i + 1) * ctx.query[i % 2]
    sel = get_selector("query_topk")
    assert sel.select(ctx, 4).tolist() == targets
    assert sel.fallback_used is None


def test_query_topk_without_query_falls_back_to_uniform() -> None:
    sel = get_selector("query_topk")
    ctx = make_ctx(m=None)
    assert torch.equal(sel.select(ctx, 5), strided(ctx.n, 5))
    assert "uniform" in sel.fallback_used


def test_uniform_formula() -> None:
    assert strided(10, 3).tolist() == [1, 5, 8]  # floor((k + 0.5) * 10 / 3)
    assert strided(7, 7).tolist() == list(range(7))


def test_random_depends_on_seed_only() -> None:
    ctx = make_ctx(grid=(1, 10, 10))
    a = get_selector("random", seed=1).select(ctx, 30)
    assert torch.equal(a, get_selector("random", seed=1).select(make_ctx(grid=(1, 10, 10), seed=5), 30))
    assert not torch.equal(a, get_selector("random", seed=2).select(ctx, 30))


def test_visionzip_is_top_attention_with_lowest_index_ties() -> None:
    ctx = make_ctx()
    ctx.attention_received["last"] = torch.zeros(ctx.n)
    ctx.attention_received["last"][[4, 9, 20]] = 1.0
    assert get_selector("visionzip").select(ctx, 5).tolist() == [0, 1, 4, 9, 20]


def test_attention_selectors_fall_back_to_norm_proxy() -> None:
    ctx = make_ctx(attention=False)
    norms = ctx.embeddings.norm(dim=1)
    sel = get_selector("visionzip")
    assert torch.equal(sel.select(ctx, 6), torch.topk(norms, 6).indices.sort().values)
    assert "L2 norm" in sel.fallback_used
    hip = get_selector("hiprune")
    hip.select(ctx, 6)
    assert "'middle'" in hip.fallback_used and "'last'" in hip.fallback_used
    full = get_selector("visionzip")
    full.select(make_ctx(), 6)
    assert full.fallback_used is None


def test_hiprune_alpha_zero_equals_visionzip() -> None:
    ctx = make_ctx(grid=(1, 6, 8))
    hiprune = get_selector("hiprune", alpha=0).select(ctx, 12)
    assert torch.equal(hiprune, get_selector("visionzip").select(ctx, 12))


def test_hiprune_buffers_stay_in_row_and_frame() -> None:
    grid = (2, 3, 4)  # 12 tokens per frame
    assert buffers([4], grid) == [5, 0, 8]  # row 1 col 0: no left neighbour (3 would wrap)
    assert buffers([12], grid) == [13, 16]  # frame 1 corner: nothing from frame 0
    assert buffers([11], grid) == [10, 7]


def test_hiprune_anchor_cluster_and_truncation() -> None:
    ctx = make_ctx(grid=(1, 6, 6))
    ctx.attention_received["middle"] = torch.zeros(36)
    ctx.attention_received["middle"][14] = 1.0  # anchor at row 2, col 2
    sel = get_selector("hiprune", alpha=1.0)  # round(1.0 * 5 / 5) = 1 anchor + 4 buffers
    assert sel.select(ctx, 5).tolist() == [8, 13, 14, 15, 20]
    # round(5.0 * 3 / 5) = 3 anchors (14, then ties 0, 1) whose buffers exceed the budget: anchors only
    assert get_selector("hiprune", alpha=5.0).select(ctx, 3).tolist() == [0, 1, 14]


def test_spatial_spread_is_smallest_for_a_concentrated_layer() -> None:
    grid = (1, 10, 10)
    blob = torch.zeros(100)
    blob[[44, 45, 54, 55]] = 1.0   # a 2×2 object
    corners = torch.zeros(100)
    corners[[0, 9, 90, 99]] = 1.0
    assert spatial_spread(blob, grid, share=0.04) == pytest.approx((4 + 2 * 2**0.5) * 2 / 12)
    assert spatial_spread(corners, grid, share=0.04) == pytest.approx((9 + 9 + 9 * 2**0.5) * 4 / 12)
    # pairs only within a frame: two frames with one top token each have no pair
    assert spatial_spread(torch.tensor([1.0, 0, 0, 0, 1.0, 0, 0, 0]), (2, 2, 2), share=0.25) == 0.0


def test_calibrated_layers_follow_the_measured_spread() -> None:
    # a deep tower's middle layer is the concentrated one: the paper's default (middle, last)
    assert calibrated_layers({"middle": 2.0, "last": 5.0}) == {"object_layer": "middle", "deep_layer": "last"}
    # a tower whose last block concentrates more: it is the object layer, the other one the deep layer
    assert calibrated_layers({"middle": 5.6, "last": 4.6}) == {"object_layer": "last", "deep_layer": "middle"}
    with pytest.raises(ValueError):
        calibrated_layers({"last": 1.0})


def test_hiprune_layers_are_options() -> None:
    """Swapped layers: anchors from the 'last' scores, registers from the 'middle' ones."""
    ctx = make_ctx(grid=(1, 6, 6))
    ctx.attention_received["last"] = torch.zeros(36)
    ctx.attention_received["last"][14] = 1.0
    ctx.attention_received["middle"] = torch.zeros(36)
    ctx.attention_received["middle"][[0, 35]] = 1.0
    sel = get_selector("hiprune", alpha=1.0, object_layer="last", deep_layer="middle")
    assert sel.select(ctx, 7).tolist() == [0, 8, 13, 14, 15, 20, 35]
    assert sel.fallback_used is None


def test_explicit_validation() -> None:
    ctx = make_ctx()  # 28 tokens
    assert ExplicitSelector([5, 1, 3]).select(ctx, 3).tolist() == [1, 3, 5]
    assert ExplicitSelector(torch.tensor([2, 0])).select(ctx, 2).tolist() == [0, 2]
    cases = {
        "out of range": [1, 2, 28],
        "duplicate": [4, 4, 5],
        "budget is exactly 3": [1, 2],
        "integer": [0.5, 1.0, 2.0],
    }
    for message, indices in cases.items():
        with pytest.raises(InvalidInputError, match=message):
            ExplicitSelector(indices).select(ctx, 3)
    with pytest.raises(InvalidInputError, match="out of range"):
        ExplicitSelector(lambda c, keep: [-1, 0, 1]).select(ctx, 3)


def test_context_shape_checks_for_vision_features() -> None:
    with pytest.raises(InvalidInputError, match="vision_features"):
        SelectionContext(embeddings=torch.zeros(9, 4), grid=(1, 3, 3), vision_features=torch.zeros(8, 2))
