"""A linear layer's product for a decode step's few rows, in oneDNN's summation order, at the speed of a
plain pass over the weight (csrc/row_linear.c).

A decode step of one session multiplies one row by every weight. oneDNN's prepacked product
(layers/linear.py) runs it at about half the rate of a plain pass there (the `bench` checkpoint's decode
step at one row: 6.1 ms, 4.7 through torch's default matmul), and well below it up to ~16 rows; and for
K > 1024 it sums a lone row in another order than any row of a product of two rows or more, so a row's
result depended on whether it ran alone. torch's default matmul (MKL) is quicker at one row, but its
one-row result differs from its many-row one too. This kernel sums each row as oneDNN sums the rows of a
many-row product (K in blocks, each block's partial from zero by one FMA per k in order, the partials
left to right, then the bias), so a row gets the same bits alone, among a few or among many: a
speculative verify row those of a plain decode row, a step padded to its bucket those of the step.
Whether the order holds is checked on each weight against oneDNN, bit for bit, before the kernel serves
it (`row_linear`); where it does not, oneDNN runs the rows as before. Up to `RowLinear.max_rows` rows (16
with AVX-512, where up to eight rows share a pass over the weight; else 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import native

THREADED = 1 << 21      # products of at least this many multiply-adds split their tiles among torch's threads
MAX_ROWS = 16           # the most rows any build takes (`RowLinear.max_rows`: this build's)
CHECK_ROWS = (0, 1, 77)     # rows of a 128-row product the kernel must reproduce


@dataclass(frozen=True)
class RowLinear:
    """One weight (and bias) packed for the row kernel, with the K block its order was checked with."""

    packed: Tensor          # [tiles * K * tile], the build's `row_linear_tile` columns a tile
    bias: Tensor | None
    k: int
    n: int
    block: int
    max_rows: int           # rows up to which the kernel is faster than oneDNN on this build

    def __call__(self, x: Tensor) -> Tensor:
        """`x [rows, K]` (fp32, contiguous) times the weight: `[rows, N]`."""
        out = x.new_empty(x.shape[0], self.n)
        threads = torch.get_num_threads() if self.n * self.k * x.shape[0] >= THREADED else 1
        native.loaded("row_linear").row_linear_f32(
            x.data_ptr(), self.packed.data_ptr(), None if self.bias is None else self.bias.data_ptr(),
            out.data_ptr(), x.shape[0], self.k, self.n, self.block, threads)
        return out


def blocks(k: int) -> list[int]:
    """K blocks to try, the one oneDNN chose on the builds measured first (512 up to K = 1,024, then 1,024)."""
    return list(dict.fromkeys([512 if k <= 1024 else 1024, 256, 512, 1024, 2048, k]))


def row_linear(weight: Tensor, bias: Tensor | None, many_rows: Callable[[Tensor], Tensor]) -> RowLinear | None:
    """The kernel for `weight [N, K]` (and `bias [N]`), fp32 on the CPU, if it reproduces `many_rows` (the
    layer's oneDNN product) bit for bit on rows of a 128-row product, one at a time and seven at once, and
    that product's rows equal those of a two-row one; else None (or where the kernel is not built)."""
    lib = native.library("row_linear")
    if lib is None or weight.dtype != torch.float32 or not weight.is_cpu or weight.dim() != 2:
        return None
    n, k = weight.shape
    weight = weight.detach().contiguous()
    tile = lib.row_linear_tile()
    packed = weight.new_empty(-(-n // tile) * k * tile)
    lib.row_linear_pack_f32(weight.data_ptr(), packed.data_ptr(), n, k)
    bias = None if bias is None else bias.detach().contiguous()
    x = torch.randn(128, k, generator=torch.Generator().manual_seed(k))
    want = many_rows(x)
    if not torch.equal(many_rows(x[:2]), want[:2]):
        return None
    for block in blocks(k):
        kernel = RowLinear(packed, bias, k, n, block, lib.row_linear_max_rows())
        if all(torch.equal(kernel(x[r:r + 1].contiguous()), want[r:r + 1]) for r in CHECK_ROWS) and \
                torch.equal(kernel(x[3:10]), want[3:10]):
            return kernel
    return None
