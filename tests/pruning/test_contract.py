"""The selector contract (docs/mechanism.md §2, docs/selectors.md §2), for every registered selector."""

from __future__ import annotations

import pytest
import torch

from raincheck_core.errors import InvalidInputError
from raincheck_core.pruning import SELECTORS, SelectionContext, get_selector, keep_count, select_span

from .spans import make_ctx


def _make(name: str):
    if name == "explicit":  # reversed order on purpose: the selector must sort it
        return get_selector(name, indices=lambda ctx, keep: list(range(ctx.n - 1, ctx.n - 1 - keep, -1)))
    return get_selector(name)


CONTEXTS = {
    "full": dict(),
    "video_odd_grid": dict(grid=(2, 3, 5)),
    "embeddings_only": dict(m=None, d_v=None, attention=False),
}


@pytest.mark.parametrize("ctx_kind", list(CONTEXTS))
@pytest.mark.parametrize("retention", [0.1, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_contract(name: str, retention: float, ctx_kind: str) -> None:
    ctx = make_ctx(**CONTEXTS[ctx_kind])
    idx = select_span(_make(name), ctx, retention)
    assert idx.dtype == torch.long and idx.dim() == 1
    assert idx.numel() == keep_count(ctx.n, retention)
    assert idx.unique().numel() == idx.numel()
    assert torch.equal(idx, idx.sort().values)
    assert int(idx.min()) >= 0 and int(idx.max()) < ctx.n
    assert torch.equal(idx, select_span(_make(name), ctx, retention))  # deterministic, fresh instance


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_budget_edges(name: str) -> None:
    ctx = make_ctx()
    sel = _make(name)
    for keep in (ctx.n, ctx.n + 5):
        assert torch.equal(sel.select(ctx, keep), torch.arange(ctx.n))
    empty = sel.select(ctx, 0)
    assert empty.numel() == 0 and empty.dtype == torch.long
    for keep in (1, ctx.n - 1):
        assert sel.select(ctx, keep).numel() == keep


def test_keep_count_rule() -> None:
    # n - floor((1 - r) n), not floor(r n)
    assert keep_count(10, 0.3) == 3
    assert keep_count(7, 0.3) == 7 - 4
    assert keep_count(3, 0.1) == 1
    assert keep_count(5, 1.0) == 5
    assert keep_count(0, 0.3) == 0


@pytest.mark.parametrize("retention", [0.0, -0.1, 1.01, float("nan"), True, "0.3"])
def test_bad_retention(retention) -> None:
    with pytest.raises(InvalidInputError, match="retention"):
        select_span(get_selector("uniform"), make_ctx(), retention)


def test_unknown_selector_lists_names() -> None:
    with pytest.raises(InvalidInputError, match=r"divprune.*uniform"):
        get_selector("fastv")
    with pytest.raises(InvalidInputError, match="bad options"):
        get_selector("uniform", alpha=0.3)


def test_bad_keep_and_context() -> None:
    with pytest.raises(InvalidInputError):
        get_selector("uniform").select(make_ctx(), -1)
    with pytest.raises(InvalidInputError, match="grid"):
        SelectionContext(embeddings=torch.zeros(10, 4), grid=(1, 3, 3))
    with pytest.raises(InvalidInputError, match="query"):
        SelectionContext(embeddings=torch.zeros(9, 4), grid=(1, 3, 3), query=torch.zeros(2, 5))
    with pytest.raises(InvalidInputError, match="attention_received"):
        SelectionContext(embeddings=torch.zeros(9, 4), grid=(1, 3, 3),
                         attention_received={"last": torch.zeros(8)})
