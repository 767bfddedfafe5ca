"""A linear layer that computes several projections of one input in a single matmul.

Checkpoints store q/k/v (or gate/up, or the GDN input projections) as separate tensors; the loader
writes each into its rows of the merged weight (`load_part`), so the forward reads the input once
and makes one call instead of three or four: at decode batch sizes the per-call cost dominates.
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Module):
    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False):
        super().__init__()
        self.parts = dict(parts)
        self.sizes = list(parts.values())
        total = sum(self.sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features))
        self.bias = nn.Parameter(torch.zeros(total)) if bias else None
        self._offsets: dict[str, int] = {}
        offset = 0
        for name, size in parts.items():
            self._offsets[name] = offset
            offset += size

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.nn.functional.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)

    def part_names(self) -> list[str]:
        return [f"{p}.{leaf}" for p in self.parts for leaf in (("weight", "bias") if self.bias is not None
                                                                 else ("weight",))]

    def part_shape(self, part: str, leaf: str) -> tuple[int, ...]:
        rows = self.parts[part]
        return (rows, self.weight.shape[1]) if leaf == "weight" else (rows,)

    def load_part(self, part: str, leaf: str, tensor: torch.Tensor) -> None:
        target = self.weight if leaf == "weight" else self.bias
        start = self._offsets[part]
        with torch.no_grad():
            target[start:start + self.parts[part]].copy_(tensor.to(target.dtype))
