"""The shipped demo checkpoints, each loaded once per test session (tests skip when one is absent).

`FOLDER` is v1 (`models/demo`, the name "demo-v1": one image with the first question); `V2` is v2
(`models/demo-v2`, the default model, the names "demo" and "demo-v2"), which also reads images arriving at
any turn and short videos (issue 17). Tests name the folder they mean, never "demo", so what they assert
does not move with the default."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parents[2] / "models"
FOLDER = MODELS / "demo"
V2 = MODELS / "demo-v2"
needs_checkpoint = pytest.mark.skipif(not (FOLDER / "model.safetensors").is_file(),
                                      reason="models/demo has no trained checkpoint")
needs_v2 = pytest.mark.skipif(not (V2 / "model.safetensors").is_file(),
                              reason="models/demo-v2 has no trained checkpoint")


@functools.cache
def engine(folder: Path = FOLDER):
    from raincheck_core import Engine

    return Engine.from_pretrained(folder, num_threads=1)
