"""Qwen3-VL text decoder: full attention in every layer, plain `w·x̂` RMSNorm, DeepStack injection."""

from __future__ import annotations

from ..config import ModelConfig
from ..layers.attention import Attention
from ..layers.norm import RMSNorm
from .decoder import DecoderBlock, DecoderLM


class Qwen3VLDecoder(DecoderLM):
    norm_cls = RMSNorm

    def build_layers(self, cfg: ModelConfig) -> list[DecoderBlock]:
        return [
            DecoderBlock(cfg, Attention(cfg, i, RMSNorm, gated=False, tp=self.tp), RMSNorm, "self_attn",
                         self.build_mlp(cfg, i))
            for i in range(cfg.num_layers)
        ]
