"""States at chosen rows of a step (ops/gdn_rows.py, issue 41): by every backend on the CPU (the native kernel
copying them out as it passes, the chunked rules by replay), through a step's prepared op, each chosen row's
conv history and state equal the sequence run alone, cut after that row."""

from __future__ import annotations

import pytest
import torch

from raincheck_core.cache.gdn_state import GDNStatePool
from raincheck_core.models.random_init import build_config
from raincheck_core.ops import backend, native
from raincheck_core.ops.gdn import causal_conv1d, recurrent_gated_delta_rule, split_qkv
from raincheck_core.ops.gdn_layout import varlen_layout
from raincheck_core.ops.gdn_rows import row_captures
from raincheck_core.ops.gdn_step import AtRows, GDNCorrections, GDNMulti, GDNSingle, GDNStep
from raincheck_core.ops.gdn_traffic import StateCopies, step_traffic
from tests.ops.fla_naive import naive_kernels

LAYERS = 2
# the multi-row sequences: a deferred chunk of 70 step rows with its 3-row lead appended (split after the
# chunk, joining the live state in slot 4), and a plain 9-row chunk; then two decode rows
CHUNK, LEAD, PLAIN = 70, 3, 9
ROWS = CHUNK + PLAIN + 2
CHOSEN = [[0, 30, 63, 64, 69, 70, CHUNK + LEAD - 1],     # first row, across a 64-row block, the chunk's
          [4, PLAIN - 1]]                                   # last, inside the lead and its last


def _gdn_shape(family: str) -> tuple[int, int, int, int, int]:
    text = build_config(family).text_config
    return (text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim,
            text.linear_value_head_dim, text.linear_conv_kernel_dim)


def _ops(name: str) -> backend.GDNOps:
    if name == "native":
        if not native.gated_deltanet_available("cpu", torch.float32):
            pytest.skip("the native kernel cannot be built here (no C compiler)")
        return backend.NATIVE_GDN
    if name == "fla":       # fla's adapter on fla-core's own torch references (its Triton kernels: tests/kernels)
        return backend.fla_gdn(naive_kernels())
    return backend.TORCH_GDN


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("name", ["native", "torch", "fla"])
def test_states_at_chosen_rows_equal_the_sequence_cut_there(family, name):
    check_states_at_rows(_ops(name), family)


