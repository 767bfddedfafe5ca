"""Full-attention token mixer: GQA with q/k norm and M-RoPE; Qwen3.5 adds a per-head output gate."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.rope import apply_rope
from ..parallel.group import RankGroup
from .batch import ForwardBatch
from .linear import Linear, MergedLinear
from .parallel import RowParallelLinear


class Attention(nn.Module):
    """With a rank group (tensor parallelism) this rank holds a block of the query heads and the KV heads
    they read (q/k/v column-parallel: the KV pool it writes holds only those), and o_proj is
    row-parallel: one all-reduce."""

    def __init__(self, cfg: ModelConfig, attn_index: int, norm_cls: type[nn.Module], gated: bool,
                 tp: RankGroup | None = None):
        super().__init__()
        self.attn_index = attn_index
        d = self.head_dim = cfg.head_dim
        self.gated = gated
        width = 2 if gated else 1       # a gated query head is [q_h | gate_h]
        parts = {"q_proj": cfg.num_heads * d * width, "k_proj": cfg.num_kv_heads * d, "v_proj": cfg.num_kv_heads * d}
        bias = cfg.attention_bias
        if tp is None:
            self.heads, self.kv_heads = cfg.num_heads, cfg.num_kv_heads
            self.qkv_proj = MergedLinear(cfg.hidden_size, parts, bias)
            self.o_proj = Linear(self.heads * d, cfg.hidden_size, bias=bias)
        else:
            heads = tp.shard.even(cfg.num_heads, "the attention heads")
            kv = tp.shard.kv_heads(cfg.num_kv_heads)
            self.heads, self.kv_heads = len(heads), len(kv)
            kv_rows = [range(kv.start * d, kv.stop * d)]
            self.qkv_proj = MergedLinear(cfg.hidden_size, parts, bias, select={
                "q_proj": [range(heads.start * d * width, heads.stop * d * width)], "k_proj": kv_rows,
                "v_proj": kv_rows})
            self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, range(heads.start * d, heads.stop * d),
                                            tp, bias=bias)
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
