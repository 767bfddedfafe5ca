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
from the state after the split, so the join reads both states exactly as from the torch path
(`VarlenLayout.runs`).

`FlaKernels` is the pair of fla functions the rules call: the Triton kernels on a GPU (`triton_kernels`),
or any functions of the same signatures (the tests pass fla's naive torch references, which need no
Triton).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import InvalidInputError
from .gdn_layout import VarlenLayout

Kernel = Callable[..., tuple[Tensor, Tensor]]
# Sequences up to this long take the recurrent kernel: above a captured decode step's longest sequence (the
# largest fused chunk, 63 rows, plus its short-convolution lead of kernel - 1 rows), because the chunk
# kernel reads its chunk indices back to the host, which a CUDA graph capture cannot hold.
RECURRENT_MAX_ROWS = 128


@dataclass(frozen=True)
class FlaKernels:
    """fla's `chunk_gated_delta_rule` and `fused_recurrent_gated_delta_rule`, or functions taking the same
    keywords (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)."""

    chunk: Kernel
    recurrent: Kernel


@functools.cache
def import_error() -> str | None:
    """Why fla's Triton kernels cannot be used here, or None when they imported. Tried once per process: a
    package that is present but fails to import (a triton it does not support, no GPU driver) counts as
    absent, so `auto` falls back to FlexAttention with torch GDN instead of failing every engine."""
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except Exception as e:     # ImportError, or whatever triton raises while fla's modules load
        return f"{type(e).__name__}: {e}"
    return None


def available() -> bool:
    """fla's Triton kernels import here (the `accel` extra: fla-core and triton)."""
    return import_error() is None


def triton_kernels() -> FlaKernels:
    if not available():
        raise InvalidInputError(f"backend 'fla' needs triton and fla-core (pip install -r requirements/accel.txt); "
                                f"importing them failed: {import_error()}")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    return FlaKernels(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)


# ---------------------------------------------------------------- conversions
def to_fla(x: Tensor) -> Tensor:
    """Packed `[R, H, ...]` -> fla's varlen `[1, R, H, ...]`, contiguous."""
    return x.contiguous()[None]


def from_fla(x: Tensor) -> Tensor:
    """fla's varlen `[1, R, H, ...]` -> packed `[R, H, ...]`."""
    return x[0]


def state_v_first(state: Tensor) -> Tensor:
    """This project's (and fla's default) `[N, H, Dk, Dv]` <-> SGLang/vLLM's `[N, H, Dv, Dk]`: its own inverse."""
    return state.transpose(-1, -2)


def linear_decay(g: Tensor) -> Tensor:
    """Log-space gates (fla, this project) -> the linear-space decay FlashInfer's kernels take."""
    return g.float().exp()


# ---------------------------------------------------------------- the rules, as the GDN ops call them
def chunk_rule(kernels: FlaKernels) -> Callable[..., tuple[Tensor, Tensor, Tensor | None]]:
    """`chunk_gated_delta_rule_varlen` (ops/gdn_varlen_torch.py) on fla's kernels: the chunk kernel where
    some sequence is longer than `RECURRENT_MAX_ROWS`, else the recurrent one (a decode step's fused
    chunks: it launches one program per sequence and, unlike the chunk kernel, reads nothing back to the
    host, so a decode step's graph can hold it). The runs come from the layout (`VarlenLayout.runs`),
    built once per step: nothing here moves data between host and device."""

    def rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, layout: VarlenLayout
             ) -> tuple[Tensor, Tensor, Tensor | None]:
        runs = layout.runs
        kernel = kernels.recurrent if layout.seqs.longest <= RECURRENT_MAX_ROWS else kernels.chunk
        qkvgb = (q, k, v, g, beta)
        o = v.new_empty(v.shape, dtype=torch.float32)
        finals = _run(kernel, qkvgb, state, runs.first_rows, runs.first_cu, o)
        if runs.split_seqs is None:
            return o, finals, None
        split_states = finals[runs.split_seqs].clone()
        if len(runs.rest_seqs):
            finals[runs.rest_seqs] = _run(kernel, qkvgb, finals[runs.rest_seqs], runs.rest_rows, runs.rest_cu, o)
        return o, finals, split_states

    return rule


def step_rule(kernels: FlaKernels) -> Callable[..., tuple[Tensor, Tensor]]:
    """`gated_delta_step` (ops/gdn_varlen_torch.py) on fla's recurrent kernel: one token for each of N
    sequences from `state [N, H, Dk, Dv]` (not modified); returns (o `[N, H, Dv]` fp32, the new states fp32,
    fla's own tensor: no copy back). q, k, v go in the model's dtype (the kernel computes in fp32)."""

    def rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        o, final = kernels.recurrent(q=q[:, None], k=k[:, None], v=v[:, None], g=g[:, None].float(),
                                     beta=beta[:, None].float(), scale=1.0, initial_state=state,
                                     output_final_state=True)
        return o[:, 0].float(), final.float()

    return rule


def _run(kernel: Kernel, qkvgb: tuple[Tensor, ...], initial: Tensor, rows: Tensor, cu: Tensor, o: Tensor
         ) -> Tensor:
    """One varlen call over the runs at packed `rows` (`cu`: fla's cu_seqlens) from `initial` states;
    writes their outputs into `o` at those rows and returns the final states `[N, H, Dk, Dv]` fp32."""
    # q, k, v in the model's dtype, gates and states fp32, as fla's kernels take them (they compute in fp32)
    q, k, v, g, beta = (to_fla(t[rows]) for t in qkvgb)
    out, finals = kernel(q=q, k=k, v=v, g=g.float(), beta=beta.float(), scale=1.0, initial_state=initial,
                         output_final_state=True, cu_seqlens=cu)
    o[rows] = from_fla(out).float()
    return finals.float()
