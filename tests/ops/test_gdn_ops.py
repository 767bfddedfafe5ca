"""GDN ops against transformers' own torch fallbacks (Qwen3.5 in transformers 5.23.0)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from raincheck_core.ops.gdn import (
    causal_conv1d,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
    replay,
    split_qkv,
)

# Dk != Dv so that a swapped state layout cannot pass by accident.
H, DK, DV = 4, 32, 24
TOKEN_COUNTS = [1, 5, 64, 70, 130]


def _raw_inputs(t: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Un-normalised q, k as the conv emits them, v, g ≤ 0 (mixed fast and slow heads), beta, state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, H, DK, generator=gen)
    k = torch.randn(t, H, DK, generator=gen)
    v = torch.randn(t, H, DV, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(t, H, generator=gen)) * torch.tensor([0.01, 0.1, 1.0, 3.0])
    beta = torch.rand(t, H, generator=gen)
    state = torch.randn(H, DK, DV, generator=gen)
    return q, k, v, g, beta, state


def _prepared(t: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The same inputs the way our kernels take them: q, k L2-normalised, q scaled by Dk^-0.5."""
    q, k, v, g, beta, state = _raw_inputs(t, seed)
    return l2norm(q) * DK**-0.5, l2norm(k), v, g, beta, state


def _hf(fn, t: int, seed: int) -> tuple[Tensor, Tensor]:
    """transformers' kernel on the raw inputs (it normalises q, k and scales q itself), batch of 1."""
    q, k, v, g, beta, state = _raw_inputs(t, seed)
    o, s = fn(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return o[0], s[0]


def _max_diff(a: Tensor, b: Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("t", TOKEN_COUNTS)
def test_recurrent_matches_transformers(t: int) -> None:
    o, s = recurrent_gated_delta_rule(*_prepared(t, seed=t))
    o_ref, s_ref = _hf(hf.torch_recurrent_gated_delta_rule, t, seed=t)
    assert o.dtype == s.dtype == torch.float32
    assert o.shape == (t, H, DV) and s.shape == (H, DK, DV)
    assert _max_diff(o, o_ref) <= 1e-5
    assert _max_diff(s, s_ref) <= 1e-5


@pytest.mark.parametrize("t", TOKEN_COUNTS)
def test_chunk_matches_transformers(t: int) -> None:
    o, s = chunk_gated_delta_rule(*_prepared(t, seed=t))
    o_ref, s_ref = _hf(hf.torch_chunk_gated_delta_rule, t, seed=t)
    assert o.shape == (t, H, DV) and s.shape == (H, DK, DV)
    assert _max_diff(o, o_ref) <= 1e-5
    assert _max_diff(s, s_ref) <= 1e-5


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("t", TOKEN_COUNTS)
def test_chunk_matches_recurrent(t: int, chunk_size: int) -> None:
    """With a non-zero initial state; T = 70, 130 also check that the padded tail leaves the state alone."""
    inputs = _prepared(t, seed=1000 + t)
    o, s = chunk_gated_delta_rule(*inputs, chunk_size=chunk_size)
    o_ref, s_ref = recurrent_gated_delta_rule(*inputs)
    assert _max_diff(o, o_ref) <= 1e-5
    assert _max_diff(s, s_ref) <= 1e-5


def test_chunk_split_equals_one_pass() -> None:
    """Chunked prefill: 45 tokens then 85 from the carried state equals 130 at once."""
    q, k, v, g, beta, state = _prepared(130, seed=5)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, state)
    o1, s1 = chunk_gated_delta_rule(q[:45], k[:45], v[:45], g[:45], beta[:45], state)
    o2, s2 = chunk_gated_delta_rule(q[45:], k[45:], v[45:], g[45:], beta[45:], s1)
    assert _max_diff(torch.cat([o1, o2]), o) <= 1e-5
    assert _max_diff(s2, s) <= 1e-5


@pytest.mark.parametrize("fn", [recurrent_gated_delta_rule, chunk_gated_delta_rule])
def test_zero_tokens_and_no_state(fn) -> None:
    q, k, v, g, beta, state = _prepared(6, seed=6)
    o, s = fn(q[:0], k[:0], v[:0], g[:0], beta[:0], state)
    assert o.shape == (0, H, DV)
    assert torch.equal(s, state)
    o_none, s_none = fn(q, k, v, g, beta, None)
    o_zero, s_zero = fn(q, k, v, g, beta, torch.zeros_like(state))
    assert torch.equal(o_none, o_zero) and torch.equal(s_none, s_zero)


@pytest.mark.parametrize("fn", [recurrent_gated_delta_rule, chunk_gated_delta_rule])
def test_inputs_not_modified(fn) -> None:
    inputs = _prepared(70, seed=8)
    copies = [x.clone() for x in inputs]
    fn(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(inputs, copies, strict=True))


def test_l2norm_matches_transformers() -> None:
    x = torch.randn(7, H, DK)
    assert torch.equal(l2norm(x), hf.l2norm(x, dim=-1, eps=1e-6))


# --- causal conv ---------------------------------------------------------------------------------------

C, K = 48, 4


def _conv_inputs(t: int, dtype: torch.dtype, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, C, generator=gen).to(dtype)
    weight = torch.randn(C, K, generator=gen).to(dtype)
    history = torch.randn(K - 1, C, generator=gen).to(dtype)
    return x, weight, history


def _hf_prefill(x: Tensor, weight: Tensor, history: Tensor | None) -> tuple[Tensor, Tensor]:
    """transformers' prefill: cat(cached K columns, x), causal conv, keep the last T; cache the last K."""
    t = x.shape[0]
    u = x.t()[None]
    if history is None:
        full = torch.nn.functional.pad(u, (max(K - t, 0), 0))  # the cache left-pads a short prompt
    else:
        # The cache holds K columns but only the last K-1 are read; the first is arbitrary.
        full = torch.cat([torch.full((1, C, 1), 123.0, dtype=x.dtype), history.t()[None], u], dim=-1)
    out = hf.causal_conv1d_fn(full, weight, None, activation=None)[..., -t:]
    return out[0].t(), full[..., -K:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 2, 3, 7, 16, 17, 64])
