"""Gated DeltaNet token mixer (Qwen3.5 linear-attention layers).

Projections run once over all rows of the step. The short convolution and the delta-rule recurrence
run over the step's packed sequences through the op the step prepared (ops/gdn_step.py): multi-row
sequences with the deferred joins, then one-row sequences (decode rows), each from its own state slot
or from a state a join just corrected. States stay fp32. New states go to the step's buffers, never
back into the pool (the engine's update writes them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .batch import ForwardBatch
from .linear import Linear, MergedLinear
from .norm import GatedRMSNorm


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, gdn_index: int):
        super().__init__()
        self.gdn_index = gdn_index
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        conv_dim = 2 * self.key_dim + self.value_dim
        kernel = cfg.linear_conv_kernel
        h = cfg.hidden_size
        self.in_proj = MergedLinear(h, {"in_proj_qkv": conv_dim, "in_proj_z": self.value_dim,
                                        "in_proj_b": self.hv, "in_proj_a": self.hv})
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel, groups=conv_dim, bias=False, padding=kernel - 1)
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, h, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        r = x.shape[0]
        u, z, b, a = self.in_proj(x)
        z = z.reshape(r, self.hv, self.dv)
        beta = torch.sigmoid(b).float()          # sigmoid in model dtype, as transformers does
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o = torch.empty(r, self.hv, self.dv, dtype=x.dtype, device=x.device)
        batch.gdn.layer(self.gdn_index, u, g, beta, self.conv1d.weight[:, 0], o)
        y = self.norm(o, z)
        return self.out_proj(y.reshape(r, self.value_dim))
