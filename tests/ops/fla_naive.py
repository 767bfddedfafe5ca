"""Inputs of the gated delta rule as this project's ops take them, and fla-core's own torch references
(`fla/ops/gated_delta_rule/naive.py`), loaded from its file so that
nothing of fla that needs Triton is imported, and wrapped as the varlen `FlaKernels` the adapter calls
(fla's naive functions take a batch of equal-length sequences: varlen runs each sequence as a batch of
one)."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import torch
from torch import Tensor

from raincheck_core.ops.fla_adapter import FlaKernels


def naive_module():
    spec = importlib.util.find_spec("fla")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "gated_delta_rule" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_gated_delta_rule_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def naive_kernels() -> FlaKernels:
    naive = naive_module()

    def varlen(fn, chunked: bool):
        def kernel(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, initial_state: Tensor,
                   output_final_state: bool, cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor]:
            if cu_seqlens is None:      # a batch of equal-length sequences, as fla's kernels take it too
                return call(q, k, v, g, beta, scale, initial_state)
            outs, finals = [], []
            bounds = cu_seqlens.tolist()
            for s, (a, b) in enumerate(itertools.pairwise(bounds)):
                o, final = call(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale,
                                initial_state[s:s + 1])
                outs.append(o)
                finals.append(final)
            return torch.cat(outs, dim=1), torch.cat(finals)

        def call(q, k, v, g, beta, scale, state):
            if chunked:
                return fn(q, k, v, g, beta, chunk_size=16, scale=scale, initial_state=state, output_final_state=True)
            return fn(q, k, v, beta, g, scale=scale, initial_state=state, output_final_state=True)
        return kernel

    return FlaKernels(varlen(naive.naive_chunk_gated_delta_rule, True),
                      varlen(naive.naive_recurrent_gated_delta_rule, False))


def rule_inputs(rows: int, states: int, seed: int, heads: int, dk: int, dv: int) -> tuple[Tensor, ...]:
    """q, k (L2-normalised, q scaled by Dk^-0.5), v `[rows, heads, D]`, g <= 0, beta `[rows, heads]`, and
    `states` states `[states, heads, Dk, Dv]`, seeded."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(rows, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(rows, heads, dk, generator=gen), dim=-1)
    v = torch.randn(rows, heads, dv, generator=gen)
    g, beta = -torch.rand(rows, heads, generator=gen), torch.rand(rows, heads, generator=gen)
    return q, k, v, g, beta, torch.randn(states, heads, dk, dv, generator=gen) / 4
