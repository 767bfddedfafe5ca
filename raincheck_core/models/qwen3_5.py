"""Qwen3.5 text decoder: Gated DeltaNet layers interleaved with gated full attention, `(1+w)` RMSNorm."""

from __future__ import annotations

from ..config import ModelConfig
from ..layers.attention import Attention
from ..layers.gdn import GatedDeltaNet
from ..layers.norm import OffsetRMSNorm
from .decoder import DecoderBlock, DecoderLM


class Qwen35Decoder(DecoderLM):
    norm_cls = OffsetRMSNorm

    def build_layers(self, cfg: ModelConfig) -> list[DecoderBlock]:
        layers, n_attn, n_gdn = [], 0, 0
        for i, kind in enumerate(cfg.layer_types):
            if kind == "full_attention":
                mixer, name = Attention(cfg, n_attn, OffsetRMSNorm, gated=True, tp=self.tp), "self_attn"
                n_attn += 1
            else:
                mixer, name = GatedDeltaNet(cfg, n_gdn, self.tp), "linear_attn"
                n_gdn += 1
            layers.append(DecoderBlock(cfg, mixer, OffsetRMSNorm, name, self.build_mlp(cfg, i)))
        return layers
