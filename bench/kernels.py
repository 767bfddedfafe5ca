"""The CPU fast paths against the torch ops they replace, side by side on the `bench` models' shapes.

    python -m bench.kernels [--repeats 200] [--json PATH]

- paged attention (ops/csrc/paged_attention.c) vs the batched torch path, per layer: decode rows of 1
  and 32 sessions with 300 cached slots each, and a fused step's deferred chunk of 7, 31 or 63 rows
  with its decode row, on pages of 16 slots handed out in a shuffled order;
- a GDN layer's multi-row path (ops/csrc/gated_deltanet.c: conv, SiLU, q/k norms, delta rule) vs the
  torch ops with the chunked rule: one sequence of 10 (a 7-row deferred chunk with its 3-row lead), 34,
  66, 130 and 1,000 rows, and two 34-row chunks; and its decode rows (1 and 32 one-row sequences) vs
  one batched recurrent step; the native side as a step runs it, one layer's call of a `GDNKernel`
  prepared once per step;
- the linear layers of one decoder layer (q/k/v/gate, output, MLP) with prepacked oneDNN weights vs
  torch's default fp32 matmul, at 1-64 rows.
One thread; the two sides alternate call by call, and each side's time is the 20th percentile of its
calls (this machine is shared: a neighbour's burst stretches both sides of a round alike).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from raincheck_core.layers import linear as linear_layers
from raincheck_core.ops.attention import attention_layout, varlen_attention
from raincheck_core.ops.gdn import l2norm
from raincheck_core.ops.gdn_kernel import GDNBuffers, GDNKernel
from raincheck_core.ops.gdn_layout import VarlenLayout, varlen_layout
from raincheck_core.ops.gdn_varlen import gated_deltanet_rows, gated_deltanet_varlen
from raincheck_core.ops.native import gated_deltanet_available, paged_attention_available

from .common import STEP_QUANTILE, quantile, setup_torch

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 64                   # the bench models' attention
KEY_HEADS, VALUE_HEADS, GDN_DIM, CONV = 4, 8, 48, 4    # ... and GDN layers
HIDDEN, INTERMEDIATE = 384, 768


def side_by_side(a: Callable[[], object], b: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Milliseconds per call of `a` and of `b`, alternating."""
    times: tuple[list[float], list[float]] = ([], [])
    for f in (a, b):
        for _ in range(5):
            f()
    for _ in range(repeats):
        for f, out in zip((a, b), times, strict=True):
            t = time.perf_counter()
            f()
            out.append(time.perf_counter() - t)
    return tuple(1e3 * quantile(t, STEP_QUANTILE) for t in times)


def _gdn_paths(layout: VarlenLayout, hist: torch.Tensor, state: torch.Tensor
               ) -> tuple[VarlenLayout, Callable[..., None]]:
    """`layout` for the torch ops (they are torch-only), and the native path as a step runs it: the
    layer's `GDNKernel`, prepared once (a one-layer pool here), called per layer."""
    if not gated_deltanet_available("cpu", torch.float32):
        raise SystemExit("the native GDN kernel cannot be built here (no C compiler): nothing to compare")
    buffers = GDNBuffers.empty(layout.seqs, 1, tuple(hist.shape[1:]), tuple(state.shape[1:]))
    return layout, GDNKernel(layout.seqs, hist.unsqueeze(1), state.unsqueeze(1), KEY_HEADS, buffers)


