"""Loading the Engine a decode worker (or a deferred worker) serves."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from raincheck_core import Engine

from ..common.settings import ModelSpec

log = logging.getLogger(__name__)


def model_name(spec: ModelSpec) -> str:
    """The name clients (and deferred-worker actor names) know the model by."""
    return spec.name or (Path(spec.model).name if spec.model is not None else f"random-{spec.random_size}")


def load_engine(spec: ModelSpec) -> Engine:
    """The checkpoint's Engine. Without a checkpoint, the seeded random model: the same weights in every
    process, so deferred workers join exactly what the decode worker would have computed."""
    options = dict(device=spec.device, dtype=spec.dtype, **spec.engine)
    if spec.model is not None:
        return Engine.from_pretrained(spec.model, **options)
    from .random_model import save_random_model

    log.warning("no --model given: serving a RANDOM %s Qwen3.5-architecture model with a character-level "
                "tokenizer (answers are noise; timings are real) until the demo model ships", spec.random_size)
    with tempfile.TemporaryDirectory(prefix="raincheck-random-") as folder:
        return Engine.from_pretrained(save_random_model(folder, spec.random_size), **options)
