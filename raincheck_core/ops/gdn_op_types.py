"""The types of one GDN layer's ops over a group of packed sequences (ops/gdn_varlen.py
`gated_deltanet_varlen` and `gated_deltanet_rows`, or the native kernel's of the same names in
ops/gdn_kernel.py). A module of their own, below every GDN op, so that what takes an op (ops/gdn_step.py,
ops/gdn_rows.py, ops/backend.py) names its type without importing the others."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

VarlenOp = Callable[..., tuple[Tensor, Tensor | None, Tensor, Tensor | None, Tensor | None]]
RowsOp = Callable[..., tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]]
