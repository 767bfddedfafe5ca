"""The tensor-parallel pieces of the decoder (Megatron-style; built only when the engine has more than
one rank), and how the loader reads each rank's part of a checkpoint tensor.

A column-parallel projection is a `MergedLinear` with row selections (linear.py): no communication. A
`RowParallelLinear` multiplies the rank's input columns and sums the ranks' partial outputs with one
all-reduce (after attention, GDN and the MLP). The vocabulary is split into row blocks: the embedding
looks up the ids its block holds and all-reduces (the other ranks add zeros), the LM head gathers every
rank's logits.

`Target` tells the loader (models/loader.py) how a checkpoint tensor is read: its shapes there, what
part of it this process keeps (`read`, from a safetensors slice, so no process reads a whole sharded
tensor) and where it goes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.group import RankGroup
from .linear import packed_linear


def whole(sl: Any) -> torch.Tensor:
    """A safetensors slice read whole."""
    return sl[:]


def part_of(ranges: dict[int, Sequence[range]]) -> Callable[[Any], torch.Tensor]:
    """A reader of a block of a safetensors slice: along each dim in `ranges` the index ranges given
    (several, at most along one dim: concatenated there), all of every other dim."""
    multi = [d for d, rs in ranges.items() if len(rs) > 1]
    cat_dim = multi[0] if multi else 0

    def read(sl: Any) -> torch.Tensor:
        index = [slice(None)] * (max(ranges) + 1)
        for d, rs in ranges.items():
            index[d] = slice(rs[0].start, rs[0].stop)
        parts = []
        for r in ranges.get(cat_dim, [None]):
            if r is not None:
                index[cat_dim] = slice(r.start, r.stop)
            parts.append(sl[tuple(index)])
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=cat_dim)
    return read


def rows_of(ranges: Sequence[range], dim: int = 0) -> Callable[[Any], torch.Tensor]:
    """A reader of the index ranges `ranges` along `dim` of a safetensors slice, concatenated."""
    return part_of({dim: ranges})


def copy_into(target: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def write(t: torch.Tensor) -> None:
        with torch.no_grad():
            target.copy_(t.to(target.dtype))
    return write


@dataclass(frozen=True)
class Target:
    """How the loader reads one checkpoint tensor: the shapes it may have in the checkpoint, the part
    this process holds (`read`), and where that goes (`write`; None: another rank holds all of it, so
    this one checks its shape and reads nothing)."""

    shapes: tuple[tuple[int, ...], ...]
    write: Callable[[torch.Tensor], None] | None
    read: Callable[[Any], torch.Tensor] = whole


class RowParallelLinear(nn.Module):
    """`y = x W^T + b` where this rank holds W's input columns `cols` and x's matching features: the
    partial products are summed over ranks (`reduce`; a caller that sums several partials itself, as the
    MoE block does, reduces once for all), then the bias added once."""

    def __init__(self, in_features: int, out_features: int, cols: range, group: RankGroup, bias: bool = False,
                 reduce: bool = True):
        super().__init__()
        self.in_features, self.cols, self.group, self.reduce = in_features, cols, group, reduce
        self.weight = nn.Parameter(torch.empty(out_features, len(cols)))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = packed_linear(self, x, self.weight, None)
        if self.reduce:
            out = self.group.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def checkpoint_targets(self) -> dict[str, Target]:
        targets = {"weight": Target(((self.weight.shape[0], self.in_features),), copy_into(self.weight),
                                    rows_of([self.cols], dim=1))}
        if self.bias is not None:
            targets["bias"] = Target((tuple(self.bias.shape),), copy_into(self.bias))
        return targets


class VocabParallelEmbedding(nn.Module):
    """The embedding whose rows `rows` (a block of the vocabulary) this rank holds."""

    def __init__(self, vocab: int, hidden: int, rows: range, group: RankGroup):
        super().__init__()
        self.vocab, self.rows, self.group = vocab, rows, group
        self.weight = nn.Parameter(torch.empty(len(rows), hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.rows.start
        mine = (local >= 0) & (local < len(self.rows))
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        return self.group.all_reduce(out * mine.unsqueeze(-1).to(out.dtype))

    def checkpoint_targets(self) -> dict[str, Target]:
        return {"weight": Target(((self.vocab, self.weight.shape[1]),), copy_into(self.weight), rows_of([self.rows]))}


class VocabParallelHead(nn.Module):
    """The LM head over this rank's vocabulary block `rows`; every rank gets the whole vocabulary's
    logits (the blocks are `ceil(V / world)` rows, the last one padded for the gather)."""

    def __init__(self, hidden: int, vocab: int, rows: range, group: RankGroup):
        super().__init__()
        self.vocab, self.rows, self.group = vocab, rows, group
        self.block = -(-vocab // group.world)
        self.weight = nn.Parameter(torch.empty(len(rows), hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = packed_linear(self, x, self.weight, None)
        if logits.shape[-1] < self.block:
            logits = F.pad(logits, (0, self.block - logits.shape[-1]))
        return self.group.all_gather(logits, dim=-1)[..., :self.vocab]

    def checkpoint_targets(self) -> dict[str, Target]:
        return {"weight": Target(((self.vocab, self.weight.shape[1]),), copy_into(self.weight), rows_of([self.rows]))}
