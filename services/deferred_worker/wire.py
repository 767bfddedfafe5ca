"""A residual payload or result as numpy arrays, for Ray's object store.

Each tensor travels as `(dtype, array)` (ints as they are): the array holds its values (bfloat16, which
numpy lacks, as its raw 16-bit patterns), so Ray serializes it zero-copy and never pickles a torch
tensor. Arrays read from the object store are read-only, so `unpack` copies them (once) on the way to
the engine's device.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import numpy as np
import torch

from raincheck_core.deferral.handoff import ResidualPayload, ResidualResult

T = TypeVar("T", ResidualPayload, ResidualResult)
Packed = tuple[str, np.ndarray]
_RAW = {torch.bfloat16: torch.int16}      # dtypes numpy lacks -> same-width integers
_DTYPES = {str(d).removeprefix("torch."): d
           for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)}


def pack(obj: ResidualPayload | ResidualResult) -> dict[str, Packed | list[Packed] | int | None]:
    """Field name -> packed tensor (lists of tensors stay lists; ints and None stay as they are)."""
    return {f.name: _map(getattr(obj, f.name), _pack) for f in dataclasses.fields(obj)}


def unpack(cls: type[T], wire: dict, device: torch.device) -> T:
    return cls(**{f.name: _map(wire[f.name], lambda p: unpack_tensor(p, device)) for f in dataclasses.fields(cls)})


def _map(value, fn):
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, list):
        return [fn(v) for v in value]
    return fn(value)


def _pack(t: torch.Tensor) -> Packed:
    t = t.detach().cpu().contiguous()
    raw = _RAW.get(t.dtype)
    return str(t.dtype).removeprefix("torch."), (t.view(raw) if raw is not None else t).numpy()


def unpack_tensor(packed: Packed, device: torch.device) -> torch.Tensor:
    dtype, array = packed
    target = _DTYPES.get(dtype)
    if target is None:
        raise ValueError(f"unexpected tensor dtype {dtype!r} in a recovery payload")
    t = torch.from_numpy(array.copy())
    if t.dtype != target:
        t = t.view(target)
    return t.to(device)
