"""The Python side of the native paged-attention kernel (csrc/paged_attention.c, built and loaded by
ops/native.py): a step's segments as the kernel reads them (`PagedSegments`, laid out once per step with
the `AttentionLayout`) and a layer's call (`paged_attention`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

import torch

from . import native
from .int_lists import long_tensor


@dataclass
class PagedSegments:
    """Segments of a step as the paged-attention kernel reads them (int64, contiguous)."""

    q_start: torch.Tensor   # [S] first packed row of each segment
    q_len: torch.Tensor     # [S]
    k_start: torch.Tensor   # [S] offset of each segment's slot list in `keys`
    k_len: torch.Tensor     # [S]
    keys: torch.Tensor      # [sum k_len] readable slot ids, segment after segment
    slot_bound: int         # 1 + the largest slot id: the kernel reads without bounds checks

    @cached_property
    def kernel_args(self) -> tuple[int, ...]:
        """The kernel's segment arguments (data pointers, count): the same for every layer of the step."""
        return (self.q_start.data_ptr(), self.q_len.data_ptr(), self.k_start.data_ptr(), self.k_len.data_ptr(),
                self.keys.data_ptr(), len(self.q_len))


def paged_segments(ids: list[int], q_lens: list[int], starts: list[int],
                   read_slots: list[torch.Tensor]) -> PagedSegments:
    reads = [read_slots[s] for s in ids]
    # one tensor of the four per-segment lists, and one cat of the slot lists: a decode step has a segment
    # per session, so nothing here is done per segment beyond reading its length (a step's few torch calls
    # are most of its host time at one session)
    k_len = [r.shape[0] for r in reads]
    q_len = [q_lens[s] for s in ids]
    if any(k < q for k, q in zip(k_len, q_len, strict=True)):
        raise ValueError("each segment reads at least its own rows' slots")
    k_start = list(itertools.accumulate(k_len, initial=0))[:-1]
    q_start_t, q_len_t, k_start_t, k_len_t = long_tensor([*(starts[s] for s in ids), *q_len, *k_start, *k_len]
                                                         ).view(4, -1)
    # a copy even of one list: the lists are views of the sessions' page tables, and a step's inputs are
    # its own (a graph's static buffers are written by later steps)
    keys = torch.cat(reads).to(device="cpu", dtype=torch.long).contiguous()
    low, high = torch.aminmax(keys)
    if int(low) < 0:
        raise ValueError("slot ids are not negative")
    return PagedSegments(q_start=q_start_t, q_len=q_len_t, k_start=k_start_t, k_len=k_len_t, keys=keys,
                         slot_bound=int(high) + 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    seg: PagedSegments) -> None:
    """Write into `out [R, heads, d]` the attention of `seg`'s rows of `q [R, heads, d]` over the cache
    (see csrc/paged_attention.c). All fp32 on the CPU; `q`, `out` and the caches contiguous."""
    lib = native.loaded("paged_attention")
    if lib is None:
        raise RuntimeError("the paged-attention kernel is not available (see ops/backend.py select)")
    for t in (q, k_cache, v_cache, out):
        if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
            raise ValueError(f"paged_attention needs contiguous fp32 CPU tensors, got {t.dtype} {t.device} "
                             f"contiguous={t.is_contiguous()}")
    heads, d = q.shape[1], q.shape[2]
    kv = k_cache.shape[1]
    if seg.slot_bound > k_cache.shape[0] or v_cache.shape != k_cache.shape or heads % kv:
        raise ValueError(f"paged_attention: slots up to {seg.slot_bound - 1} in a cache of {k_cache.shape[0]}, "
                         f"or caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} for {heads} heads")
    status = lib.paged_attention_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                                     *seg.kernel_args, heads, kv, d, d**-0.5)
    if status != 0:
        raise MemoryError("paged_attention: cannot allocate its scratch buffer")
