"""Tensors a layer derives from its parameters and keeps until they change: the prepacked copy of a
linear layer's weight (layers/linear.py), the q and k norms' weights side by side (layers/attention.py).

A copy is made on first use and again whenever a source changes (its storage or its version counter
moves), so training and in-place loading stay correct."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def weight_key(weight: torch.Tensor) -> tuple[int, int]:
    try:
        return weight.data_ptr(), weight._version
    except RuntimeError:        # an inference tensor has no version counter and cannot change later
        return weight.data_ptr(), -1


def derived(module: nn.Module, name: str, sources: tuple[torch.Tensor, ...], build: Callable[[], Any]) -> Any:
    """`build()`, kept in `module.__dict__[name]` (not a parameter or buffer: no state-dict entry) until
    one of `sources` changes; built afresh, and not kept, where autograd tracks a source (a kept copy would
    carry no gradient)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in sources):
        return build()
    key = tuple(map(weight_key, sources))
    cached = module.__dict__.get(name)
    if cached is None or cached[0] != key:
        cached = (key, build())
        module.__dict__[name] = cached
    return cached[1]
