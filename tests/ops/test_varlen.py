"""Packed (varlen) ops against their one-sequence references: many sequences in one call give each
sequence what it would get alone (fp32)."""

from __future__ import annotations

import pytest
import torch

from raincheck_core.deferral.visibility import deferred_mask
from raincheck_core.ops import backend, native
from raincheck_core.ops.attention import attention_layout, reference_attention, varlen_attention
from raincheck_core.ops.gdn import causal_conv1d, l2norm, recurrent_gated_delta_rule, split_qkv
from raincheck_core.ops.gdn_layout import varlen_layout
from raincheck_core.ops.gdn_varlen_torch import (
    causal_conv1d_varlen,
    chunk_gated_delta_rule_varlen,
    conv_step,
    gated_delta_step,
)
from raincheck_core.ops.native import paged_attention_available
from tests.ops.fla_naive import naive_kernels

H, DK, DV, C, K = 4, 32, 24, 40, 4          # Dk != Dv: a swapped state layout cannot pass


def _gdn_inputs(r: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(r, H, DK, generator=g)) * DK**-0.5
    k = l2norm(torch.randn(r, H, DK, generator=g))
    v = torch.randn(r, H, DV, generator=g)
    gate = -torch.nn.functional.softplus(torch.randn(r, H, generator=g)) * torch.tensor([0.01, 0.1, 1.0, 3.0])
    beta = torch.rand(r, H, generator=g)
    return q, k, v, gate, beta, torch.randn(n, H, DK, DV, generator=g)


@pytest.mark.parametrize(("lengths", "splits"), [
    ([5, 1, 70, 130, 3, 64], [3, None, None, 100, None, 60]),   # a split at a block end, one inside a block
    ([31, 3], [28, None]),                                       # a deferred chunk with its 3-row lead
    ([7], [7]),                                                  # a split at the end: the final state twice
])
def test_chunked_rule_over_packed_sequences_equals_each_alone(lengths, splits):
    q, k, v, g, beta, s0 = _gdn_inputs(sum(lengths), len(lengths), seed=len(lengths))
    layout = varlen_layout(lengths, K, splits)
    out, finals, split_states = chunk_gated_delta_rule_varlen(q, k, v, g, beta, s0, layout)
    at, j = 0, 0
    for i, n in enumerate(lengths):
        rows = slice(at, at + n)
        ref_o, ref_s = recurrent_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], s0[i])
        assert float((out[rows] - ref_o).abs().max()) <= 1e-5
        assert float((finals[i] - ref_s).abs().max()) <= 1e-5
        if splits[i] is not None:
            m = slice(at, at + splits[i])
            _, ref_split = recurrent_gated_delta_rule(q[m], k[m], v[m], g[m], beta[m], s0[i])
            assert float((split_states[j] - ref_split).abs().max()) <= 1e-5
            j += 1
        at += n


