"""Tiny random checkpoints for tests (see raincheck_core.models.random_init)."""

from __future__ import annotations

from pathlib import Path

from raincheck_core.models.random_init import (  # noqa: F401 (re-exported for tests)
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    VOCAB,
    build_config,
)
from raincheck_core.models.random_init import build_model as _build


def build_model(family: str, seed: int = 0, **kw):
    return _build(family, "tiny", seed, **kw)


def save_model(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path
