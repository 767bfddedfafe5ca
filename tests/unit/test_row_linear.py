"""The row linear kernel (ops/row_linear.py, csrc/row_linear.c): a row alone, or among a few, gets the bits
oneDNN gives it among many rows, at every K block (one block up to 512, blocks of 512 up to 1,024, past
that 1,024), with or without a bias, on one thread or several; a weight it cannot reproduce keeps oneDNN;
the linear layers use it for a decode step's few rows, so their rows no longer depend on their neighbours
at K > 1,024."""

from __future__ import annotations

import platform

import pytest
import torch

from raincheck_core.layers import linear as linear_mod
from raincheck_core.layers.linear import Linear
from raincheck_core.ops import native, row_linear

# where oneDNN's order was measured (AVX-512 and AVX2 builds): elsewhere the kernel may find it differs and
# leave the rows to oneDNN, which is correct too
X86 = platform.machine() in ("x86_64", "AMD64")
needs_kernel = pytest.mark.skipif(not linear_mod._packing["available"] or native.library("row_linear") is None,
                                  reason="torch without oneDNN, or no C compiler")


def _onednn(weight: torch.Tensor, bias: torch.Tensor | None):
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return lambda a: torch.ops.mkldnn._linear_pointwise(a, packed, bias, "none", [], "")


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(80, 96), (640, 384), (130, 700), (200, 1024), (96, 1536), (70, 2100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_row_equals_its_row_in_a_many_row_product(n, k, with_bias):
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    many = _onednn(weight, bias)
    kernel = row_linear.row_linear(weight, bias, many)
    if kernel is None:
        assert not X86, "the one-row kernel should reproduce oneDNN's order on x86"
        return
    x = torch.randn(40, k, generator=gen)
    with torch.inference_mode():
        want = many(x)
        for r in range(9):
            assert torch.equal(kernel(x[r:r + 1].contiguous()), want[r:r + 1])
        for m in range(2, kernel.max_rows + 1):     # every split of the rows into passes of up to eight
            assert torch.equal(kernel(x[20:20 + m]), want[20:20 + m]), m


@needs_kernel
def test_threads_split_the_tiles_and_change_no_bit():
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(2304, 1024, generator=gen)      # past THREADED: split among torch's threads
    assert weight.numel() >= row_linear.THREADED
    kernel = row_linear.row_linear(weight, None, _onednn(weight, None))
    if kernel is None:
        assert not X86
        return
    x = torch.randn(kernel.max_rows, 1024, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, lone = kernel(x), kernel(x[:1].contiguous())
        for n in (3, 5, 7):     # a thread's tiles even or odd in number: a lone row goes over two tiles at once
            torch.set_num_threads(n)
            assert torch.equal(kernel(x), one), n
            assert torch.equal(kernel(x[:1].contiguous()), lone), n
            assert torch.equal(lone, one[:1]), n
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_an_order_it_cannot_reproduce_keeps_onednn(monkeypatch):
    monkeypatch.setattr(row_linear, "blocks", lambda k: [3])        # no block oneDNN uses
    weight = torch.randn(40, 96)
    assert row_linear.row_linear(weight, None, _onednn(weight, None)) is None
    layer = Linear(96, 40, bias=False)
    with torch.inference_mode():
        out = layer(torch.randn(1, 96))
    assert out.shape == (1, 40) and layer.__dict__["_row_kernel"][1] is None


@needs_kernel
@pytest.mark.parametrize("k", [96, 1536])
def test_a_layer_s_rows_do_not_depend_on_their_neighbours(k):
    """One row through the kernel, many through oneDNN: the same bits (oneDNN alone differs at one row
    from K > 1,024 on, which this kernel replaces)."""
    gen = torch.Generator().manual_seed(k)
    layer = Linear(k, 72, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(72, k, generator=gen))
        layer.bias.copy_(torch.randn(72, generator=gen))
    x = torch.randn(40, k, generator=gen)
    with torch.inference_mode():
        whole = layer(x)
        for r, m in ((0, 1), (1, 1), (2, 2), (4, 3), (7, 5), (12, 16)):
            assert torch.equal(layer(x[r:r + m]), whole[r:r + m]) or (not X86 and k > 1024)
        assert layer.__dict__["_row_kernel"][1] is not None or not X86


@needs_kernel
def test_a_weight_changed_in_place_is_packed_again():
    layer = Linear(64, 32, bias=False)
    x = torch.randn(1, 64)
    with torch.inference_mode():
        before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)
    with torch.inference_mode():
        assert torch.equal(layer(x), layer(torch.cat([x, x]))[:1])
        assert not torch.equal(layer(x), before)


def test_without_native_kernels_none_is_built(monkeypatch):
    monkeypatch.setenv("RAINCHECK_NATIVE", "0")
    weight = torch.randn(8, 16)
    assert row_linear.row_linear(weight, None, lambda a: a @ weight.T) is None
