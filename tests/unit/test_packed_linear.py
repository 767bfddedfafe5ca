"""Linear layers' prepacked inference path (layers/linear.py): the same products as `F.linear`, a
weight changed in place is packed again, and autograd never goes through the packed copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raincheck_core.layers import linear as linear_mod
from raincheck_core.layers.linear import Linear, MergedLinear

needs_packing = pytest.mark.skipif(not linear_mod._packing["available"], reason="torch without oneDNN")


@needs_packing
@pytest.mark.parametrize("shape", [(1, 96), (4, 96), (33, 96), (2, 5, 96)])
def test_packed_products_equal_the_plain_matmul(shape):
    gen = torch.Generator().manual_seed(len(shape))
    layer = Linear(96, 80, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96, generator=gen) / 10)
        layer.bias.copy_(torch.randn(80, generator=gen))
    x = torch.randn(*shape, generator=gen)
    with torch.inference_mode():
        out = layer(x)
    assert "_packed_weight" in layer.__dict__
    assert out.shape == (*shape[:-1], 80)
    with torch.no_grad():
        assert float((out - F.linear(x, layer.weight, layer.bias)).abs().max()) <= 1e-5


@needs_packing
def test_a_weight_changed_in_place_is_packed_again():
    """A stale packed copy would keep answering with the old weight (loading writes parts in place)."""
    gen = torch.Generator().manual_seed(7)
    merged = MergedLinear(32, {"a": 16, "b": 8})
    with torch.no_grad():
        merged.weight.copy_(torch.randn(24, 32, generator=gen))
    x = torch.randn(3, 32, generator=gen)
    with torch.inference_mode():
        before = torch.cat(merged(x), dim=-1)
    merged.load_part("b", "weight", torch.zeros(8, 32))
    with torch.inference_mode():
        a, b = merged(x)
    assert float((a - before[:, :16]).abs().max()) <= 1e-5
    assert bool((b == 0).all()) and not bool((before[:, 16:] == 0).all())


def test_autograd_uses_the_plain_weight():
    layer = Linear(8, 4)
    x = torch.randn(5, 8)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and "_packed_weight" not in layer.__dict__


def test_packing_can_be_turned_off(monkeypatch):
    monkeypatch.setitem(linear_mod._packing, "available", False)
    layer = Linear(8, 4)
    with torch.inference_mode():
        layer(torch.randn(2, 8))
    assert "_packed_weight" not in layer.__dict__


@needs_packing
def test_row_counts_are_bucketed_and_rows_do_not_depend_on_their_neighbours():
    """Padding a step's rows to a bucket (bounded oneDNN primitives) must change no row's result."""
    assert [linear_mod._row_bucket(n) for n in (1, 3, 5, 8, 9, 17, 64, 79, 100, 128, 129, 2000)] == \
        [1, 4, 8, 8, 16, 24, 64, 80, 104, 128, 256, 2048]
    assert len({linear_mod._row_bucket(n) for n in range(1, 2049)}) <= 35
    gen = torch.Generator().manual_seed(3)
    layer = Linear(96, 80, bias=True)
    x = torch.randn(300, 96, generator=gen)
    with torch.inference_mode():
        whole = layer(x)
        for n in (1, 3, 9, 17, 33, 47, 79, 129, 257):
            assert torch.equal(layer(x[:n]), whole[:n])
