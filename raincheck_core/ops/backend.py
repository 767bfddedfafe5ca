"""The op set of a step: which implementation of each op its layers call, chosen once per step.

The ops live here in ops/, apart from the layers that call them (flash-linear-attention keeps its
kernels apart from its layers the same way): paged attention over the step's `AttentionLayout`
(ops/attention.py; the native kernel's side in ops/paged_attention.py), Gated DeltaNet over the step's
packed sequences, joins and decode rows (ops/gdn_step.py, laid out by ops/gdn_layout.py, one layer's ops
in ops/gdn_varlen.py and ops/gdn_kernel.py) with the GDN math of the deferred joins outside the forward
(the affine state maps' fold and join, ops/gdn_state_map.py, and recorded rows run again, ops/gdn.py),
and the grouped expert matmul of MoE layers (ops/moe.py). Each has implementations by backend: the
native CPU kernels (csrc/, built and loaded by ops/native.py) and torch ops; a later one (FlexAttention,
flash-linear-attention on a GPU) is one more `AttentionOps` / `GDNOps` for `select` to pick. The runner
asks `select` once per step, builds the step's layouts with the op set it got and hands it to the
forward (`ForwardBatch.ops`, and the prepared `GDNStep.op`): the layers call what they are handed and
never ask which backend it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from . import fla_adapter, gdn_kernel, gdn_state_map, gdn_varlen, native
from .attention import AttentionLayout, attention_layout, varlen_attention
from .flex_attention import flex_varlen_attention
from .flex_layout import FlexLayout, flex_layout
from .gdn import Replayed, replay
from .gdn_op_types import RowsOp, VarlenOp
from .gdn_step import COPIED, IN_PLACE, FusedGDN, GDNLayerOp, GDNStep, GroupedGDN
from .moe import ExpertsOp, grouped_experts, grouped_mm_available, grouped_mm_experts


@dataclass(frozen=True)
class AttentionOps:
    """Paged attention by one backend: the step's layout (`layout(q_lens, read_slots, write_slots,
    device, pool)`, see `attention_layout` and `flex_layout`; `pool` the KVPool) and a layer's call over it
    (`attend(q, k, v, k_cache, v_cache, layout)`, see `varlen_attention`)."""

    name: str
    layout: Callable[[list[int], list[Tensor], Tensor, torch.device | str, object], AttentionLayout | FlexLayout]
    attend: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, AttentionLayout | FlexLayout], Tensor]
    # the layout reads pages, and takes `prefixes` (how each read list relates to its page table, whose
    # pages it reads off each page's first listed slot: ops/flex_runs.py) and `pages` (the tables' pages that
    # decode rows carry); the others read every slot
    reads_pages: bool = False


@dataclass(frozen=True)
class GDNOps:
    """Gated DeltaNet by one backend: one layer's multi-row sequences with their joins (`varlen`) and
    one-row sequences (`rows`), with ops/gdn_varlen.py's signatures, and a step's op over both groups
    (`prepare(step, key_heads)`, which also lays out the buffers it writes in `step.out`); and what the
    deferred joins compute outside the forward: tokens folded into affine state maps in place (`fold(P,
    k, g, beta)`, ops/gdn_state_map.py `extend_map_`), a join (`join(S_live, P, delta)`, `join_state`
    there) and a sequence's recorded rows run again (`replay`, ops/gdn.py), the torch ops unless the
    backend has its own. `parts`: the layout parts its `varlen` and `rows` read (`VarlenLayout.lay_out`)."""

    name: str
    varlen: VarlenOp
    rows: RowsOp
    prepare: Callable[[GDNStep, int], GDNLayerOp]
    fold: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] = gdn_state_map.extend_map_torch_
    join: Callable[[Tensor, Tensor, Tensor], Tensor] = gdn_state_map.join_state
    replay: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int, int], Replayed] = replay
    parts: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())


@dataclass(frozen=True)
class OpSet:
    """The ops of one step, each from the backend `select` chose for it."""

    attention: AttentionOps
    gdn: GDNOps
    # the grouped expert matmul of MoE layers (ops/moe.py): torch's loop unless `select` finds better
    moe: ExpertsOp = grouped_experts


def prepare_native(step: GDNStep, key_heads: int) -> GDNLayerOp:
    """Both groups in one kernel call per layer (a long call splits its heads among torch's threads)."""
    return FusedGDN(step, key_heads)


def token_by_token(ops: OpSet) -> bool:
    """Whether a step of `ops` runs its GDN sequences token by token (`prepare_native`), so that a
    sequence's rows after any point get the arithmetic a sequence starting there gets: a prefix hit that
    resumes mid-prompt then reproduces the cold run bit for bit without the cold run ending its step there.
    The chunked rules (torch, fla) group rows into chunks counted from the sequence's start."""
    return ops.gdn is NATIVE_GDN


def prepare_torch(step: GDNStep, key_heads: int) -> GDNLayerOp:
    return GroupedGDN(step, key_heads, gdn_varlen.gated_deltanet_varlen, gdn_varlen.gated_deltanet_rows)


NATIVE_ATTENTION = AttentionOps("native", partial(attention_layout, native=True), varlen_attention)
TORCH_ATTENTION = AttentionOps("torch", partial(attention_layout, native=False), varlen_attention)
NATIVE_GDN = GDNOps("native", gdn_kernel.gated_deltanet_varlen, gdn_kernel.gated_deltanet_rows, prepare_native,
                    fold=gdn_state_map.extend_map_)
TORCH_GDN = GDNOps("torch", gdn_varlen.gated_deltanet_varlen, gdn_varlen.gated_deltanet_rows, prepare_torch,
                   parts=((*gdn_varlen.VARLEN_PARTS, "blocks"), gdn_varlen.ROWS_PARTS))   # the chunked rule's blocks
# the native backend where the layers' kernel does not take the step's tensors: the maps are fp32 whatever
# the layers run in, so the fold keeps its kernel (which it leaves where it does not apply)
NATIVE_FOLD_GDN = dataclasses.replace(TORCH_GDN, fold=gdn_state_map.extend_map_)
FLEX_ATTENTION = AttentionOps("flex", flex_layout, flex_varlen_attention, reads_pages=True)


def select(device: torch.device | str, dtype: torch.dtype, kv_dtype: torch.dtype | None,
           gdn_dtypes: tuple[torch.dtype, ...] | None, backend: str = "native") -> OpSet:
    """The op set of a step on `device` with activations of `dtype`, a KV cache of `kv_dtype` and GDN
    state pools of `gdn_dtypes` (None: the model has no such layers, and their kernel is not built for
    it): each op native where its kernel is built and takes these tensors (fp32 on the CPU), else torch
    (the maps' fold native where its kernel takes them, whatever the layers run in); MoE experts through
    torch's grouped GEMM where it has one (ops/moe.py).
    Asked once per step, so `RAINCHECK_NATIVE=0` (ops/native.py) holds from the next step on.
    `backend` (`EngineConfig.backend`, one of `config.BACKENDS`) other than native replaces ops by name:
    torch (both torch), flex (FlexAttention, torch GDN), fla (FlexAttention, fla's GDN kernels), auto (on
    CUDA: fla where triton imports, else flex; elsewhere native)."""
    attention = NATIVE_ATTENTION if kv_dtype is not None and native.paged_attention_available(device, kv_dtype) \
        else TORCH_ATTENTION
    gdn = NATIVE_GDN if gdn_dtypes is not None and all(d == torch.float32 for d in gdn_dtypes) \
        and native.gated_deltanet_available(device, dtype) else NATIVE_FOLD_GDN
    moe = grouped_mm_experts if grouped_mm_available(device) else grouped_experts
    ops = OpSet(attention, gdn, moe)
    if backend == "auto":
        backend = accelerated_backend() if torch.device(device).type == "cuda" else "native"
    if backend == "torch":
        return dataclasses.replace(ops, attention=TORCH_ATTENTION, gdn=TORCH_GDN)
    if backend in ("flex", "fla"):
        gdn = _triton_fla_gdn() if backend == "fla" else TORCH_GDN
        return dataclasses.replace(ops, attention=FLEX_ATTENTION, gdn=gdn)
    return ops


def accelerated_backend() -> str:
    """What `auto` runs on CUDA: fla's kernels where triton imports, else FlexAttention with torch GDN."""
    return "fla" if fla_adapter.available() else "flex"


_triton_fla: list[GDNOps] = []      # `fla_gdn()` once made, while fla's kernels import


def _triton_fla_gdn() -> GDNOps:
    """`fla_gdn()`, made once: a step's op set is asked for every step, and the same GDN ops each time let a
    plain decode step reuse an earlier step's metadata (engine/gdn_inputs.py `DecodeSteps`, keyed on them).
    Where fla's kernels do not import, `fla_gdn` raises, naming what is missing."""
    if not fla_adapter.available():
        return fla_gdn()
    if not _triton_fla:
        _triton_fla.append(fla_gdn())
    return _triton_fla[0]


def fla_gdn(kernels: fla_adapter.FlaKernels | None = None) -> GDNOps:
    """GDN on fla's kernels (`kernels`, default its Triton ones; an error naming the extra where triton is
    not there) through ops/fla_adapter.py; the short convolution, state map, join and replay stay torch.
    With fla's Triton kernels, decode rows take this project's own Triton kernels on the pool's rows in
    place (ops/gdn_triton.py): fla 0.6 takes no state indices."""
    pooled = kernels is None and fla_adapter.available()     # triton is there: so are this project's kernels
    kernels = kernels or fla_adapter.triton_kernels()
    varlen = partial(gdn_varlen.gated_deltanet_varlen, rule=fla_adapter.chunk_rule(kernels))
    rows = partial(gdn_varlen.gated_deltanet_rows, step=fla_adapter.step_rule(kernels))
    in_place = (COPIED, COPIED)
    if pooled:
        from .gdn_triton import POOLED  # imports triton: only where fla's kernels did
        rows = partial(rows, pooled=POOLED)
        in_place = (COPIED, IN_PLACE)
    return GDNOps("fla", varlen, rows, lambda step, key_heads: GroupedGDN(step, key_heads, varlen, rows, in_place),
                  parts=((*gdn_varlen.VARLEN_PARTS, "runs"), gdn_varlen.ROWS_PARTS))    # fla's runs
