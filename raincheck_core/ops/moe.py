"""Mixture-of-experts ops over a step's packed rows: routing and the grouped expert matmul.

`route` is the top-k router of Qwen3-VL-MoE and Qwen3.5-MoE as transformers computes it (softmax in
fp32 over all experts, top-k, the k weights renormalised to sum to 1). The expert op sorts the step's
(row, expert) pairs by expert and runs each active expert once over all of its rows, then adds the
weighted outputs back into their rows. Its cost grows with the number of distinct experts a step
touches: the rows of a fused deferred chunk that route to experts the decode rows do not use are each
another weight read.

Two implementations (`ExpertsOp`): `grouped_experts`, the torch loop (one gate/up and one down matmul
per active expert), and `grouped_mm_experts`, one `torch._grouped_mm` per projection over all the
experts' row groups. On the CPU the grouped GEMM measured 1.2-1.7x the loop's speed at 8-64 rows
(three runs) and 1.0-1.1x at one row (`python -m bench.moe`, docs/BENCHMARKS.md "Mixture of experts"),
so the CPU backend takes it where torch has it (ops/backend.py); an accelerated backend can bring its
own kernel.
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


def grouped_mm_experts(x: Tensor, top_experts: Tensor, top_weights: Tensor, gate_up: Tensor, down: Tensor
                       ) -> Tensor:
    """As `grouped_experts`, with one grouped GEMM per projection (`torch._grouped_mm`, whose groups
    are the experts' runs of sorted rows; an expert with no rows is an empty group). Widths whose rows
    are not 16-byte aligned, which the grouped GEMM refuses, take the loop."""
    if any(d * x.element_size() % 16 for d in down.shape[1:]):
        return grouped_experts(x, top_experts, top_weights, gate_up, down)
    k = top_experts.shape[1]
    flat = top_experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ends = torch.cumsum(torch.bincount(flat, minlength=gate_up.shape[0]), 0).to(torch.int32)
    token = order // k
    gate, up = torch._grouped_mm(x[token], gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=ends)
    y = y * top_weights.reshape(-1)[order].unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


def grouped_mm_available(device: torch.device | str) -> bool:
    """torch's grouped GEMM on this device: the CPU, in torch builds that have it."""
    return torch.device(device).type == "cpu" and hasattr(torch, "_grouped_mm")
