"""Loading the Engine a decode worker or a deferred worker serves: both load the same weights from the same
ModelSpec (a deferred worker joins what its decode worker would have computed)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from raincheck_core import CheckpointError, Engine
from raincheck_core.models.shipped import resolve_model_path
from raincheck_core.speculative.config import SpeculativeConfig

from ..common.settings import ModelSpec

log = logging.getLogger(__name__)


def default_model() -> str | None:
    """"demo" when the folder that name stands for is here (models/demo-v2 of the checkout, or
    $RAINCHECK_DEMO_MODEL, or under $RAINCHECK_MODELS_DIR: raincheck_core/models/shipped.py), else None."""
    try:
        resolve_model_path("demo")
    except CheckpointError as e:
        log.debug("no default model: %s", e)
        return None
    return "demo"


def model_name(spec: ModelSpec) -> str:
    """The name clients (and deferred-worker actor names) know the model by."""
    model = spec.model or default_model()
    return spec.model_name or (Path(model).name if model is not None else f"random-{spec.random_size}")


def load_engine(spec: ModelSpec) -> Engine:
    """The checkpoint's Engine. Without a checkpoint, the seeded random model: the same weights in every
    process, so deferred workers join exactly what the decode worker would have computed."""
    options = dict(device=spec.device, dtype=spec.dtype, **spec.engine)
    if "speculative" in options:
        options["speculative"] = SpeculativeConfig(**options["speculative"])
    model = spec.model or default_model()
    if model is not None:
        return Engine.from_pretrained(model, **options)
    from .random_model import save_random_model

    log.warning("no --model given: serving a RANDOM %s Qwen3.5-architecture model with a character-level "
                "tokenizer (answers are noise; timings are real): the demo model (models/demo-v2) is not in this "
                "checkout, nor named by RAINCHECK_DEMO_MODEL or RAINCHECK_MODELS_DIR", spec.random_size)
    with tempfile.TemporaryDirectory(prefix="raincheck-random-") as folder:
        return Engine.from_pretrained(save_random_model(folder, spec.random_size), **options)
