"""The mixture-of-experts variants of both families: Qwen3-VL-MoE and Qwen3.5-MoE.

Each is its dense family's decoder (same token mixers, norms, DeepStack, vision tower) whose MLP is
the sparse MoE block (layers/moe.py) in the layers the config names (`ModelConfig.moe_layers`; a
Qwen3-VL-MoE layer in `mlp_only_layers` keeps a dense SwiGLU).
"""

from __future__ import annotations

from torch import nn

from ..config import ModelConfig
from ..layers.moe import SparseMoE
from ..parallel.group import RankGroup
from .qwen3_5 import Qwen35Decoder
from .qwen3_vl import Qwen3VLDecoder


def sparse_block(cfg: ModelConfig, stacked: bool, tp: RankGroup | None, expert_parallel: bool) -> SparseMoE:
    return SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                     cfg.shared_expert_intermediate_size, stacked, tp, expert_parallel)


class Qwen3VLMoeDecoder(Qwen3VLDecoder):
    """Checkpoints store the experts stacked (`mlp.experts.gate_up_proj`)."""

    def build_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        if layer in cfg.moe_layers:
            return sparse_block(cfg, True, self.tp, self.expert_parallel)
        return super().build_mlp(cfg, layer)


class Qwen35MoeDecoder(Qwen35Decoder):
    """Checkpoints store one tensor per expert (`mlp.experts.{e}.gate_proj.weight`)."""

    def build_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        if layer in cfg.moe_layers:
            return sparse_block(cfg, False, self.tp, self.expert_parallel)
        return super().build_mlp(cfg, layer)
