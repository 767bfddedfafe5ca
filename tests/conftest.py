"""Shared fixtures: tiny transformers checkpoints saved once per test session."""

from __future__ import annotations

import os

# Ray reads these when it is imported: set them before any test module can import it, so every Ray
# listener binds to 127.0.0.1 and nothing reports usage over the network.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

import pytest
import torch

from raincheck_core.config import default_backend
from tests import tiny

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, tuple[object, object]]:
    """family -> (transformers model, saved folder)."""
    out = {}
    for family in ("qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe"):
        model = tiny.build_model(family)
        folder = tiny.save_model(model, tmp_path_factory.mktemp(family))
        out[family] = (model, folder)
    return out


@pytest.fixture(scope="module", params=list(dict.fromkeys([default_backend(), "flex"])))
def engine_backend(request) -> str:
    """The op backend an identity test's engine runs: the default (RAINCHECK_BACKEND, else auto: native on
    the CPU) and FlexAttention. Module-scoped, so a module builds its engines once per backend; the
    compiled FlexAttention kernels are shared by the whole process (ops/flex_attention.py)."""
    return request.param
