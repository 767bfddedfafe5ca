"""The op set a step runs (ops/backend.py): what `select` picks, and a step's GDN op by each backend —
both groups in one native call (on one thread, or its heads split among threads), the groups apart
through the torch ops — giving the same outputs, new states and factors."""

from __future__ import annotations

import pytest
import torch

from raincheck_core.cache.gdn_state import GDNStatePool
from raincheck_core.ops import backend, gdn_kernel, gdn_state_map, native
from raincheck_core.ops.gdn_layout import varlen_layout
from raincheck_core.ops.gdn_step import FusedGDN, GDNCorrections, GDNMulti, GDNSingle, GDNStep, GroupedGDN

needs_kernels = pytest.mark.skipif(not (native.gated_deltanet_available("cpu", torch.float32)
                                        and native.paged_attention_available("cpu", torch.float32)),
                                   reason="the native kernels cannot be built here (no C compiler)")
F32, BF16 = torch.float32, torch.bfloat16
KEY_HEADS, HEADS, DK, DV, K, LAYERS = 2, 4, 16, 8, 4, 2
C = 2 * KEY_HEADS * DK + HEADS * DV


@needs_kernels
def test_select_takes_each_kernel_where_it_is_built_and_takes_the_tensors(monkeypatch):
    def names(*args) -> tuple[str, str]:
        ops = backend.select(*args)
        return ops.attention.name, ops.gdn.name
    assert names("cpu", F32, F32, (F32, F32)) == ("native", "native")
    assert names("cpu", BF16, BF16, (BF16, F32)) == ("torch", "torch")
    assert names("cpu", F32, BF16, (F32, F32)) == ("torch", "native")
    assert names("cpu", F32, F32, (BF16, F32)) == ("native", "torch")
    assert names("cpu", F32, None, None) == ("torch", "torch")        # a model without such layers
    assert names("meta", F32, F32, (F32, F32)) == ("torch", "torch")  # not the CPU
    monkeypatch.setenv("RAINCHECK_NATIVE", "0")                       # read at each step's selection
    assert names("cpu", F32, F32, (F32, F32)) == ("torch", "torch")


def _step(gen: torch.Generator, in_place: bool = False) -> tuple[GDNStep, int]:
    """A fused step's GDN work: a deferred chunk of 5 rows with its 3-row lead appended, joining the live
    state in slot 4, and a plain 4-row chunk; then two tracked decode rows, the first of the joining turn
    (from the corrected state and the chunk's conv tail), the second from its slot. `in_place`: new states
    go to their slots' other rows (as the engine runs it: the joined chunk's state after its lead to the
    buffers), else all of them to the buffers."""
    pool = GDNStatePool(6, LAYERS, C, K, HEADS, DK, DV, F32, "cpu")
    pool.conv.rows.copy_(torch.randn(pool.conv.rows.shape, generator=gen))
    pool.ssm.rows.copy_(torch.randn(pool.ssm.rows.shape, generator=gen) / DK)
    rows, decode, live = pool.rows([0, 1]), pool.rows([2, 3]), pool.rows([4]).read[0]
    multi = varlen_layout([8, 4], K, [5, None], source=[0, 1, 2, 3, 4, -1, -2, -3, 5, 6, 7, 8], slots=rows.read,
                          joins=[(0, live)], out_rows=([-1, rows.write[1]], [rows.write[0]]) if in_place else None)
    single = varlen_layout([1, 1], K, source=[9, 10], slots=decode.read, seeds=([0, -1], [0, -1]),
                           out_rows=(decode.write, []) if in_place else None)
    corrections = GDNCorrections(
        p=torch.randn(1, LAYERS, HEADS, DK, DK, generator=gen) / DK,
        s_ref=torch.randn(1, LAYERS, HEADS, DK, DV, generator=gen),
        extra_u=torch.randn(LAYERS, 3, C, generator=gen),
        extra_g=-torch.rand(LAYERS, 3, HEADS, generator=gen), extra_beta=torch.rand(LAYERS, 3, HEADS, generator=gen))
    return GDNStep(pool, GDNMulti(multi), corrections, GDNSingle(single, factors=True)), 11


