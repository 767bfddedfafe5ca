"""Mixture-of-experts ops over a step's packed rows: routing and the grouped expert matmul.

`route` is the top-k router of Qwen3-VL-MoE and Qwen3.5-MoE as transformers computes it (softmax in
fp32 over all experts, top-k, the k weights renormalised to sum to 1). `grouped_experts` sorts the
step's (row, expert) pairs by expert and runs each active expert once over all of its rows (one
gate/up and one down matmul per expert, whatever the number of rows), then adds the weighted outputs
back into their rows. Its cost grows with the number of distinct experts a step touches, not with its
rows: the rows of a fused deferred chunk that route to experts the decode rows do not use are each
another weight read.

A native path was measured not to pay on the CPU: torch's `_grouped_mm` over the same sorted rows
ran 0.66-0.81x the speed of this loop at 8-64 rows (docs/BENCHMARKS.md, "Mixture of experts"). An
accelerated backend can supply a grouped-GEMM kernel with the same signature (`ExpertsOp`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

# (x [R, H], top_experts [R, k], top_weights [R, k], gate_up [E, 2I, H], down [E, H, I]) -> [R, H]
ExpertsOp = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def route(router_logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """`(top_experts [R, k], top_weights [R, k])` from the router's logits `[R, E]`; the weights in the
    logits' dtype."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights.to(router_logits.dtype)


def grouped_experts(x: Tensor, top_experts: Tensor, top_weights: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """Σ_k w_k · down_e(silu(gate_e(x)) · up_e(x)) over each row's k experts, one pass per active expert.
    Rows are added in increasing expert order, as transformers does."""
    k = top_experts.shape[1]
    flat = top_experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token = order // k
    weight = top_weights.reshape(-1)[order].unsqueeze(1)
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        idx = token[start:start + n]
        gate, up = F.linear(x[idx], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert]) * weight[start:start + n]
        out.index_add_(0, idx, y.to(out.dtype))
        start += n
    return out
