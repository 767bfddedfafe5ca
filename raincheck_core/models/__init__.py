"""Model families: text decoders written here, selected by the checkpoint's model_type."""

from __future__ import annotations

from ..config import ModelConfig
from ..parallel.group import RankGroup
from .decoder import DecoderLM
from .moe import Qwen3VLMoeDecoder, Qwen35MoeDecoder
from .qwen3_5 import Qwen35Decoder
from .qwen3_vl import Qwen3VLDecoder

REGISTRY: dict[str, type[DecoderLM]] = {"qwen3_vl": Qwen3VLDecoder, "qwen3_5": Qwen35Decoder,
                                         "qwen3_vl_moe": Qwen3VLMoeDecoder, "qwen3_5_moe": Qwen35MoeDecoder}


def build_decoder(cfg: ModelConfig, tp: RankGroup | None = None, expert_parallel: bool = False) -> DecoderLM:
    """The family's decoder; with a rank group of more than one rank, this rank's shard of it."""
    return REGISTRY[cfg.family](cfg, tp, expert_parallel)


__all__ = ["REGISTRY", "DecoderLM", "build_decoder"]
