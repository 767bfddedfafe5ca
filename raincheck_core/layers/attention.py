"""Full-attention token mixer: GQA with q/k norm and M-RoPE; Qwen3.5 adds a per-head output gate."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.rope import apply_rope
from .batch import ForwardBatch
from .linear import Linear, MergedLinear


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_index: int, norm_cls: type[nn.Module], gated: bool):
        super().__init__()
        self.attn_index = attn_index
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.gated = gated
        q_out = self.heads * self.head_dim * (2 if gated else 1)
        bias = cfg.attention_bias
        kv_out = self.kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q_proj": q_out, "k_proj": kv_out, "v_proj": kv_out}, bias)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = norm_cls(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = norm_cls(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        r = x.shape[0]
        q, k, v = self.qkv_proj(x)
        gate = None
        if self.gated:  # laid out per head as [q_h | gate_h]
            q, gate = q.view(r, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(r, -1)
        q = self.q_norm(q.reshape(r, self.heads, self.head_dim))
        k = self.k_norm(k.reshape(r, self.kv_heads, self.head_dim))
        v = v.reshape(r, self.kv_heads, self.head_dim)
        q, k = apply_rope(q, batch.cos, batch.sin), apply_rope(k, batch.cos, batch.sin)
        out = batch.ops.attention.attend(q, k, v, batch.kv.k[self.attn_index], batch.kv.v[self.attn_index],
                                         batch.attention)
        out = out.reshape(r, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)
