"""The sparse mixture-of-experts MLP of Qwen3-VL-MoE and Qwen3.5-MoE: a top-k router over E SwiGLU
experts and, in Qwen3.5-MoE, a shared expert scaled by a sigmoid gate.

The experts' weights are stacked as transformers keeps them in memory (`gate_up_proj [E, 2I, H]`,
`down_proj [E, H, I]`), so the step's op (`ops.moe`, ops/moe.py) runs one matmul pair per active
expert. Checkpoints store them either stacked (Qwen3-VL-MoE, possibly transposed to `[E, H, 2I]` /
`[E, I, H]` as on the Hub) or one tensor per expert (Qwen3.5-MoE: `experts.{e}.gate_proj.weight`, …);
`checkpoint_targets` tells the loader (models/loader.py) how to write each.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..ops.backend import OpSet
from ..ops.moe import route
from .linear import Linear
from .mlp import SwiGLU

# checkpoint-side name (relative to the module) -> (accepted shapes, writer)
Targets = dict[str, tuple[tuple[tuple[int, ...], ...], Callable[[torch.Tensor], None]]]


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, stacked: bool):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.stacked = stacked   # how the family's checkpoints store them

    def checkpoint_targets(self) -> Targets:
        if self.stacked:
            return {"gate_up_proj": self._stacked(self.gate_up_proj), "down_proj": self._stacked(self.down_proj)}
        inter = self.down_proj.shape[2]
        targets: Targets = {}
        for e in range(self.gate_up_proj.shape[0]):
            targets[f"{e}.gate_proj.weight"] = self._slice(self.gate_up_proj[e, :inter])
            targets[f"{e}.up_proj.weight"] = self._slice(self.gate_up_proj[e, inter:])
            targets[f"{e}.down_proj.weight"] = self._slice(self.down_proj[e])
        return targets

    @staticmethod
    def _stacked(param: nn.Parameter) -> tuple[tuple[tuple[int, ...], ...], Callable[[torch.Tensor], None]]:
        """Either layout, as transformers accepts it: as in memory, else transposed (when both read
        the same shape, as in memory)."""
        shape = tuple(param.shape)

        def write(t: torch.Tensor) -> None:
            with torch.no_grad():
                param.copy_((t if tuple(t.shape) == shape else t.transpose(1, 2)).to(param.dtype))

        return (shape, (shape[0], shape[2], shape[1])), write

    @staticmethod
    def _slice(view: torch.Tensor) -> tuple[tuple[tuple[int, ...], ...], Callable[[torch.Tensor], None]]:
        def write(t: torch.Tensor) -> None:
            with torch.no_grad():
                view.copy_(t.to(view.dtype))

        return (tuple(view.shape),), write


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, shared_intermediate: int,
                 stacked: bool):
        super().__init__()
        self.top_k = top_k
        self.gate = Linear(hidden, num_experts, bias=False)      # the router
        self.experts = Experts(num_experts, hidden, intermediate, stacked)
        self.shared_expert = SwiGLU(hidden, shared_intermediate) if shared_intermediate else None
        self.shared_expert_gate = Linear(hidden, 1, bias=False) if shared_intermediate else None

    def forward(self, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        experts, weights = route(self.gate(x), self.top_k)
        out = ops.moe(x, experts, weights, self.experts.gate_up_proj, self.experts.down_proj)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
