"""The fla adapter (ops/fla_adapter.py) against fla-core's naive torch references (no Triton needed) and
against this project's own ops on the same inputs: packed rows to fla's varlen layout, states `[N, H, K,
V]`, log-space gates, q pre-scaled (fla's `scale` = 1), splits run as two passes."""

from __future__ import annotations

import sys

import pytest
import torch

from raincheck_core.engine.padding import CHUNK_BUCKETS
from raincheck_core.errors import InvalidInputError
from raincheck_core.ops import backend, fla_adapter
from raincheck_core.ops.gdn_layout import varlen_layout
from raincheck_core.ops.gdn_varlen_torch import chunk_gated_delta_rule_varlen, gated_delta_step
from tests.ops.fla_naive import naive_kernels, rule_inputs

H, DK, DV = 2, 8, 4


def _inputs(rows: int, states: int, seed: int) -> tuple[torch.Tensor, ...]:
    return rule_inputs(rows, states, seed, H, DK, DV)


@pytest.fixture(scope="module")
def kernels() -> fla_adapter.FlaKernels:
    return naive_kernels()


@pytest.mark.parametrize(("lengths", "splits"), [([20, 5, 37, 9], [None, 3, 30, None]),     # recurrent kernel
                                                 ([80, 6, 9], [71, None, 9])])                # chunk kernel
def test_chunk_rule_matches_the_torch_rule_with_splits(kernels, lengths, splits):
    """Splits: a chunk and its appended lead (the last one without rows after its split)."""
    layout = varlen_layout(lengths, 4, splits)
    q, k, v, g, beta, state = _inputs(sum(lengths), len(lengths), 0)
    want = chunk_gated_delta_rule_varlen(q, k, v, g, beta, state, layout)
    before = state.clone()
    got = fla_adapter.chunk_rule(kernels)(q, k, v, g, beta, state, layout)
    assert torch.equal(state, before)                           # inputs are not modified
    for w, x in zip(want, got, strict=True):
        assert x.shape == w.shape and float((x - w).abs().max()) <= 1e-5


def test_step_rule_matches_the_torch_step(kernels):
    q, k, v, g, beta, state = _inputs(5, 5, 1)
    want_state, got_state = state.clone(), state.clone()
    want, want_state = gated_delta_step(q, k, v, g, beta, want_state)
    got, got_state = fla_adapter.step_rule(kernels)(q, k, v, g, beta, got_state)
    assert float((got - want).abs().max()) <= 1e-5
    assert float((got_state - want_state).abs().max()) <= 1e-5


def test_signs_spaces_and_layouts():
    """g is log space in both (a step with beta = 0 only decays: by e^g, FlashInfer's linear decay); the
    v-first layout SGLang and vLLM keep is the transpose, its own inverse; varlen is batch 1."""
    q, k, v, g, beta, state = _inputs(3, 3, 2)
    decayed = state.clone()
    gated_delta_step(q, k, v, g, torch.zeros_like(beta), decayed)
    assert torch.allclose(decayed, fla_adapter.linear_decay(g)[..., None, None] * state)
    vf = fla_adapter.state_v_first(state)
    assert vf.shape == (3, H, DV, DK) and torch.equal(fla_adapter.state_v_first(vf), state)
    assert fla_adapter.to_fla(q).shape == (1, 3, H, DK) and torch.equal(fla_adapter.from_fla(fla_adapter.to_fla(q)), q)
    runs = varlen_layout([2, 5, 1], 4, [None, 3, None]).runs      # the split sequence: 3 rows, then 2 more
    assert runs.first_cu.tolist() == [0, 2, 5, 6] and runs.first_rows.tolist() == [0, 1, 2, 3, 4, 7]
    assert runs.rest_cu.tolist() == [0, 2] and runs.rest_rows.tolist() == [5, 6]


def test_a_captured_decode_steps_longest_sequence_takes_the_recurrent_kernel(kernels):
    """The largest fused chunk of a captured decode step plus its conv lead (kernel 4: 3 rows) runs on the
    recurrent kernel: the chunk kernel reads back to the host, which a CUDA graph capture cannot hold."""
    def no_chunk_kernel(**_):
        raise AssertionError("a decode step's sequence took the chunk kernel")

    chunk = max(CHUNK_BUCKETS)
    layout = varlen_layout([chunk + 3, 1, 1], 4, [chunk, None, None])
    q, k, v, g, beta, state = _inputs(chunk + 5, 3, 2)
    got = fla_adapter.chunk_rule(fla_adapter.FlaKernels(no_chunk_kernel, kernels.recurrent))(
        q, k, v, g, beta, state, layout)
    for w, x in zip(chunk_gated_delta_rule_varlen(q, k, v, g, beta, state, layout), got, strict=True):
        assert float((x - w).abs().max()) <= 1e-5


@pytest.fixture
def fla_import_fails(monkeypatch):
    """fla present but failing to import (as a triton it does not support would make it)."""
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)
    fla_adapter.import_error.cache_clear()
    yield
    fla_adapter.import_error.cache_clear()


def test_fla_that_fails_to_import_is_not_available_and_auto_falls_back_to_flex(fla_import_fails):
    assert not fla_adapter.available() and "gated_delta_rule" in fla_adapter.import_error()
    assert backend.accelerated_backend() == "flex"
    with pytest.raises(InvalidInputError, match=r"importing them failed: .*gated_delta_rule"):
        backend.select("cpu", torch.float32, torch.float32, (torch.float32, torch.float32), "fla")


def test_fla_backend_without_triton_names_the_extra(monkeypatch):
    monkeypatch.setattr(fla_adapter, "available", lambda: False)
    with pytest.raises(InvalidInputError, match=r"requirements/accel\.txt"):
        backend.select("cpu", torch.float32, torch.float32, (torch.float32, torch.float32), "fla")
    assert backend.accelerated_backend() == "flex"


def test_an_engine_on_the_fla_backend_gives_the_native_turn(tiny_checkpoints, kernels, monkeypatch):
    """The whole `fla` backend (FlexAttention, fla's GDN through the adapter; here on fla's naive
    references) through a fused raincheck turn of the hybrid family: chunks joined mid-answer, tracked
    decode rows, recovery after the answer. Same tokens and logits as the native kernels."""
    from raincheck_core import Engine, SamplingParams
    from raincheck_core.deferral.policy import DeferralConfig
    from tests.deferral.helpers import image_prompt

    monkeypatch.setattr(fla_adapter, "triton_kernels", lambda: kernels)
    folder = tiny_checkpoints["qwen3_5"][1]
    cfg = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=1, chunk_size=7)

    def turn(backend: str) -> torch.Tensor:
        engine = Engine.from_pretrained(folder, backend=backend)
        session = engine.open_session(deferral=cfg)
        events = session.turn(image_prompt(engine, seed=3), SamplingParams(max_new_tokens=6, ignore_eos=True),
                              return_logits=True).tokens()
        session.complete_recovery()
        return torch.stack([e.logits for e in events])

    want, got = turn("native"), turn("fla")
    assert torch.equal(want.argmax(-1), got.argmax(-1)) and float((want - got).abs().max()) <= 1e-5
