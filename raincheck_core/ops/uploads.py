"""A step's small host-built tensors (block lists, row and slot indices, lengths) sent to the device in one
copy, instead of one `.to(device)` each.

On a GPU every `.to(device)` of a host tensor is a copy of its own: a call into the driver from pageable
memory, a few microseconds of host time each, 10-19 of them in a decode step's metadata and 34-63 in a fused
step's before this module (docs/design.md). `Uploads` lays the step's tensors out one after another in a host
staging buffer (pinned on CUDA) and hands back at once the device tensors they will be: views into a device
buffer of the same layout. `send` fills that buffer with one copy (per staging block: one in a steady state)
and then runs the device work queued with `then` (writes of the pool's slot tables whose indices were
staged). Until `send` the views hold nothing: code
that reads them on the device before it is wrong, so the CPU twin (the same path with the CPU as the
device) fills a step's part of its device buffer with 0xFF bytes until the copy (NaN, -1, True) and the
identity tests find such a read. `put_together` stages several tensors of one dtype as one.

A tensor staged after `send` (a layout's lazily computed part, first read by the forward) goes by a copy of
its own, counted in `copies` like the staged ones: what a GPU would do per step. A step's views live until
the next step begins, when the buffers are written again; `keep` hands the current buffers to the caller
(a graph's static batch, engine/graphs.py), and the next step gets new ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache

import numpy as np
import torch
from torch import Tensor

ALIGN = 64          # bytes: each tensor starts aligned for any dtype's view and a GPU's vector loads
CAPACITY = 1 << 16  # bytes of a first staging block; a step that needs more adds a block, and the next step
                    # gets one block of what the last step used


class _Block:
    """A host staging buffer and the device buffer it is copied into, with their typed views."""

    def __init__(self, size: int, device: torch.device):
        cuda = device.type == "cuda"
        self.host = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
        self.host_bytes = self.host.numpy()
        self.device = torch.empty(size, dtype=torch.uint8, device=device)
        self.typed: dict[torch.dtype, Tensor] = {}
        self.used = 0
        self.poisoned = 0       # the CPU twin: bytes from the start filled with 0xFF since the step began

    def view(self, dtype: torch.dtype) -> Tensor:
        """The whole device buffer as `dtype` (made once per dtype: a staged tensor is a slice of it)."""
        typed = self.typed.get(dtype)
        if typed is None:
            size = torch.empty(0, dtype=dtype).element_size()
            typed = self.typed[dtype] = self.device[:self.device.shape[0] // size * size].view(dtype)
        return typed


class Uploads:
    """The staged host-to-device copies of one step at a time on `device` (`begin` ... `send`)."""

    def __init__(self, device: torch.device | str, capacity: int = CAPACITY):
        self.device = torch.device(device)
        self.copies = 0         # host-to-device copies of the step begun last (staged and direct)
        self.bytes = 0          # … and the bytes they moved
        self.staged = 0         # tensors staged in it
        self._capacity = capacity
        self._used = 0          # bytes the step begun last staged
        self._blocks: list[_Block] = []
        self._after: list[Callable[[], object]] = []
        self._open = False
        self._copied: torch.cuda.Event | None = None
        # the CPU twin: each staged tensor's bytes of the device buffer are 0xFF until `send` (NaN, -1, True),
        # so that a read before it never sees a value, an earlier step's least of all
        self._poison = self.device.type == "cpu"
        self._empties: dict[tuple[torch.dtype, tuple[int, ...]], Tensor] = {}

    def begin(self) -> Uploads:
        """Start a step: the buffers are written again (the previous step's views are stale from here)."""
        if self._copied is not None:    # the previous copy has read the staging buffer before it is rewritten
            self._copied.synchronize()
        if len(self._blocks) != 1:      # one block of what the last step staged, and some room
            self._blocks = [_Block(max(self._capacity, _aligned(self._used + self._used // 4)), self.device)]
        block = self._blocks[0]
        if self._poison:        # what the last step used, in one fill; a larger step's tail as it is put
            block.device[:block.used].fill_(0xFF)
            block.poisoned = block.used
        block.used = 0
        self.copies = self.bytes = self.staged = 0
        self._after.clear()
        self._open = True
        return self

    def put(self, x: np.ndarray | Tensor) -> Tensor:
        """`x` (a host array or tensor) as a tensor on the device: staged until `send` while the step is open,
        else copied now."""
        return self.put_rewritable(x)[0]

    def put_rewritable(self, x: np.ndarray | Tensor) -> tuple[Tensor, np.ndarray | None]:
        """`put(x)`, and where `x` is staged its bytes in the host staging buffer, which the caller may rewrite
        until `send` (a step prepared before the tokens it feeds were drawn: engine/ahead.py); None where it
        was copied at once or is empty."""
        if isinstance(x, Tensor) and x.device.type != "cpu":       # on a device already
            return x.to(self.device), None
        if not self._open:      # a copy of its own (on the CPU twin, counted as the GPU would make it)
            t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
            self.copies += 1
            self.bytes += t.nbytes
            return t.to(self.device), None
        a = x if isinstance(x, np.ndarray) else x.numpy()
        if not a.size:      # nothing to copy: one empty tensor per dtype and shape serves every step
            return self._empty(_torch_dtype(a.dtype), a.shape), None
        shape = a.shape             # `ascontiguousarray` makes a 0-d array 1-d
        a = a if a.flags.c_contiguous else np.ascontiguousarray(a)
        dtype = _torch_dtype(a.dtype)
        block = self._blocks[-1]
        at = -(-block.used // ALIGN) * ALIGN
        if at + a.nbytes > block.host.shape[0]:     # a block of its own for the rest of the step
            block = _Block(max(self._capacity, _aligned(a.nbytes)), self.device)
            self._blocks.append(block)
            at = 0
        np.copyto(block.host_bytes[at:at + a.nbytes], a.reshape(-1).view(np.uint8))
        block.used = at + a.nbytes
        self.staged += 1
        if self._poison and block.used > block.poisoned:
            block.device.as_strided((block.used - block.poisoned,), (1,), block.poisoned).fill_(0xFF)
            block.poisoned = block.used
        # `as_strided` rather than a slice and `view(shape)`: ~1.5 µs of host time, not ~7
        return (block.view(dtype).as_strided(shape, _strides(shape), at // a.itemsize),
                block.host_bytes[at:at + a.nbytes].view(a.dtype).reshape(shape))

    def _empty(self, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
        t = self._empties.get((dtype, shape))
        if t is None:
            t = self._empties[dtype, shape] = torch.empty(shape, dtype=dtype, device=self.device)
        return t

    def then(self, work: Callable[[], object]) -> None:
        """Run `work` (device work that reads staged tensors) right after the step's copy; at once when the
        step is not open."""
        if self._open:
            self._after.append(work)
        else:
            work()

    def send(self) -> None:
        """The step's staged tensors to the device, one copy per staging block, then the queued work; what is
        put after this goes by a copy of its own. Does nothing when the step's copy is made already."""
        if not self._open:
            return
        self._open = False
        self._used = sum(b.used for b in self._blocks)
        for block in self._blocks:
            if block.used:
                block.device[:block.used].copy_(block.host[:block.used], non_blocking=True)
                self.copies += 1
                self.bytes += block.used
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        for work in self._after:
            work()
        self._after.clear()

    def keep(self) -> None:
        """The current step's buffers belong to the caller from now on (its views stay as they are): the next
        step stages into new ones."""
        self._blocks = []


def put_together(put: Callable[[Tensor], Tensor], parts: Sequence[Tensor]) -> list[Tensor]:
    """`[put(p) for p in parts]` in one `put` (one staged tensor, or one copy): the host tensors of one dtype
    laid end to end, then each part a view of the result in its own shape."""
    if len({p.dtype for p in parts}) != 1:
        raise ValueError(f"parts put together share one dtype, not {sorted({str(p.dtype) for p in parts})}")
    moved = put(torch.cat([p.reshape(-1) for p in parts]))
    return [t.view(p.shape) for t, p in zip(moved.split([p.numel() for p in parts]), parts, strict=True)]


@cache
def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-contiguous strides, in elements, of `shape`."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


@cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
