"""Linear layers of the decoder: `MergedLinear` computes several projections of one input in a single
matmul, and both it and `Linear` run inference on the CPU with a prepacked weight.

Checkpoints store q/k/v (or gate/up, or the GDN input projections) as separate tensors; the loader
writes each into its rows of the merged weight (`load_part`), so the forward reads the input once
and makes one call instead of three or four: at decode batch sizes the per-call cost dominates.

Prepacked weights: for fp32 inference on the CPU a layer keeps a copy of its weight in oneDNN's
blocked layout and multiplies with oneDNN: at the step sizes of a decode batch (4-64 rows) as fast as
torch's default fp32 matmul (MKL) or up to 1.6x faster on the CPUs measured (docs/BENCHMARKS.md), and a
row's result does not depend on the rows beside it, which MKL's does. A decode step's few rows (one per
session, up to 16) go to a kernel that sums them in oneDNN's order of a many-row product at the speed of a
plain pass over the weight (ops/row_linear.py; oneDNN ran one row at half that). The copies are made on
first use and again whenever the weight changes (layers/derived.py), so training and in-place loading stay
correct; they take twice the resident size of the decoder's weights besides them, which
`RAINCHECK_PACKED_LINEAR=0` avoids.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.row_linear import MAX_ROWS, RowLinear, row_linear
from .derived import derived

log = logging.getLogger(__name__)
ROW_BUCKET = 128
ROW_STEP = 8
_packing = {"available": os.environ.get("RAINCHECK_PACKED_LINEAR", "1") != "0"
            and torch.backends.mkldnn.is_available()}


def packed_linear(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through `module`'s prepacked copy of `weight` where that applies
    (fp32 on the CPU, no autograd)."""
    if (not _packing["available"] or torch.is_grad_enabled() or x.dtype != torch.float32
            or weight.dtype != torch.float32 or not x.is_cpu):
        return F.linear(x, weight, bias)
    # a decode step's input is already `[rows, in]` and needs no padding: no reshape, slice or view then
    flat = x.dim() == 2
    rows = x if flat else x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n <= MAX_ROWS:      # a decode step's few rows: the row kernel, where it sums as oneDNN's rows do
        few_rows = derived(module, "_row_kernel", (weight,) if bias is None else (weight, bias),
                           lambda: _row_kernel(module, weight, bias))
        if few_rows is not None and n <= few_rows.max_rows:
            out = few_rows(rows.contiguous())
            return out if flat else out.view(*x.shape[:-1], out.shape[-1])
    packed = _prepacked(module, weight)
    if packed is None:
        return F.linear(x, weight, bias)
    padded = _row_bucket(n)
    if padded != n:
        rows = torch.cat([rows, rows.new_zeros(padded - n, rows.shape[1])])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    if padded != n:
        out = out[:n]
    return out if flat else out.view(*x.shape[:-1], out.shape[-1])


def _prepacked(module: nn.Module, weight: torch.Tensor) -> torch.Tensor | None:
    """`module`'s oneDNN copy of `weight`, or None where this torch's oneDNN lacks the op (packing is then
    off for good: the plain matmul)."""
    try:
        return derived(module, "_packed_weight", (weight,),
                       lambda: torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
    except RuntimeError as e:
        log.warning("prepacked linear weights unavailable (%s); using torch's matmul", e)
        _packing["available"] = False
        return None


def _row_kernel(module: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> RowLinear | None:
    """The row kernel for `weight`, checked against the oneDNN product it stands in for."""
    packed = _prepacked(module, weight)
    if packed is None:
        return None
    return row_linear(weight, bias, lambda a: torch.ops.mkldnn._linear_pointwise(a, packed, bias, "none", [], ""))


def _row_bucket(n: int) -> int:
    """oneDNN builds and keeps a primitive (about 0.7 MiB at the demo's sizes) for every row count it
    multiplies: a server meeting every prompt length and batch size would keep growing. Row counts are
    padded to a power of two up to ROW_STEP, to a multiple of ROW_STEP up to ROW_BUCKET and to a multiple of
    ROW_BUCKET past that, so at most ~35 counts occur below 2,048 rows. Its time grows with the rows it is
    given, padding included (a fused step of 16 decode rows and a 63-row chunk ran as 128 rows under
    powers of two: 1.5x the time of 80), so the buckets are as fine as that bound allows. A row's result
    does not depend on the rows beside it (the oneDNN matmul is row-invariant,
    tests/unit/test_packed_linear.py), so padding changes no output."""
    if n <= ROW_STEP:
        return 1 << (n - 1).bit_length()
    step = ROW_STEP if n <= ROW_BUCKET else ROW_BUCKET
    return -(-n // step) * step


class Linear(nn.Linear):
    """`nn.Linear` with the prepacked inference path (same parameters and state-dict keys)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(self, x, self.weight, self.bias)


class MergedLinear(nn.Module):
    """`parts`: each projection's output rows as the checkpoint stores them. `select` (tensor parallelism:
    a column-parallel projection) names the row ranges of each part this rank holds; None: all of them."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False,
                 select: dict[str, list[range]] | None = None, split: bool = True):
        """`split` False: the forward returns the parts side by side, `[..., sum of parts]`, for a caller
        that reads adjacent parts as one."""
        super().__init__()
        self.split_parts = split
        self.full = dict(parts)
        self.select = {p: select[p] if select is not None else [range(n)] for p, n in parts.items()}
        self.parts = {p: sum(len(r) for r in self.select[p]) for p in parts}
        self.sizes = list(self.parts.values())
        total = sum(self.sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features))
        self.bias = nn.Parameter(torch.zeros(total)) if bias else None
        self._offsets: dict[str, int] = {}
        offset = 0
        for name, size in self.parts.items():
            self._offsets[name] = offset
            offset += size

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | torch.Tensor:
        out = packed_linear(self, x, self.weight, self.bias)
        return out.split_with_sizes(self.sizes, dim=-1) if self.split_parts else out

    def part_names(self) -> list[str]:
        return [f"{p}.{leaf}" for p in self.parts for leaf in (("weight", "bias") if self.bias is not None
                                                                 else ("weight",))]

    def part_shape(self, part: str, leaf: str) -> tuple[int, ...]:
        """The part's shape in the checkpoint (all its rows, whatever this rank holds)."""
        rows = self.full[part]
        return (rows, self.weight.shape[1]) if leaf == "weight" else (rows,)

    def load_part(self, part: str, leaf: str, tensor: torch.Tensor) -> None:
        target = self.weight if leaf == "weight" else self.bias
        start = self._offsets[part]
        with torch.no_grad():
            target[start:start + self.parts[part]].copy_(tensor.to(target.dtype))
