"""The shipped demo checkpoint, loaded once per test session (tests skip when it is absent)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parents[2] / "models" / "demo"
needs_checkpoint = pytest.mark.skipif(not (FOLDER / "model.safetensors").is_file(),
                                      reason="models/demo has no trained checkpoint")


@functools.cache
def engine():
    from raincheck_core import Engine

    return Engine.from_pretrained(FOLDER, num_threads=2)