@pytest.mark.parametrize(("lengths", "appended", "splits"), [
    ([5, 1, 70, 130, 3, 64], [0, 0, 0, 0, 0, 0], [3, None, None, 100, None, 60]),
    ([28, 9], [3, 0], [28, None]),                      # a deferred chunk with its 3-row lead appended
    ([7, 1], [0, 1], [7, 1]),                           # a split at the end; one inside the history
])
@pytest.mark.parametrize("use_native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize(("dk", "dv"), [(32, 24), (21, 48)], ids=["dv-rows", "dv-tiles"])
def test_gated_deltanet_over_packed_sequences_equals_each_alone(lengths, appended, splits, use_native, dk, dv):
    """Conv, SiLU, q/k normalisation and the delta rule, by the native kernel or the torch ops, against
    each sequence alone through the one-sequence references. The step's rows are read in a shuffled order
    through the layout's source map from strided rows, appended rows from `extra`; outputs land at the step rows, the
    appended rows' nowhere; input histories and states are untouched. Head sizes: Dk != Dv, and the
    native join's two paths (Dv not a whole number of its 16-column tiles; whole tiles with Dk not a whole
    number of its row tiles)."""
    if use_native and not native.gated_deltanet_available("cpu", torch.float32):
        pytest.skip("the native kernel cannot be built here (no C compiler)")
    ops = backend.NATIVE_GDN if use_native else backend.TORCH_GDN
    key_heads, heads = 2, 4                                       # two value heads per key head
    channels = 2 * key_heads * dk + heads * dv
    gen = torch.Generator().manual_seed(sum(lengths))
    step_rows, extra_rows = sum(lengths), sum(appended)
    wide = torch.randn(step_rows, channels + 5, generator=gen)
    u = wide[:, 2:2 + channels]                                   # rows of unit stride, 5 floats apart
    g = -torch.nn.functional.softplus(torch.randn(step_rows, heads, generator=gen))
    beta = torch.rand(step_rows, heads, generator=gen)
    extra = (torch.randn(extra_rows, channels, generator=gen),
             -torch.nn.functional.softplus(torch.randn(extra_rows, heads, generator=gen)),
             torch.rand(extra_rows, heads, generator=gen)) if extra_rows else None
    w = torch.randn(channels, K, generator=gen) / 2
    # the pools hold more slots than the step reads, and sequence i starts from slot slots[i]
    conv_pool = torch.randn(len(lengths) + 3, K - 1, channels, generator=gen)
    ssm_pool = torch.randn(len(lengths) + 3, heads, dk, dv, generator=gen)
    slots = torch.randperm(len(lengths) + 3, generator=gen)[:len(lengths)].tolist()
    hist, s0 = conv_pool[slots], ssm_pool[slots]
    # every split sequence also drives a join of the live state in another slot
    joins = [(i, (slots[i] + 1) % (len(lengths) + 3)) for i, split in enumerate(splits) if split is not None]
    p = torch.randn(len(joins), heads, dk, dk, generator=gen) / dk
    s_ref = torch.randn(len(joins), heads, dk, dv, generator=gen)
    order = torch.randperm(step_rows, generator=gen)              # sequence i's rows are order[at:at + n]
    source, at, e = [], 0, 0
    for n, a in zip(lengths, appended, strict=True):
        source += [*order[at:at + n].tolist(), *range(-1 - e, -1 - e - a, -1)]
        at, e = at + n, e + a
    before = (conv_pool.clone(), ssm_pool.clone())
    out = torch.full((step_rows, heads, dv), float("nan"))
    layout = varlen_layout([n + a for n, a in zip(lengths, appended, strict=True)], K, splits,
                           source=torch.tensor(source), slots=slots, joins=joins)
    finals, split_states, tails, split_tails, corrected = ops.varlen(
        u, g, beta, extra, w, conv_pool, ssm_pool, layout, key_heads, dk, out, (p, s_ref))
    assert torch.equal(conv_pool, before[0]) and torch.equal(ssm_pool, before[1])
    for j, (i, live) in enumerate(joins):   # the join: live + P (S_lead' - S_lead), P on the left
        expected = ssm_pool[live] + p[j] @ (finals[i] - s_ref[j])
        assert float((corrected[j] - expected).abs().max()) <= 1e-5
    at, e, j = 0, 0, 0
    for i, (n, a) in enumerate(zip(lengths, appended, strict=True)):
        rows = order[at:at + n]
        xs = [u[rows], g[rows], beta[rows]]
        if a:
            xs = [torch.cat([x, ex[e:e + a]]) for x, ex in zip(xs, extra, strict=True)]

        def alone(m: int, i: int = i, xs: list = xs):
            conv, tail = causal_conv1d(xs[0][:m], w, hist[i])
            q, k, v = split_qkv(conv, key_heads, dk, heads, dv)
            o, state = recurrent_gated_delta_rule(q, k, v, xs[1][:m], xs[2][:m], s0[i])
            return o, state, tail
        ref_o, ref_s, ref_tail = alone(n + a)
        assert float((out[rows] - ref_o[:n]).abs().max()) <= 1e-5
        assert float((finals[i] - ref_s).abs().max()) <= 1e-5
        assert float((tails[i] - ref_tail).abs().max()) <= 1e-6
        if splits[i] is not None:
            _, split_s, split_tail = alone(splits[i])
            assert float((split_states[j] - split_s).abs().max()) <= 1e-5
            assert float((split_tails[j] - split_tail).abs().max()) <= 1e-6
            j += 1
        at, e = at + n, e + a


@pytest.mark.parametrize("rule", ["torch", "fla"])
def test_idle_rows_change_no_state(rule):
    """A padded step's joined chunk (engine/gdn_inputs.py): its 5 rows, its fill's 3 (idle), its lead's 2
    and a third lead row it does not have (idle), beside a plain sequence: the states and histories at the
    split and after the sequence, the join and the live rows' outputs are those of the sequence without
    its idle rows, on the torch rule and on fla's (its naive references)."""
    ops = backend.TORCH_GDN if rule == "torch" else backend.fla_gdn(naive_kernels())
    key_heads, heads, dk, dv = 2, 4, 8, 8
    channels = 2 * key_heads * dk + heads * dv
    gen = torch.Generator().manual_seed(3)
    u, extra_u = torch.randn(12, channels, generator=gen), torch.randn(3, channels, generator=gen)
    g, extra_g = (-torch.nn.functional.softplus(torch.randn(n, heads, generator=gen)) for n in (12, 3))
    beta, extra_beta = torch.rand(12, heads, generator=gen), torch.rand(3, heads, generator=gen)
    w = torch.randn(channels, K, generator=gen) / 2
    conv_pool, ssm_pool = torch.randn(4, K - 1, channels, generator=gen), torch.randn(4, heads, dk, dv, generator=gen)
    maps = (torch.randn(1, heads, dk, dk, generator=gen) / dk, torch.randn(1, heads, dk, dv, generator=gen))

    def run(lengths, split, source, live):
        out = torch.zeros(12, heads, dv)
        layout = varlen_layout(lengths, K, [split, None], source=source, slots=[1, 2], joins=[(0, 3)], live=live)
        states = ops.varlen(u, g, beta, (extra_u, extra_g, extra_beta), w, conv_pool, ssm_pool, layout, key_heads,
                            dk, out, maps)
        return out, states

    plain = [8, 9, 10, 11]
    want_out, want = run([7, 4], 5, [0, 1, 2, 3, 4, -1, -2, *plain], None)
    got_out, got = run([11, 4], 8, [0, 1, 2, 3, 4, 5, 6, 7, -1, -2, -3, *plain],
                       [True] * 5 + [False] * 3 + [True] * 2 + [False] + [True] * 4)
    for x, y in zip(want, got, strict=True):
        assert float((x - y).abs().max()) <= 1e-5
    live_rows = [0, 1, 2, 3, 4, *plain]
    assert float((want_out[live_rows] - got_out[live_rows]).abs().max()) <= 1e-5


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode-step", "rows-among-others"])
@pytest.mark.parametrize("use_native", [False, True], ids=["torch", "native"])
def test_one_row_sequences_equal_each_alone_from_slots_or_seeds(decode_only, use_native):
    """Decode rows: each from its pool slot, or from a seed state / seed history (a live state a join just
    corrected); outputs at their step rows, factors (k per key head, v) as the delta rule read them."""
    if use_native and not native.gated_deltanet_available("cpu", torch.float32):
        pytest.skip("the native kernel cannot be built here (no C compiler)")
    ops = backend.NATIVE_GDN if use_native else backend.TORCH_GDN
    key_heads, dk, heads, dv = 2, 32, 4, 24
    channels = 2 * key_heads * dk + heads * dv
    gen = torch.Generator().manual_seed(3)
    n = 5
    step = n if decode_only else n + 4
    rows = list(range(n)) if decode_only else [6, 0, 3, 8, 2]
    u = torch.randn(step, channels, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(step, heads, generator=gen))
    beta = torch.rand(step, heads, generator=gen)
    w = torch.randn(channels, K, generator=gen) / 2
    conv_pool, ssm_pool = torch.randn(9, K - 1, channels, generator=gen), torch.randn(9, heads, dk, dv, generator=gen)
    seed_hist, seed_state = torch.randn(2, K - 1, channels, generator=gen), torch.randn(3, heads, dk, dv, generator=gen)
    slots, hist_at, state_at = [4, 1, 7, 0, 8], [-1, 1, -1, -1, 0], [2, 0, -1, -1, -1]
    layout = varlen_layout([1] * n, K, source=rows, slots=slots, seeds=(hist_at, state_at))
    before = (conv_pool.clone(), ssm_pool.clone())
    out = torch.full((step, heads, dv), float("nan"))
    tails, finals, (k_f, v_f) = ops.rows(u, g, beta, w, conv_pool, ssm_pool, layout, key_heads, dk, out,
                                         (seed_hist, seed_state), factors=True)
    assert torch.equal(conv_pool, before[0]) and torch.equal(ssm_pool, before[1])
    for s, row in enumerate(rows):
        h0 = seed_hist[hist_at[s]] if hist_at[s] >= 0 else conv_pool[slots[s]]
        s0 = seed_state[state_at[s]] if state_at[s] >= 0 else ssm_pool[slots[s]]
        conv, tail = causal_conv1d(u[row:row + 1], w, h0)
        q, k, v = split_qkv(conv, key_heads, dk, heads, dv)
        o, state = recurrent_gated_delta_rule(q, k, v, g[row:row + 1], beta[row:row + 1], s0)
        assert float((out[row] - o[0]).abs().max()) <= 1e-5
        assert float((finals[s] - state).abs().max()) <= 1e-5
        assert float((tails[s] - tail).abs().max()) <= 1e-6
        # k per key head (value heads 2a and 2a + 1 read key head a)
        assert float((k_f[s] - k[0, ::2]).abs().max()) <= 1e-6 and float((v_f[s] - v[0]).abs().max()) <= 1e-6
    untouched = [r for r in range(step) if r not in rows]
    assert bool(out[untouched].isnan().all())


def test_conv_over_packed_sequences_equals_each_alone():
    lengths, splits = [5, 1, 70, 2], [3, None, None, 1]
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(sum(lengths), C, generator=gen), torch.randn(C, K, generator=gen)
    hist = torch.randn(len(lengths), K - 1, C, generator=gen)
    out, tails, split_tails = causal_conv1d_varlen(x, w, hist, varlen_layout(lengths, K, splits))
    at, j = 0, 0
    for i, n in enumerate(lengths):
        ref, ref_tail = causal_conv1d(x[at:at + n], w, hist[i])
        assert float((out[at:at + n] - ref).abs().max()) <= 1e-6
        assert torch.equal(tails[i], ref_tail)
        if splits[i] is not None:
            _, ref_split = causal_conv1d(x[at:at + splits[i]], w, hist[i])
            assert torch.equal(split_tails[j], ref_split)
            j += 1
        at += n
    one, one_tails = conv_step(x[:3], w, hist[:3])                # one row of each of 3 sequences
    for i in range(3):
        ref, ref_tail = causal_conv1d(x[i:i + 1], w, hist[i])
        assert float((one[i] - ref[0]).abs().max()) <= 1e-6 and torch.equal(one_tails[i], ref_tail)


def test_batched_recurrent_step_equals_each_alone_and_updates_in_place():
    q, k, v, g, beta, s0 = _gdn_inputs(7, 7, seed=3)
    state = s0.clone()
    out, new = gated_delta_step(q, k, v, g, beta, state)
    assert new is state
    for i in range(7):
        ref_o, ref_s = recurrent_gated_delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], s0[i])
        assert float((out[i] - ref_o[0]).abs().max()) <= 1e-5
        assert float((state[i] - ref_s).abs().max()) <= 1e-5


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_attention_over_packed_segments_equals_each_alone(native):
    """Decode rows, short chunks and a long prefill in one call; a deferred chunk's read list leaves out
    GEN slots, which must equal the dense visibility mask of docs/mechanism.md §4. Decode rows run in the
    native kernel where it is built, or the batched torch path."""
    if native and not paged_attention_available("cpu", torch.float32):
        pytest.skip("the native kernel cannot be built here (no C compiler)")
    gen = torch.Generator().manual_seed(1)
    kv, heads, d, slots = 2, 6, 16, 600
    k_cache, v_cache = torch.randn(slots, kv, d, generator=gen), torch.randn(slots, kv, d, generator=gen)
    perm = torch.randperm(slots, generator=gen)
    q_lens, pasts = [1, 5, 1, 70, 7, 1], [40, 0, 3, 20, 30, 0]
    reads, writes, at = [], [], 0
    for n, past in zip(q_lens, pasts, strict=True):
        reads.append(perm[at:at + past + n])
        writes.append(reads[-1][past:])
        at += past + n
    generated = torch.zeros(pasts[4], dtype=torch.bool)
    generated[[3, 17, 18]] = True                                 # the chunk of segment 4 must not see these
    full_read_4 = reads[4]
    reads[4] = torch.cat([full_read_4[:pasts[4]][~generated], full_read_4[pasts[4]:]])
    rows = sum(q_lens)
    q = torch.randn(rows, heads, d, generator=gen)
    k, v = torch.randn(rows, kv, d, generator=gen), torch.randn(rows, kv, d, generator=gen)
    layout = attention_layout(q_lens, reads, torch.cat(writes), native=native)
    assert (layout.paged is not None) == native
    out = varlen_attention(q, k, v, k_cache, v_cache, layout)
    at = 0
    for s, n in enumerate(q_lens):
        ref = reference_attention(q[at:at + n], k_cache, v_cache, reads[s])
        assert float((out[at:at + n] - ref).abs().max()) <= 1e-5, s
        at += n
    # the same chunk as a dense masked softmax over its full read list
    at = sum(q_lens[:4])
    keys, values = k_cache[full_read_4].float(), v_cache[full_read_4].float()
    rep = heads // kv
    scores = torch.einsum("nhd,shd->hns", q[at:at + 7], keys.repeat_interleave(rep, 1)) * d**-0.5
    one_turn = torch.zeros(pasts[4], dtype=torch.int32)           # every slot written by turn 0
    scores = scores.masked_fill(~deferred_mask(one_turn, generated, 0, 7)[None], float("-inf"))
    dense = torch.einsum("hns,shd->nhd", scores.softmax(-1), values.repeat_interleave(rep, 1))
    assert float((out[at:at + 7] - dense).abs().max()) <= 1e-5


