"""Gated DeltaNet on flash-linear-attention's kernels: every layout, sign and space conversion in one place.

This project's GDN ops (ops/gdn_varlen.py) hand the delta rule packed rows `[R, H, D]` (q, k already
L2-normalised, q already scaled by Dk^-0.5, both expanded to the value heads), gates `g [R, H]` in log
space (a token decays the state by e^g, g <= 0) and states `[N, H, Dk, Dv]` fp32. fla-core's kernels
(`fla.ops.gated_delta_rule`) take batch-first `[B, T, H, D]`, varlen as batch 1 with `cu_seqlens` of N+1
and `initial_state` in sequence order, `g` in log space too (FlashInfer's GDN kernels take linear space:
`decay_linear`), a `scale` they apply to q (1.0 here: q arrives scaled), and states `[N, H, K, V]`
(`state_v_first=False`; SGLang and vLLM keep `[slots, H, V, K]`: `state_v_first`).

fla's kernels return final states only. A sequence with a split (a deferred chunk and its appended conv
lead, ops/gdn_varlen.py) runs as two: its first `split` rows with every other sequence, then the rest
from the state after the split, so the join reads both states exactly as from the torch path.

`FlaKernels` is the pair of fla functions the rules call: the Triton kernels on a GPU (`triton_kernels`),
or any functions of the same signatures (the tests pass fla's naive torch references, which need no
Triton).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import InvalidInputError
from .gdn_varlen import VarlenLayout

Kernel = Callable[..., tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class FlaKernels:
    """fla's `chunk_gated_delta_rule` and `fused_recurrent_gated_delta_rule`, or functions taking the same
    keywords (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)."""

    chunk: Kernel
    recurrent: Kernel


def available() -> bool:
    """fla's Triton kernels can be imported here (the `accel` extra: fla-core and triton)."""
    return all(importlib.util.find_spec(m) is not None for m in ("triton", "fla"))


def triton_kernels() -> FlaKernels:
    if not available():
        raise InvalidInputError("backend 'fla' needs triton and fla-core (pip install -r requirements/accel.txt)")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    return FlaKernels(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)


# ---------------------------------------------------------------- conversions
def to_fla(x: Tensor) -> Tensor:
    """Packed `[R, H, ...]` -> fla's varlen `[1, R, H, ...]`, contiguous."""
    return x.contiguous()[None]


def from_fla(x: Tensor) -> Tensor:
    """fla's varlen `[1, R, H, ...]` -> packed `[R, H, ...]`."""
    return x[0]


def cu_seqlens(lengths: Tensor, device: torch.device | str) -> Tensor:
    """Sequence lengths `[N]` -> fla's `cu_seqlens` `[N + 1]` (int64: 0, ends...)."""
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(device=device, dtype=torch.long)


def state_v_first(state: Tensor) -> Tensor:
    """This project's (and fla's default) `[N, H, Dk, Dv]` <-> SGLang/vLLM's `[N, H, Dv, Dk]`: its own inverse."""
    return state.transpose(-1, -2)


def linear_decay(g: Tensor) -> Tensor:
    """Log-space gates (fla, this project) -> the linear-space decay FlashInfer's kernels take."""
    return g.float().exp()


# ---------------------------------------------------------------- the rules, as the GDN ops call them
def chunk_rule(kernels: FlaKernels) -> Callable[..., tuple[Tensor, Tensor, Tensor | None]]:
    """`chunk_gated_delta_rule_varlen` (ops/gdn_varlen_torch.py) on fla's chunk kernel."""

    def rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, layout: VarlenLayout
             ) -> tuple[Tensor, Tensor, Tensor | None]:
        lens, splits = layout.seqs.seq_len, layout.seqs.split_row
        starts = torch.cat([lens.new_zeros(1), lens.cumsum(0)[:-1]])
        first = torch.where(splits >= 0, splits, lens)             # rows of each sequence's first run
        o = v.new_empty(v.shape[0], v.shape[1], v.shape[2], dtype=torch.float32)
        finals = _run(kernels.chunk, (q, k, v, g, beta), state, _rows(starts, first), first, o)
        split_ids = (splits >= 0).nonzero().flatten()
        if not len(split_ids):
            return o, finals, None
        split_states = finals[split_ids.to(finals.device)].clone()
        rest = (lens - first)[split_ids]
        more = (rest > 0).nonzero().flatten()
        if len(more):
            ids = split_ids[more]
            at = ids.to(finals.device)
            finals[at] = _run(kernels.chunk, (q, k, v, g, beta), finals[at],
                              _rows(starts[ids] + first[ids], rest[more]), rest[more], o)
        return o, finals, split_states

    return rule


def step_rule(kernels: FlaKernels) -> Callable[..., Tensor]:
    """`gated_delta_step` (ops/gdn_varlen_torch.py) on fla's recurrent kernel: one token for each of N
    sequences, `state [N, H, Dk, Dv]` updated in place; returns o `[N, H, Dv]` fp32."""

    def rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
        o, final = kernels.recurrent(q=q[:, None].float(), k=k[:, None].float(), v=v[:, None].float(),
                                     g=g[:, None].float(), beta=beta[:, None].float(), scale=1.0,
                                     initial_state=state, output_final_state=True)
        state.copy_(final)
        return o[:, 0].float()

    return rule


def _rows(starts: Tensor, lengths: Tensor) -> Tensor:
    """The packed rows of runs starting at `starts` of `lengths` rows, run after run."""
    return torch.repeat_interleave(starts - torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]]), lengths) \
        + torch.arange(int(lengths.sum()))


def _run(kernel: Kernel, qkvgb: tuple[Tensor, ...], initial: Tensor, rows: Tensor, lengths: Tensor, o: Tensor
         ) -> Tensor:
    """One varlen call over the runs at `rows` (of `lengths`) from `initial` states; writes their outputs
    into `o` at those rows and returns the final states `[N, H, Dk, Dv]` fp32."""
    at = rows.to(o.device)
    q, k, v, g, beta = (to_fla(t[at].float()) for t in qkvgb)
    out, finals = kernel(q=q, k=k, v=v, g=g, beta=beta, scale=1.0, initial_state=initial.float().contiguous(),
                         output_final_state=True, cu_seqlens=cu_seqlens(lengths, o.device))
    o[at] = from_fla(out).float()
    return finals.float()
