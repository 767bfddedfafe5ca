"""fla's Triton kernels through the adapter, against this project's torch ops: `make test-kernels`
(installs requirements/accel.txt beside the venv and sets TRITON_INTERPRET=1, so the kernels run on the
CPU). Skipped where triton is not importable (`make test`). Only the recurrent kernel runs under the
interpreter (decode rows, and a decode step's fused chunks with their splits): fla's chunk kernel needs
an active GPU driver there; the device script checks it on a GPU
(bench/gpu). Small heads and fp32: the interpreter is slow and has no bf16 dot."""

from __future__ import annotations

import os

import pytest
import torch

from raincheck_core.ops import fla_adapter
from raincheck_core.ops.gdn_layout import cumulative, varlen_layout
from raincheck_core.ops.gdn_varlen_torch import chunk_gated_delta_rule_varlen, gated_delta_step
from tests.ops.fla_naive import rule_inputs

pytestmark = pytest.mark.skipif(not fla_adapter.available() or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="fla's Triton kernels on the CPU: make test-kernels")
H, DK, DV = 2, 16, 16


def _inputs(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """n rows and n states."""
    return rule_inputs(n, n, seed, H, DK, DV)


@pytest.mark.parametrize("rows", [1, 4])
def test_recurrent_kernel_step_matches_the_torch_step(rows):
    q, k, v, g, beta, state = _inputs(rows, rows)
    want_state, got_state = state.clone(), state.clone()
    want, want_state = gated_delta_step(q, k, v, g, beta, want_state)
    got, got_state = fla_adapter.step_rule(fla_adapter.triton_kernels())(q, k, v, g, beta, got_state)
    assert float((got - want).abs().max()) <= 1e-5
    assert float((got_state - want_state).abs().max()) <= 1e-5


def test_recurrent_kernel_varlen_with_initial_states_matches_torch():
    """Several steps of three sequences of different lengths in one varlen call (`cu_seqlens`, initial
    states in sequence order, final states out) against the torch step applied token by token."""
    lengths = [3, 1, 5]
    q, k, v, g, beta, _ = _inputs(sum(lengths), 7)
    state = _inputs(len(lengths), 8)[5]
    kernel = fla_adapter.triton_kernels().recurrent
    o, finals = kernel(q=fla_adapter.to_fla(q), k=fla_adapter.to_fla(k), v=fla_adapter.to_fla(v),
                       g=fla_adapter.to_fla(g), beta=fla_adapter.to_fla(beta), scale=1.0, initial_state=state.clone(),
                       output_final_state=True, cu_seqlens=cumulative(torch.tensor(lengths)))
    row = 0
    for s, n in enumerate(lengths):
        st = state[s:s + 1].clone()
        for t in range(row, row + n):
            want, _ = gated_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], st)
            assert float((fla_adapter.from_fla(o)[t] - want[0]).abs().max()) <= 1e-5
        assert float((finals[s] - st[0]).abs().max()) <= 1e-5
        row += n


def test_a_decode_steps_chunks_with_splits_match_the_torch_rule():
    """Fused chunks (each at most 64 rows: the recurrent kernel) with splits, through the adapter's rule:
    outputs, final states and the states at the splits as the torch rule gives them."""
    lengths, splits = [9, 4, 12], [6, None, 12]
    layout = varlen_layout(lengths, 4, splits)
    q, k, v, g, beta, _ = _inputs(sum(lengths), 3)
    state = _inputs(len(lengths), 4)[5]
    want = chunk_gated_delta_rule_varlen(q, k, v, g, beta, state, layout)
    got = fla_adapter.chunk_rule(fla_adapter.triton_kernels())(q, k, v, g, beta, state, layout)
    for w, x in zip(want, got, strict=True):
        assert float((x - w).abs().max()) <= 1e-5
