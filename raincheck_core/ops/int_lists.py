"""A step's Python lists of ints (row indices, slot ids, tokens) as int64 tensors, by way of numpy: the
per-step metadata of a 64-session decode step is a handful of such lists, and `torch.tensor` takes about
three times numpy's host time to convert one."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def long_tensor(values: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """`values` as a 1-D int64 tensor on `device` (its own memory: later changes to `values` do not show)."""
    t = torch.from_numpy(np.array(values, dtype=np.int64))
    return t if device == "cpu" else t.to(device)     # `to` is a no-op for a CPU device object too