def attention_rows(repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for sessions in (1, 32):
        slots, page, past = 40_000, 16, 299
        k_cache = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen)
        v_cache = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen)
        order = (torch.randperm(slots // page, generator=gen)[:, None] * page + torch.arange(page)).flatten()
        reads = [order[s * (past + 1):(s + 1) * (past + 1)] for s in range(sessions)]
        writes = torch.stack([r[-1] for r in reads])
        q = torch.randn(sessions, HEADS, HEAD_DIM, generator=gen)
        k, v = torch.randn(sessions, KV_HEADS, HEAD_DIM), torch.randn(sessions, KV_HEADS, HEAD_DIM)
        args = (q, k, v, k_cache, v_cache)
        # without a compiler (or RAINCHECK_NATIVE=0) both sides are the torch path
        layouts = [attention_layout([1] * sessions, reads, writes, native=n and paged_attention_available("cpu",
                                                                                                        torch.float32))
                   for n in (False, True)]
        torch_ms, native_ms = side_by_side(*(lambda lay=lay, args=args: varlen_attention(*args, lay)
                                             for lay in layouts), repeats)
        rows.append(dict(op="decode attention, one layer", shape=f"{sessions} sessions x {past + 1} slots",
                         torch_ms=torch_ms, native_ms=native_ms))
    for chunk, context in ((7, 700), (31, 700), (63, 1100)):
        # a fused step of one session: the chunk reads the context and itself, the decode row everything
        slots = 20_000
        k_cache = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen)
        v_cache = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen)
        order = (torch.randperm(slots // 16, generator=gen)[:, None] * 16 + torch.arange(16)).flatten()
        chunk_reads = torch.cat([order[:context], order[context + 40:context + 40 + chunk]])
        decode_reads = torch.cat([order[:context + 40 + chunk], order[context + 40 + chunk:][:1]])
        reads, writes = [chunk_reads, decode_reads], torch.cat([chunk_reads[-chunk:], decode_reads[-1:]])
        q = torch.randn(chunk + 1, HEADS, HEAD_DIM, generator=gen)
        k, v = torch.randn(chunk + 1, KV_HEADS, HEAD_DIM), torch.randn(chunk + 1, KV_HEADS, HEAD_DIM)
        args = (q, k, v, k_cache, v_cache)
        layouts = [attention_layout([chunk, 1], reads, writes, native=n and paged_attention_available("cpu",
                                                                                                    torch.float32))
                   for n in (False, True)]
        torch_ms, native_ms = side_by_side(*(lambda lay=lay, args=args: varlen_attention(*args, lay)
                                             for lay in layouts), repeats)
        rows.append(dict(op="fused step attention, one layer", shape=f"{chunk}-row chunk over {context} slots + "
                         "decode row", torch_ms=torch_ms, native_ms=native_ms))
    return rows


def gdn_rows(repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    channels = 2 * KEY_HEADS * GDN_DIM + VALUE_HEADS * GDN_DIM
    w = torch.randn(channels, CONV, generator=gen) / 2
    rows = []
    for lengths, splits in (([10], [7]), ([34], [31]), ([34, 34], [31, 31]), ([66], [63]), ([130], [None]),
                            ([1000], [None])):
        n = sum(lengths)
        u = torch.randn(n, channels, generator=gen)
        g = -F.softplus(torch.randn(n, VALUE_HEADS, generator=gen))
        beta = torch.rand(n, VALUE_HEADS, generator=gen)
        hist = torch.randn(len(lengths), CONV - 1, channels, generator=gen)
        state = l2norm(torch.randn(len(lengths), VALUE_HEADS, GDN_DIM, GDN_DIM, generator=gen))
        out = torch.empty(n, VALUE_HEADS, GDN_DIM)
        layout = varlen_layout(lengths, CONV, splits)       # packed row r: step row r
        torch_path, fast = _gdn_paths(layout, hist, state)
        torch_ms, native_ms = side_by_side(
            partial(gated_deltanet_varlen, u, g, beta, None, w, hist, state, torch_path, KEY_HEADS, GDN_DIM, out),
            partial(fast, 0, u, g, beta, w, out), max(20, repeats // 4))
        rows.append(dict(op="GDN layer, multi-row path", shape=" + ".join(f"{x} rows" for x in lengths),
                         torch_ms=torch_ms, native_ms=native_ms))
    for sessions in (1, 32):
        u = torch.randn(sessions, channels, generator=gen)
        g = -F.softplus(torch.randn(sessions, VALUE_HEADS, generator=gen))
        beta = torch.rand(sessions, VALUE_HEADS, generator=gen)
        hist = torch.randn(4 * sessions, CONV - 1, channels, generator=gen)       # pools of more slots
        state = l2norm(torch.randn(4 * sessions, VALUE_HEADS, GDN_DIM, GDN_DIM, generator=gen))
        out = torch.empty(sessions, VALUE_HEADS, GDN_DIM)
        layout = varlen_layout([1] * sessions, CONV, slots=list(range(0, 4 * sessions, 4)))
        torch_path, fast = _gdn_paths(layout, hist, state)
        torch_ms, native_ms = side_by_side(
            partial(gated_deltanet_rows, u, g, beta, w, hist, state, torch_path, KEY_HEADS, GDN_DIM, out),
            partial(fast, 0, u, g, beta, w, out), repeats)
        rows.append(dict(op="GDN layer, decode rows", shape=f"{sessions} sessions", torch_ms=torch_ms,
                         native_ms=native_ms))
    return rows


def linear_rows(repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(2)
    shapes = [(HIDDEN, 2 * HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM), (HEADS * HEAD_DIM, HIDDEN),
              (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN)]
    layers = [linear_layers.Linear(i, o, bias=False) for i, o in shapes]
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / layer.weight.shape[1] ** 0.5)
    rows = []
    for m in (1, 8, 32, 64):
        xs = [torch.randn(m, i, generator=gen) for i, _ in shapes]

        def plain(xs: list[torch.Tensor] = xs) -> None:
            for x, layer in zip(xs, layers, strict=True):
                F.linear(x, layer.weight)

        def packed(xs: list[torch.Tensor] = xs) -> None:
            for x, layer in zip(xs, layers, strict=True):
                layer(x)

        with torch.inference_mode():
            torch_ms, native_ms = side_by_side(plain, packed, repeats)
        rows.append(dict(op="linear layers of one decoder layer", shape=f"{m} rows", torch_ms=torch_ms,
                         native_ms=native_ms))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    setup_torch(1)
    rows = [*attention_rows(args.repeats), *gdn_rows(args.repeats), *linear_rows(args.repeats)]
    print(f"`python -m bench.kernels --repeats {args.repeats}`: one thread, ms per call (20th percentile)\n")
    print("| op | shape | torch ms | fast path ms | torch / fast path |\n|---|---|---|---|---|")
    for r in rows:
        r["speedup"] = r["torch_ms"] / r["native_ms"]
        print(f"| {r['op']} | {r['shape']} | {r['torch_ms']:.3f} | {r['native_ms']:.3f} | {r['speedup']:.2f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
