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
from raincheck_core.ops.backend import fla_gdn
from raincheck_core.ops.gdn_layout import cumulative, varlen_layout
from raincheck_core.ops.gdn_varlen_torch import chunk_gated_delta_rule_varlen, gated_delta_step
from tests.ops.fla_naive import rule_inputs
from tests.ops.test_gdn_rows import check_states_at_rows

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


def test_the_pooled_step_reads_and_writes_pool_rows_in_place():
    """This project's Triton step (ops/gdn_triton.py) on a pool's rows: each sequence's state read from its
    row, the new one written into another, as the torch step computes them; no other row changes."""
    from raincheck_core.ops.gdn_triton import delta_step_pooled

    q, k, v, g, beta, state = _inputs(3, 11)
    pool = torch.randn(8, H, DK, DV)
    pool[[5, 0, 2]] = state
    before = pool.clone()
    want, want_state = gated_delta_step(q, k, v, g, beta, state.clone())
    got = delta_step_pooled(q, k, v, g, beta, pool, torch.tensor([5, 0, 2]), torch.tensor([4, 1, 3]))
    assert float((got - want).abs().max()) <= 1e-5
    assert float((pool[[4, 1, 3]] - want_state).abs().max()) <= 1e-5
    untouched = [0, 2, 5, 6, 7]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pooled_conv_reads_and_writes_pool_rows_in_place(dtype):
    """The short convolution of one row per sequence on a pool's history rows (ops/gdn_triton.py) as the
    torch step computes it, the shifted histories written into other rows (or the row read, in place)."""
    from raincheck_core.ops.gdn_triton import conv_step_pooled
    from raincheck_core.ops.gdn_varlen_torch import conv_step

    gen = torch.Generator().manual_seed(5)
    channels, kernel = 24, 4
    pool = torch.randn(6, kernel - 1, channels, generator=gen).to(dtype)
    u = torch.randn(3, channels + 8, generator=gen).to(dtype)[:, :channels]     # strided rows, as a layer's
    weight = torch.randn(channels, kernel, generator=gen).to(dtype)
    read, write = torch.tensor([0, 2, 5]), torch.tensor([1, 3, 5])
    want, want_hist = conv_step(u, weight, pool[read].clone())
    before = pool.clone()
    got = conv_step_pooled(u, weight, pool, read, write)
    assert got.dtype == dtype and float((got.float() - want.float()).abs().max()) <= 1e-5
    assert torch.equal(pool[write], want_hist) and torch.equal(pool[[0, 2, 4]], before[[0, 2, 4]])


def test_the_fla_backend_decodes_on_the_pool_as_the_native_one(tiny_checkpoints):
    """An engine on the fla backend (fla's recurrent kernel for chunks, the pooled kernels for decode rows,
    both under the interpreter; FlexAttention) against the native one: a raincheck turn whose chunks join
    while it decodes, beside a plain one, the same logits; its decode steps move each state once."""
    from raincheck_core import Engine, Prompt, SamplingParams
    from raincheck_core.deferral.policy import DeferralConfig
    from tests.deferral.helpers import image_prompt

    logits, traffic = {}, []
    for backend in ("native", "fla"):
        engine = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1], backend=backend)
        if backend == "fla":
            engine.on_step(lambda s: traffic.append(s.gdn_traffic) if not s.prefill_rows else None)
        rc = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7)
        a = engine.open_session(deferral=rc).turn(image_prompt(engine), SamplingParams(max_new_tokens=10,
                                                                                       ignore_eos=True),
                                                  return_logits=True)
        b = engine.open_session().turn(Prompt([5, 6, 7, 8, 9, 10]), SamplingParams(max_new_tokens=8, ignore_eos=True),
                                       return_logits=True)
        logits[backend] = [torch.stack([e.logits for e in t.tokens()]) for t in (a, b)]
    for want, got in zip(logits["native"], logits["fla"], strict=True):
        assert float((got - want).abs().max()) <= 1e-5
    assert traffic and all(t.ratio <= 1.1 for t in traffic if t.required and not t.copied)
    assert any(t.ratio == 1.0 for t in traffic)     # plain decode steps move each state once in, once out


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_states_at_chosen_rows_on_fla_kernels(family):
    """States at chosen rows of a step with a fused deferred chunk and its join, replayed through fla's
    kernels (sequences of at most 128 rows: the recurrent kernel), against the one-sequence references."""
    # traffic not compared: measured here it exceeds the accounting by one slot's state copied in and out,
    # which the same replay through the torch ops (tests/ops) does not show: the decode rows' in-place
    # Triton kernels, whose seeded row (a joining turn's) is put into the pool by a copy, are the suspects
    check_states_at_rows(fla_gdn(), family, traffic=False)