def _run(ops: backend.GDNOps, seed: int = 0, in_place: bool = False) -> tuple[type, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    step, rows = _step(gen, in_place)
    before = step.pool.ssm.rows.clone(), step.pool.conv.rows.clone()
    op = ops.prepare(step, KEY_HEADS)
    outs, ks = [], []
    for layer in range(LAYERS):
        u = torch.randn(rows, C, generator=gen)
        g, beta = -torch.rand(rows, HEADS, generator=gen), torch.rand(rows, HEADS, generator=gen)
        o = torch.full((rows, HEADS, DV), float("nan"))
        op(step, layer, u, g, beta, torch.randn(C, K, generator=gen) / 2, o)
        outs.append(o)
        k = step.out.factors[layer][1]
        if k is None:   # left in the kernel's [q | k | v] rows
            k = step.out.x[layer][[9, 10], 2 * DK:4 * DK].view(2, KEY_HEADS, DK)
        ks.append(k)
    m, s = step.out.multi, step.out.single
    if in_place:    # the new states in the other rows (slot s: rows 2s and 2s + 1), the current ones as they were
        ssm, conv = step.pool.ssm.rows, step.pool.conv.rows
        assert torch.equal(ssm[0::2], before[0][0::2]) and torch.equal(conv[0::2], before[1][0::2])
        return type(op), dict(out=torch.stack(outs), finals=torch.stack([m.finals[0], ssm[3]]),
                              tails=torch.stack([m.tails[0], conv[3]]), split_states=ssm[1][None],
                              split_tails=conv[1][None], corrected=m.corrected, decode_finals=ssm[[5, 7]],
                              decode_tails=conv[[5, 7]], k=torch.stack(ks))
    return type(op), dict(out=torch.stack(outs), finals=m.finals, tails=m.tails, split_states=m.split_states,
                          split_tails=m.split_tails, corrected=m.corrected, decode_finals=s.finals,
                          decode_tails=s.tails, k=torch.stack(ks))


@needs_kernels
def test_a_steps_gdn_op_gives_the_same_by_every_backend(monkeypatch):
    kind, expected = _run(backend.TORCH_GDN)
    assert kind is GroupedGDN
    kind, fused = _run(backend.NATIVE_GDN)
    assert kind is FusedGDN
    _threaded(monkeypatch)
    kind, threaded = _run(backend.NATIVE_GDN)
    assert kind is FusedGDN
    for name, t in expected.items():
        assert not t.isnan().any() and float((fused[name] - t).abs().max()) <= 1e-5, name
        # each head computed by one thread as by the one thread: the very bits (prefix hits rely on it)
        assert torch.equal(threaded[name], fused[name]), name


def _threaded(monkeypatch) -> None:
    """The kernel's calls split their heads between two threads, however few rows they have."""
    monkeypatch.setattr(gdn_kernel, "THREADED_ROWS", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)


@needs_kernels
@pytest.mark.parametrize("name", ["torch", "native", "threaded", "fla"])
def test_new_states_written_into_the_pools_other_rows_are_the_same(monkeypatch, name):
    """As the engine runs a step: each sequence reads its slot's current row and writes the other (the
    update then flips), by every backend: the same states as into the step's buffers, and no current row
    is written."""
    from tests.ops.fla_naive import naive_kernels

    ops = {"torch": backend.TORCH_GDN, "native": backend.NATIVE_GDN, "threaded": backend.NATIVE_GDN}.get(name)
    if name == "threaded":
        _threaded(monkeypatch)
    _, expected = _run(backend.TORCH_GDN)
    _, got = _run(ops or backend.fla_gdn(naive_kernels()), in_place=True)
    for key, t in expected.items():
        assert not t.isnan().any() and float((got[key] - t).abs().max()) <= 1e-5, key


def test_the_fla_gdn_op_gives_the_same_as_the_torch_op():
    """fla's GDN backend (ops/fla_adapter.py) on fla's naive references, through a step's joins, splits,
    seeds and tracked rows: the same outputs, states and factors as the torch op."""
    from tests.ops.fla_naive import naive_kernels

    _, expected = _run(backend.TORCH_GDN)
    kind, got = _run(backend.fla_gdn(naive_kernels()))
    assert kind is GroupedGDN
    for name, t in expected.items():
        assert not t.isnan().any() and float((got[name] - t).abs().max()) <= 1e-5, name


def test_select_by_backend_name():
    def names(backend_name: str, device: str = "cpu") -> tuple[str, str]:
        ops = backend.select(device, F32, F32, (F32, F32), backend_name)
        return ops.attention.name, ops.gdn.name
    assert names("torch") == ("torch", "torch")
    assert names("flex") == ("flex", "torch")
    assert names("auto") == names("native")                          # the CPU: today's kernels
    assert names("auto", "cuda") in (("flex", "fla"), ("flex", "torch"))


def test_the_maps_fold_by_the_steps_backend():
    """The native backend folds with its kernel (where it applies) also where its layers take the torch
    ops, as the maps are fp32 whatever the layers run in; the other backends fold with the torch ops."""
    from tests.ops.fla_naive import naive_kernels

    def fold(*args):
        return backend.select(*args).gdn.fold
    assert fold("cpu", F32, F32, (F32, F32)) is gdn_state_map.extend_map_
    assert fold("cpu", BF16, BF16, (BF16, F32)) is gdn_state_map.extend_map_
    for name in ("torch", "flex"):
        assert fold("cpu", F32, F32, (F32, F32), name) is gdn_state_map.extend_map_torch_
    assert backend.fla_gdn(naive_kernels()).fold is gdn_state_map.extend_map_torch_
