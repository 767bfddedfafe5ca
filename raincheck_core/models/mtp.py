"""Qwen3.5's multi-token-prediction (MTP) head, laid out as its checkpoints store it under `mtp.`.

Qwen3.5 checkpoints, dense and MoE, ship `mtp_num_hidden_layers` (1 in every released one) extra decoder
layers that predict the token after next; transformers ignores them, vLLM and SGLang draft with them. For a
row i of the target with hidden state `h_i` (the target's final-norm output, what its LM head reads) and
the token after it `t_{i+1}`:

    x = fc([pre_fc_norm_embedding(embed(t_{i+1})) ‖ pre_fc_norm_hidden(h_i)])     # 2d -> d, embedding first
    g = norm(layers[0](x))                                                        # a full-attention block
    draft of t_{i+2} = argmax lm_head(g)

at row i's rope position, attending causally to the head's own K/V of the rows before. The embedding and
the LM head are the target's (the checkpoint has no copies). The block is the family's gated attention
with `(1 + w)` norms and the family's MLP: a SwiGLU in dense checkpoints, the sparse MoE block (experts
stored one tensor per expert, a shared expert) in MoE ones. `g` also stands in for `h` when the head
chains itself to draft further (speculative/mtp.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import UnsupportedModelError
from ..layers.attention import Attention
from ..layers.batch import ForwardBatch
from ..layers.linear import Linear
from ..layers.mlp import SwiGLU
from ..layers.norm import OffsetRMSNorm
from ..ops.rope import inverse_frequencies, mrope_axes, rope_cos_sin
from .decoder import DecoderBlock
from .loader import load_mtp_weights
from .moe import sparse_block

MTP_FAMILIES = ("qwen3_5", "qwen3_5_moe")


class MtpHead(nn.Module):
    """`num_layers` MTP blocks; block i's attention writes layer i of the K/V pool it is handed. Parameter
    names are the checkpoint's below `mtp.`. Not tensor-parallel: one process holds the whole head."""

    def __init__(self, cfg: ModelConfig, num_layers: int):
        super().__init__()
        if cfg.family not in MTP_FAMILIES:
            raise UnsupportedModelError(f"{cfg.family} checkpoints have no multi-token-prediction head "
                                        f"(only {', '.join(MTP_FAMILIES)} do)")
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.config = cfg
        self.pre_fc_norm_embedding = OffsetRMSNorm(d, eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(d, eps)
        self.fc = Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList(
            DecoderBlock(cfg, Attention(cfg, i, OffsetRMSNorm, gated=True), OffsetRMSNorm, "self_attn",
                         sparse_block(cfg, False, None, False) if cfg.num_experts else SwiGLU(d, cfg.intermediate_size))
            for i in range(num_layers))
        self.norm = OffsetRMSNorm(d, eps)
        self.register_buffer("inv_freq", inverse_frequencies(cfg.rotary_dim, cfg.rope_theta), persistent=False)
        self.register_buffer("rope_axes", mrope_axes(cfg.rotary_dim, cfg.mrope_section), persistent=False)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, layer: int = 0) -> torch.Tensor:
        """`hidden [R, d]`: the target's final-norm hidden state at each row (or the head's own output, when
        chaining); `batch.embeds [R, d]`: the embedding of the token after each row; `batch.positions`
        each row's rope position. Returns the head's output `[R, d]` after `mtp.norm`: the target's LM head
        reads it as is."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(batch.embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        batch.cos, batch.sin = rope_cos_sin(batch.positions, self.inv_freq, self.rope_axes, x.dtype)
        return self.norm(self.layers[layer](x, batch))


def load_mtp_head(cfg: ModelConfig, folder: str | Path, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> MtpHead:
    """The checkpoint's MTP head, with the number of layers its config declares (1 where it declares none,
    as vLLM assumes). NoMtpHeadError where the checkpoint ships no head."""
    head = MtpHead(cfg, cfg.mtp_layers or 1).to(device=device, dtype=dtype)
    load_mtp_weights(head, Path(folder))
    return head.eval()
