"""The sparse mixture-of-experts MLP of Qwen3-VL-MoE and Qwen3.5-MoE: a top-k router over E SwiGLU
experts and, in Qwen3.5-MoE, a shared expert scaled by a sigmoid gate.

The experts' weights are stacked as transformers keeps them in memory (`gate_up_proj [E, 2I, H]`,
`down_proj [E, H, I]`), so the step's op (`ops.moe`, ops/moe.py) runs one matmul pair per active
expert. Checkpoints store them either stacked (Qwen3-VL-MoE, possibly transposed to `[E, H, 2I]` /
`[E, I, H]` as on the Hub) or one tensor per expert (Qwen3.5-MoE: `experts.{e}.gate_proj.weight`, …);
`checkpoint_targets` tells the loader (models/loader.py) how to read and write each.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..ops.backend import OpSet
from ..ops.moe import route
from ..parallel.group import RankGroup
from .linear import Linear
from .mlp import SwiGLU
from .parallel import Target, copy_into, part_of, rows_of


class Experts(nn.Module):
    """The experts `experts` (expert parallelism: this rank's block; None: all of them), each holding the
    block `width` of its intermediate width (tensor parallelism without expert parallelism; None: all)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, stacked: bool, experts: range | None = None,
                 width: range | None = None):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.experts = experts if experts is not None else range(num_experts)
        self.width = width if width is not None else range(intermediate)
        self.gate_up_proj = nn.Parameter(torch.empty(len(self.experts), 2 * len(self.width), hidden))
        self.down_proj = nn.Parameter(torch.empty(len(self.experts), hidden, len(self.width)))
        self.stacked = stacked   # how the family's checkpoints store them

    def checkpoint_targets(self) -> dict[str, Target]:
        e, i, h, w = self.num_experts, self.intermediate, self.hidden, self.width
        gate_up = [range(w.start, w.stop), range(i + w.start, i + w.stop)]
        if self.stacked:
            return {"gate_up_proj": self._stacked(self.gate_up_proj, (e, 2 * i, h), gate_up),
                    "down_proj": self._stacked(self.down_proj, (e, h, i), [w])}
        targets: dict[str, Target] = {}
        for local, expert in enumerate(self.experts):
            targets[f"{expert}.gate_proj.weight"] = Target(
                ((i, h),), copy_into(self.gate_up_proj[local, :len(w)]), rows_of([w]))
            targets[f"{expert}.up_proj.weight"] = Target(
                ((i, h),), copy_into(self.gate_up_proj[local, len(w):]), rows_of([w]))
            targets[f"{expert}.down_proj.weight"] = Target(((h, i),), copy_into(self.down_proj[local]), rows_of([w], 1))
        for expert in (x for x in range(e) if x not in self.experts):      # other ranks' experts
            targets.update({f"{expert}.{name}.weight": Target((shape,), None)
                            for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i)))})
        return targets

    def _stacked(self, param: nn.Parameter, shape: tuple[int, int, int], width: list[range]) -> Target:
        """Either layout, as transformers accepts it: as in memory (the width along dim 1 for gate_up,
        dim 2 for down), else transposed (when both read the same shape, as in memory); this rank's
        experts and width only."""
        hub = (shape[0], shape[2], shape[1])
        along = 1 if param is self.gate_up_proj else 2
        experts = [self.experts]

        def read(sl: Any) -> torch.Tensor:
            if tuple(sl.get_shape()) == shape:
                return part_of({0: experts, along: width})(sl)
            return part_of({0: experts, 3 - along: width})(sl).transpose(1, 2)

        return Target((shape, hub), copy_into(param), read)


class SparseMoE(nn.Module):
    """With a rank group: the router replicated, this rank's experts (`expert_parallel`) or every expert's
    width block, and the shared expert's width block; each rank's partial output (the experts it runs, its
    part of the shared expert) is summed by one all-reduce. An all-reduce rather than an all-to-all because
    every rank already holds every row (the step's rows are replicated across tensor-parallel ranks):
    dispatching rows to their experts' ranks and back would move k rows per token twice, where the
    all-reduce moves one hidden vector per token, the same as a dense MLP's."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, shared_intermediate: int,
                 stacked: bool, tp: RankGroup | None = None, expert_parallel: bool = False):
        super().__init__()
        self.top_k, self.tp = top_k, tp
        self.gate = Linear(hidden, num_experts, bias=False)      # the router
        experts = width = None
        if tp is not None:
            if expert_parallel:
                experts = tp.shard.block(num_experts)
            else:
                width = tp.shard.even(intermediate, "moe_intermediate_size")
        self.experts = Experts(num_experts, hidden, intermediate, stacked, experts, width)
        self.local = experts      # the block of experts this rank runs (None: every expert)
        self.shared_expert = SwiGLU(hidden, shared_intermediate, tp, reduce=False) if shared_intermediate else None
        self.shared_expert_gate = Linear(hidden, 1, bias=False) if shared_intermediate else None

    def forward(self, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        experts, weights = route(self.gate(x), self.top_k)
        if self.local is None:
            out = ops.moe(x, experts, weights, self.experts.gate_up_proj, self.experts.down_proj)
        else:
            out = self._local_experts(x, experts, weights, ops)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _local_experts(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, ops: OpSet
                       ) -> torch.Tensor:
        """The (row, expert) pairs routed to this rank's experts, run as one-expert rows of the step's op."""
        local = (experts >= self.local.start) & (experts < self.local.stop)
        rows, k = local.nonzero(as_tuple=True)
        out = torch.zeros_like(x)
        if rows.numel():
            y = ops.moe(x[rows], (experts[rows, k] - self.local.start)[:, None], weights[rows, k][:, None],
                        self.experts.gate_up_proj, self.experts.down_proj)
            out.index_add_(0, rows, y)
        return out
