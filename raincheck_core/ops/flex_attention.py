"""Attention of a packed step on FlexAttention, reading K/V in place from the paged pool: the call over a
step's layout (`flex_varlen_attention`; where each segment reads, and why, is ops/flex_layout.py's) and
the compiled kernel it runs. Compiled kernels are shared by the whole process (`compiled`), one per
(segments bucket, query bucket, pool shape, heads, dtype); past dynamo's recompile limit a call fails
rather than fall back to FlexAttention's eager path.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

from .flex_groups import Q_TILE, FlexGroup
from .flex_layout import FlexLayout

# one compiled kernel per (segments bucket, query bucket, block-list columns, pool shape, heads, dtype):
# far more than dynamo's default of 8 per function when a process serves several models or shapes (the
# test suite runs four families on pools of several sizes)
RECOMPILE_LIMIT = 512
# The CPU template picks its split-KV decoding kernel for 1-row queries when the partition size is a
# multiple of the KV block; that kernel walks every partition of the whole key tensor (here: the pool)
# when segments have different block counts. A partition size no page size divides keeps the main kernel,
# which walks only each segment's block list.
CPU_PARTITION = 24


def flex_varlen_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                          layout: FlexLayout) -> Tensor:
    """`varlen_attention` (ops/attention.py) on FlexAttention: write the step's `k, v [R, kv_heads, d]`
    into the cache, then attend `q [R, heads, d]` over the pool per the layout. Returns `[R, heads, d]`."""
    k_cache.index_copy_(0, layout.write_slots, k)
    v_cache.index_copy_(0, layout.write_slots, v)
    r, heads, d = q.shape
    keys, values = k_cache.transpose(0, 1)[None], v_cache.transpose(0, 1)[None]      # views of the pool
    # row r takes the outputs of padding positions (fixed shapes: no per-step count of real rows), and
    # rows no group attends stay zero
    out = q.new_zeros(r + 1, heads, d)
    shared = heads // keys.shape[1]
    # On the CPU a KV head's query heads go in as rows of one head: the CPU kernel runs each (segment, head,
    # query block) over its block list, a few small products and a softmax update per 16-key page, so a decode
    # row's 1 x 16 blocks cost their overhead, not their FLOPs; folded, each page serves all of the KV head's
    # query heads at once. On a GPU the decoding kernel packs them itself, and Triton's query blocks are
    # powers of two.
    folded = shared if q.device.type == "cpu" else 1
    for g in layout.groups:
        n = g.stamp.shape[0]
        qg = q[g.q_rows].to(k_cache.dtype).view(n, g.q, heads // folded, folded, d).transpose(1, 2).reshape(
            n, heads // folded, g.q * folded, d)
        res = _flex(qg, keys, values, block_mask=g.block_mask(layout.tables, shared, folded),
                    enable_gqa=shared != folded,
                    kernel_options=kernel_options(g, shared, layout.tables.page_size, q.device))
        out[g.out_rows] = res.reshape(n, heads // folded, g.q, folded, d).transpose(1, 2).reshape(
            n * g.q, heads, d).to(q.dtype)
    return out[:r]


def kernel_options(group: FlexGroup, shared_heads: int, page_size: int, device: torch.device) -> dict:
    """FlexAttention's options for one group's call. On the CPU, the partition size that keeps the main
    kernel. On a GPU, a one-tile group shorter than Q_TILE runs FlexAttention's decoding kernel where it
    can (query heads per KV head a power of two; its block is `FlexGroup.declared_q_block`); the others
    run the main kernel on blocks of Q_TILE rows and one page (its default blocks of 64-128 rows and keys
    would not divide the declared ones, and below 128 query rows AUTO would pick the decoding kernel, which
    reads one block list per segment, not one per tile). Named, not AUTO: a kernel that cannot take the
    group fails at compile time instead of another being chosen."""
    if device.type == "cpu":
        return {"PARTITION_SIZE": CPU_PARTITION}
    if group.tile < Q_TILE and shared_heads & (shared_heads - 1) == 0:
        return {"BACKEND": "TRITON_DECODE"}
    return {"BACKEND": "TRITON", "BLOCK_M": Q_TILE, "BLOCK_N": page_size, "num_warps": 4, "num_stages": 2}


def compiled() -> Callable[..., Tensor]:
    """The process's compiled `flex_attention` (compiled on first use, per shape). Past dynamo's recompile
    limit a call would run FlexAttention's unfused eager path, which materialises the scores: the limit is
    raised (set again at each call: code elsewhere may reset dynamo's config) and hitting it is an error."""
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, RECOMPILE_LIMIT)
    return _compiled_flex()


def _flex(*args: object, **kwargs: object) -> Tensor:
    # past the recompile limit dynamo would run FlexAttention's eager path, which does not give the compiled
    # kernel's result over these strided block lists (tests/ops/test_flex_attention.py would fail on it):
    # an error, never a silent fallback
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        return compiled()(*args, **kwargs)


@cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)
