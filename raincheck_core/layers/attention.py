"""Full-attention token mixer: GQA with q/k norm and M-RoPE; Qwen3.5 adds a per-head output gate."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.rope import apply_rope
from ..parallel.group import RankGroup
from .batch import ForwardBatch
from .derived import derived
from .linear import Linear, MergedLinear
from .norm import normalize
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
            self.qkv_proj = MergedLinear(cfg.hidden_size, parts, bias, split=False)
            self.o_proj = Linear(self.heads * d, cfg.hidden_size, bias=bias)
        else:
            heads = tp.shard.even(cfg.num_heads, "the attention heads")
            kv = tp.shard.kv_heads(cfg.num_kv_heads)
            self.heads, self.kv_heads = len(heads), len(kv)
            kv_rows = [range(kv.start * d, kv.stop * d)]
            self.qkv_proj = MergedLinear(cfg.hidden_size, parts, bias, select={
                "q_proj": [range(heads.start * d * width, heads.stop * d * width)], "k_proj": kv_rows,
                "v_proj": kv_rows}, split=False)
            self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, range(heads.start * d, heads.stop * d),
                                            tp, bias=bias)
        self.q_norm = norm_cls(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = norm_cls(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        r, h, kv, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv_proj(x)          # [r, q | k | v]
        gate = None
        if self.gated:  # q laid out per head as [q_h | gate_h]
            q, gate = qkv[:, :2 * h * d].view(r, h, 2 * d).chunk(2, dim=-1)
            k, v = qkv[:, 2 * h * d:].view(r, 2 * kv, d).split_with_sizes([kv, kv], 1)
            qk = torch.cat((q, k), dim=1)
            gate = gate.reshape(r, -1)
        else:           # q's and k's heads are side by side already
            qk, v = qkv.view(r, h + 2 * kv, d).split_with_sizes([h + kv, kv], 1)
        # q's and k's heads normalized and rotated together: one call of each op per layer, not two
        q, k = apply_rope(self.norm_heads(qk), batch.cos, batch.sin).split_with_sizes([h, kv], 1)
        out = batch.ops.attention.attend(q, k, v, batch.kv.k[self.attn_index], batch.kv.v[self.attn_index],
                                         batch.attention)
        out = out.reshape(r, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def norm_heads(self, qk: torch.Tensor) -> torch.Tensor:
        """`qk [r, heads + kv_heads, d]`: q's heads scaled by `q_norm`'s weight, k's by `k_norm`'s, as
        the two norms would (each head's statistic is its own), with their weights side by side."""
        qw, kw = self.q_norm.weight, self.k_norm.weight
        weight = derived(self, "_qk_norm_weight", (qw, kw),
                         lambda: torch.cat((qw.expand(self.heads, -1), kw.expand(self.kv_heads, -1))))
        return self.q_norm.scale(normalize(qk, self.q_norm.eps), weight, qk.dtype)