@pytest.mark.parametrize("n, past", [(1, 90), (9, 40), (80, 50)])
def test_attention_of_a_lone_segment_over_consecutive_slots_reads_a_view(n, past):
    """A lone session's slots are consecutive: K/V are read as a view of the cache (no gather), with the
    same result as the reference; scattered slots of the same length take the gather."""
    gen = torch.Generator().manual_seed(n)
    kv, heads, d, slots = 2, 6, 16, 400
    k_cache, v_cache = torch.randn(slots, kv, d, generator=gen), torch.randn(slots, kv, d, generator=gen)
    q = torch.randn(n, heads, d, generator=gen)
    k, v = torch.randn(n, kv, d, generator=gen), torch.randn(n, kv, d, generator=gen)
    for read in (torch.arange(7, 7 + past + n), torch.randperm(slots, generator=gen)[:past + n]):
        layout = attention_layout([n], [read], read[past:], native=False)
        assert (layout.groups[0].span is not None) == bool((read.diff() == 1).all())
        out = varlen_attention(q, k, v, k_cache, v_cache, layout)
        assert float((out - reference_attention(q, k_cache, v_cache, read)).abs().max()) <= 1e-5


def _fields(seqs) -> dict:
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in vars(seqs).items()}


def test_one_group_is_already_the_fused_call():
    """A step with one GDN group only (decode rows alone, or chunks alone) hands that group's sequences to the
    kernel as they are: the same fields the two groups' merge builds for them."""
    from raincheck_core.ops.gdn_sequences import fused_sequences, packed_sequences
    slots, outs = [0, 6, 2, 8], [1, 7, 3, 9]
    decode = packed_sequences([1] * 4, [None] * 4, [3, 5, 7, 9], slots, seeds=([-1, 0, -1, -1], [-1, 0, -1, 1]),
                              out_rows=(outs, []))
    merged = packed_sequences([1] * 4, [None] * 4, [3, 5, 7, 9], slots, [], ([-1, 0, -1, -1], [-1, 0, -1, 1]),
                              joins_after=0, out_rows=(outs, []))
    assert _fields(fused_sequences(None, decode)) == _fields(merged)
    chunks = packed_sequences([5, 4], [3, None], [0, 1, 2, 3, 4, -1, -2, -3, 5], [4, 2], joins=[(0, 6)],
                              out_rows=([-1, 3], [5]))
    again = packed_sequences([5, 4], [3, None], [0, 1, 2, 3, 4, -1, -2, -3, 5], [4, 2], [(0, 6)], (None, None),
                             joins_after=2, out_rows=([-1, 3], [5]))
    assert _fields(fused_sequences(chunks, None)) == _fields(again)
