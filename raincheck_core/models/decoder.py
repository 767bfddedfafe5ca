"""The text decoder shared by both families: embeddings, a stack of blocks, final norm, LM head.

A family (models/qwen3_vl.py, models/qwen3_5.py, and their MoE variants) chooses the norm convention,
the token mixer of each layer, its MLP (dense SwiGLU or a sparse MoE block) and whether DeepStack
features are injected. Parameter names mirror transformers' so
checkpoints map by name.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.batch import ForwardBatch
from ..layers.linear import Linear
from ..layers.mlp import SwiGLU
from ..layers.moe import SparseMoE
from ..layers.parallel import VocabParallelEmbedding, VocabParallelHead
from ..ops.rope import inverse_frequencies, mrope_axes, rope_cos_sin
from ..parallel.group import RankGroup
from ..parallel.shard import rank_config


class DecoderBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, mixer: nn.Module, norm_cls: type[nn.Module], mixer_name: str,
                 mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.sparse = isinstance(self.mlp, SparseMoE)   # its experts run through the step's op set
        self.mixer_name = mixer_name
        self.add_module(mixer_name, mixer)   # "self_attn" or "linear_attn", as in checkpoints

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = h + getattr(self, self.mixer_name)(self.input_layernorm(h), batch)
        x = self.post_attention_layernorm(h)
        return h + (self.mlp(x, batch.ops) if self.sparse else self.mlp(x))


class DecoderLM(nn.Module):
    """Subclasses build `self.layers` (DecoderBlocks) and set `norm_cls`."""

    norm_cls: type[nn.Module]

    def __init__(self, cfg: ModelConfig, tp: RankGroup | None = None, expert_parallel: bool = False):
        """`tp`: this rank's group when the engine runs tensor-parallel (None: one process holds the whole
        model, as built without it); `expert_parallel`: MoE experts split across the ranks rather than each
        expert's width."""
        super().__init__()
        self.config = cfg
        self.tp = tp if tp is not None and tp.world > 1 else None
        self.expert_parallel = expert_parallel
        if self.tp is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size,
                                                       self.tp.shard.block(cfg.vocab_size), self.tp)
        self.layers = nn.ModuleList(self.build_layers(cfg))
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        if self.tp is None:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        else:
            self.lm_head = VocabParallelHead(cfg.hidden_size, cfg.vocab_size, self.tp.shard.block(cfg.vocab_size),
                                             self.tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", inverse_frequencies(cfg.rotary_dim, cfg.rope_theta), persistent=False)
        self.register_buffer("rope_axes", mrope_axes(cfg.rotary_dim, cfg.mrope_section), persistent=False)

    def build_layers(self, cfg: ModelConfig) -> list[DecoderBlock]:
        raise NotImplementedError

    @property
    def rank_config(self) -> ModelConfig:
        """The config with this rank's head counts: what its pools and runner are sized by."""
        return rank_config(self.config, None if self.tp is None else self.tp.shard)

    def build_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """Layer `layer`'s MLP: the dense SwiGLU; MoE families return their sparse block where the
        config puts one."""
        return SwiGLU(cfg.hidden_size, cfg.intermediate_size, self.tp)

    def gdn_layers(self) -> list[nn.Module]:
        """The Gated DeltaNet token mixers, in layer order (empty for full-attention models)."""
        return [layer.linear_attn for layer in self.layers if layer.mixer_name == "linear_attn"]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[len(logit_rows) or R, vocab]` in fp32."""
        h = batch.embeds
        batch.cos, batch.sin = rope_cos_sin(batch.positions, self.inv_freq, self.rope_axes, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, batch)
            if i < len(batch.deepstack) and batch.deepstack_rows is not None:
                h = h.index_add(0, batch.deepstack_rows, batch.deepstack[i].to(h.dtype))
        if batch.hidden_rows is not None:     # what an MTP head reads: after the final norm, as vLLM's does
            batch.hidden = self.norm(h[batch.hidden_rows])
        if batch.logit_rows is not None:
            h = h[batch.logit_rows]
        return self.lm_head(self.norm(h)).float()
