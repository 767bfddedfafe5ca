"""Loading an engine from a Hugging Face-format folder (`Engine.from_pretrained`): the engine settings, the
rank group, the decoder's shard and weights, the vision tower, the chat formatter, the MTP head and the
calibrated selector options. Kept apart from the facade, which delegates to it: what a checkpoint folder
holds is one job, serving from it another."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..config import EngineConfig, ModelConfig
from ..errors import InvalidInputError
from ..models import build_decoder
from ..models.loader import load_decoder_weights
from ..models.shipped import resolve_model_path
from ..pruning.settings import load_selector_options
from ..speculative.drafter import Drafter
from ..speculative.mtp import MtpDrafter
from .rank_start import rank_group

log = logging.getLogger(__name__)
E = TypeVar("E")


def load_pretrained(build: Callable[..., E], path: str | Path, device: str, dtype: str, drafter: Drafter | None,
                    engine_options: dict[str, Any], serve_rank: Callable[..., None]) -> E:
    """`build(model, model_config, config, formatter=, vision=, selector_options=, drafter=, ranks=)` (the
    Engine class) over what the folder at `path` holds; `serve_rank` is what each worker rank the engine
    starts runs (engine/rank_start.py). The worker ranks are closed if loading or building fails."""
    from ..multimodal.chat import ChatFormatter
    from ..multimodal.vision import VisionEncoder

    folder = resolve_model_path(path)
    config = EngineConfig(device=device, dtype=dtype, **engine_options)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model_config = ModelConfig.from_folder(folder)
    if config.tensor_parallel_size > 1 and (drafter is not None or config.speculative.method == "mtp"):
        # the replicas of rank 0 build their drafter from the settings alone, and the MTP head reads the
        # whole vocabulary, which the ranks split
        raise InvalidInputError("speculative decoding at tensor_parallel_size > 1 takes method 'ngram' only "
                                "(an MTP head or a drafter object is not split across ranks yet)")
    ranks, tp = rank_group(folder, model_config, config, engine_options, serve_rank)
    try:
        # a tensor-parallel rank builds and loads only its shard
        model = build_decoder(model_config, tp, config.expert_parallel).to(device=config.device,
                                                                           dtype=config.torch_dtype)
        others = load_decoder_weights(model, folder, model_config.tie_word_embeddings)
        vision = None
        if model_config.has_vision and any(k.startswith(("model.visual.", "visual.")) for k in others):
            vision = VisionEncoder.from_checkpoint(folder, model_config.raw, others, config.device,
                                                   config.torch_dtype)
        formatter = ChatFormatter.from_checkpoint(folder)
        if drafter is None and config.speculative.method == "mtp":     # the checkpoint's MTP head
            drafter = MtpDrafter.from_checkpoint(folder, model, config)    # NoMtpHeadError without one
        log.info("loaded %s from %s (%s, %s)", model_config.family, folder, device, dtype)
        return build(model, model_config, config, formatter=formatter, vision=vision,
                     selector_options=load_selector_options(folder), drafter=drafter, ranks=ranks)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
