"""fla's chunk kernel on its own, before any engine relies on it: the gated delta rule at the Qwen3.5-9B
GDN layer shape (32 value heads, Dk = Dv = 128), two sequences of which one has a split (a chunk and its
conv lead), through the adapter (fp32, as the engine calls it) and called directly with bf16 q/k/v (what
the adapter could pass instead), against this project's torch rule in fp32. Error as ||x - ref|| / ||ref||
per output (fp32 arithmetic lands far under 1e-3, TF32 dots near 3e-4, bf16 operands 1e-3..1e-2), the first call's
time (Triton compile and autotune) and the warm time."""

from __future__ import annotations

import time

import torch
from torch import Tensor

from raincheck_core.ops import fla_adapter
from raincheck_core.ops.gdn import l2norm
from raincheck_core.ops.gdn_layout import varlen_layout
from raincheck_core.ops.gdn_varlen_torch import chunk_gated_delta_rule_varlen

from .timing import sync, timed

LENGTHS, SPLITS = [300, 70], [None, 66]     # the chunk kernel (> RECURRENT_MAX_ROWS rows), a split


def relative_error(x: Tensor | None, ref: Tensor | None) -> float | None:
    if x is None or ref is None:
        return None
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm())


def _inputs(heads: int, d: int, device: str) -> tuple[Tensor, ...]:
    """Fresh random q, k (L2-normalised, q scaled), v, g <= 0, beta, states, as the GDN ops prepare them."""
    rows = sum(LENGTHS)
    q = l2norm(torch.randn(rows, heads, d, device=device)) * d**-0.5
    k = l2norm(torch.randn(rows, heads, d, device=device))
    v = torch.randn(rows, heads, d, device=device)
    g, beta = -torch.rand(rows, heads, device=device), torch.rand(rows, heads, device=device)
    return q, k, v, g, beta, torch.randn(len(LENGTHS), heads, d, d, device=device) / 4


def fla_smoke(device: str, tiny: bool, kernels: fla_adapter.FlaKernels | None = None) -> dict:
    """{case: errors of o / final states / split states, cold_s, warm_ms}; `kernels` default fla's Triton
    ones (the dry run passes fla's naive torch references)."""
    kernels = kernels or fla_adapter.triton_kernels()
    heads, d = (4, 16) if tiny else (32, 128)
    layout = varlen_layout(LENGTHS, 4, SPLITS, device=device)
    q, k, v, g, beta, state = _inputs(heads, d, device)
    ref = chunk_gated_delta_rule_varlen(q, k, v, g, beta, state, layout)
    rule = fla_adapter.chunk_rule(kernels)
    runs = layout.runs
    bf16 = tuple(fla_adapter.to_fla(t.to(torch.bfloat16)) for t in (q, k, v))

    def adapter_fp32() -> tuple[Tensor, ...]:
        return rule(q, k, v, g, beta, state, layout)

    def adapter_bf16_inputs() -> tuple[Tensor, ...]:       # bf16-rounded q/k/v through the adapter (fp32 kernel)
        return rule(*(t.to(torch.bfloat16) for t in (q, k, v)), g, beta, state, layout)

    def direct_bf16() -> tuple[Tensor, ...]:
        """The first runs of both sequences in one call with bf16 q/k/v (fp32 gates and states): o is
        compared on their rows only, the final states of the unsplit sequence."""
        o, finals = kernels.chunk(q=bf16[0][:, runs.first_rows], k=bf16[1][:, runs.first_rows],
                                  v=bf16[2][:, runs.first_rows], g=fla_adapter.to_fla(g[runs.first_rows]),
                                  beta=fla_adapter.to_fla(beta[runs.first_rows]), scale=1.0,
                                  initial_state=state.contiguous(), output_final_state=True, cu_seqlens=runs.first_cu)
        return fla_adapter.from_fla(o), finals

    out: dict = dict(heads=heads, dk=d, lengths=LENGTHS, splits=SPLITS)
    for name, fn in (("adapter_fp32", adapter_fp32), ("adapter_bf16_inputs", adapter_bf16_inputs),
                     ("direct_bf16", direct_bf16)):
        sync(device)
        t0 = time.perf_counter()
        got = fn()
        sync(device)
        cold = time.perf_counter() - t0
        if name == "direct_bf16":
            unsplit = [s for s, split in enumerate(SPLITS) if split is None]
            errors = dict(o=relative_error(got[0], ref[0][runs.first_rows]),
                          final=relative_error(got[1][unsplit], ref[1][unsplit]))
        else:
            errors = dict(o=relative_error(got[0], ref[0]), final=relative_error(got[1], ref[1]),
                          split=relative_error(got[2], ref[2]))
        finite = all(bool(torch.isfinite(t).all()) for t in got if t is not None)
        out[name] = dict(errors=errors, finite=finite, cold_s=cold, warm_ms=1e3 * timed(fn, device, 5))
    out["torch_rule_ms"] = 1e3 * timed(lambda: chunk_gated_delta_rule_varlen(q, k, v, g, beta, state, layout),
                                       device, 5)
    return out