def check_states_at_rows(ops: backend.GDNOps, family: str, traffic: bool = True) -> None:
    """A step of the family's GDN shape through `ops`: each chosen row's history and state against the
    one-sequence references (tests/kernels runs it on fla's Triton kernels too), and with `traffic` the
    pool copies the accounting predicts (ops/gdn_traffic.py) against those measured."""
    key_heads, heads, dk, dv, k = _gdn_shape(family)
    c = 2 * key_heads * dk + heads * dv
    gen = torch.Generator().manual_seed(41)
    pool = GDNStatePool(6, LAYERS, c, k, heads, dk, dv, torch.float32, "cpu")
    pool.conv.rows.copy_(torch.randn(pool.conv.rows.shape, generator=gen))
    pool.ssm.rows.copy_(torch.randn(pool.ssm.rows.shape, generator=gen) / dk)
    rows, decode, live = pool.rows([0, 1]), pool.rows([2, 3]), pool.rows([4]).read[0]
    source = [*range(CHUNK), *range(-1, -1 - LEAD, -1), *range(CHUNK, CHUNK + PLAIN)]
    # new states to their slots' other rows, as the engine runs it (the joined chunk's after its lead to
    # the buffers)
    multi = varlen_layout([CHUNK + LEAD, PLAIN], k, [CHUNK, None], source=source, slots=rows.read,
                          joins=[(0, live)], out_rows=([-1, rows.write[1]], [rows.write[0]]))
    single = varlen_layout([1, 1], k, source=[ROWS - 2, ROWS - 1], slots=decode.read, seeds=([0, -1], [0, -1]),
                           out_rows=(decode.write, []))
    corrections = GDNCorrections(
        p=torch.randn(1, LAYERS, heads, dk, dk, generator=gen) / dk,
        s_ref=torch.randn(1, LAYERS, heads, dk, dv, generator=gen),
        extra_u=torch.randn(LAYERS, LEAD, c, generator=gen),
        extra_g=-torch.rand(LAYERS, LEAD, heads, generator=gen),
        extra_beta=torch.rand(LAYERS, LEAD, heads, generator=gen))
    step = GDNStep(pool, GDNMulti(multi), corrections, GDNSingle(single, factors=False))
    step.at_rows = AtRows(row_captures(multi.seqs, CHOSEN, k), ops.varlen, key_heads)
    start_hist = pool.conv.rows[rows.read].clone()
    start_state = pool.ssm.rows[rows.read].clone()
    step.op = ops.prepare(step, key_heads)
    copied = 0
    for layer in range(LAYERS):
        u = torch.randn(ROWS, c, generator=gen)
        g, beta = -torch.rand(ROWS, heads, generator=gen), torch.rand(ROWS, heads, generator=gen)
        w = torch.randn(c, k, generator=gen) / 2
        o = torch.full((ROWS, heads, dv), float("nan"))
        with StateCopies(pool) as copies:
            step.layer(layer, u, g, beta, w, o)
        copied += copies.copied
        assert not o.isnan().any()     # the replay writes none of the step's outputs
        assert step.op.takes_rows == (ops.name == "native")
        hists, states = (t[:, layer] for t in step.out.at_rows)
        assert hists.shape == (9, k - 1, c) and states.shape == (9, heads, dk, dv)
        ex = corrections.extra_u[layer], corrections.extra_g[layer], corrections.extra_beta[layer]
        seq_rows = [[torch.cat([x[:CHUNK], e]) for x, e in zip((u, g, beta), ex, strict=True)],
                    [x[CHUNK:CHUNK + PLAIN] for x in (u, g, beta)]]
        m = 0
        for s, chosen in enumerate(CHOSEN):
            xu, xg, xb = seq_rows[s]
            for i in chosen:        # the sequence alone, cut after row i, from the state it started from
                conv, tail = causal_conv1d(xu[:i + 1], w, start_hist[s, layer])
                q, kk, v = split_qkv(conv, key_heads, dk, heads, dv)
                _, state = recurrent_gated_delta_rule(q, kk, v, xg[:i + 1], xb[:i + 1], start_state[s, layer])
                assert float((states[m] - state).abs().max()) <= 1e-5, (s, i)
                assert float((hists[m] - tail).abs().max()) <= 1e-6, (s, i)
                m += 1
    # what the accounting says the step copies in and out of the pool, replay included, is what it copies
    assert not traffic or step_traffic(step).copied == copied


def test_rows_outside_a_sequence_or_out_of_order_are_refused():
    seqs = varlen_layout([4, 2], 4).seqs
    with pytest.raises(ValueError, match="sequence 1 has 2 rows"):
        row_captures(seqs, [[0], [2]], 4)
    with pytest.raises(ValueError, match="ascending"):
        row_captures(seqs, [[2, 1], []], 4)
    with pytest.raises(ValueError, match="row lists"):
        row_captures(seqs, [[0]], 4)


def test_the_rounds_run_each_row_before_the_last_chosen_one_once():
    """Replay's cost: the pieces chain, so a sequence's rows up to its last chosen row run once more, in as many
    rounds as it has chosen rows."""
    captures = row_captures(varlen_layout([100, 5, 7], 4).seqs, [[10, 50, 99], [], [0]], 4)
    assert [layout.seqs.seq_len.tolist() for layout in captures.rounds] == [[11, 1], [40], [49]]
    assert captures.order.tolist() == [0, 2, 3, 1]
    assert captures.first.tolist() == [0, 3, 3, 4] and captures.rows.tolist() == [10, 50, 99, 0]