@pytest.mark.parametrize("with_history", [False, True])
def test_conv_matches_transformers_prefill(t: int, dtype: torch.dtype, with_history: bool) -> None:
    x, weight, history = _conv_inputs(t, dtype, seed=t)
    history = history if with_history else None
    out, new_history = causal_conv1d(x, weight, history)
    out_ref, cache_ref = _hf_prefill(x, weight, history)
    assert out.dtype == dtype and out.shape == (t, C)
    assert torch.equal(out, out_ref)
    assert torch.equal(new_history, cache_ref[0, :, 1:].t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_prefill_then_decode_equals_one_pass(dtype: torch.dtype) -> None:
    """Prefill 7 then 6 single tokens equals one pass over 13, and equals transformers' decode update."""
    x, weight, _ = _conv_inputs(13, dtype, seed=42)
    whole, whole_history = causal_conv1d(x, weight, None)

    out, history = causal_conv1d(x[:7], weight, None)
    _, hf_cache = _hf_prefill(x[:7], weight, None)
    outs = [out]
    for i in range(7, 13):
        out, history = causal_conv1d(x[i : i + 1], weight, history)
        # causal_conv1d_update updates the K-column cache in place and convolves the new window.
        out_ref = hf.causal_conv1d_update(x[i : i + 1].t()[None], hf_cache, weight, None, None)
        assert torch.equal(out, out_ref[0].t())
        assert torch.equal(history, hf_cache[0, :, 1:].t())
        outs.append(out)
    assert torch.equal(torch.cat(outs), whole)
    assert torch.equal(history, whole_history)


def test_conv_weight_dtype_governs() -> None:
    """bf16 activations with an fp32 weight convolve in fp32 and return bf16, as transformers does."""
    x, weight, history = _conv_inputs(20, torch.bfloat16, seed=3)
    weight = weight.float()
    for t in (1, 20):
        out, _ = causal_conv1d(x[:t], weight, history)
        full = torch.cat([torch.zeros(1, C, 1, dtype=x.dtype), history.t()[None], x[:t].t()[None]], dim=-1)
        out_ref = hf.causal_conv1d_fn(full, weight, None, activation=None)[..., -t:]
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, out_ref[0].t())


@pytest.mark.parametrize("rows", [0, 1, 3, 9])
def test_replay_is_the_sequence_run_at_once(rows: int) -> None:
    """Recorded rows run again (the hand-off's lead re-run, a follow-up's input factors): the state after
    each of the first `rows` rows is, to the bit, the state the rule leaves after those rows in one call;
    k per key head and v as the rule read them; the history after every row."""
    key_heads, t = 2, 9
    channels = 2 * key_heads * DK + H * DV
    gen = torch.Generator().manual_seed(5)
    u, weight = torch.randn(t, channels, generator=gen), torch.randn(channels, K, generator=gen)
    history = torch.randn(K - 1, channels, generator=gen)
    _, _, _, g, beta, state = _raw_inputs(t, seed=6)
    run = replay(u, g, beta, weight, history, state, key_heads, rows)
    conv, expected_history = causal_conv1d(u, weight, history)
    q, k, v = split_qkv(conv, key_heads, DK, H, DV)
    assert torch.equal(run.history, expected_history)
    assert torch.equal(run.k, k[:, ::H // key_heads]) and torch.equal(run.v, v)
    assert (run.states is None) == (rows == 0)
    for j in range(rows):
        _, after = recurrent_gated_delta_rule(q[:j + 1], k[:j + 1], v[:j + 1], g[:j + 1], beta[:j + 1], state)
        assert torch.equal(run.states[j], after)
