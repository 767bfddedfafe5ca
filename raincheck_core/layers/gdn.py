"""Gated DeltaNet token mixer (Qwen3.5 linear-attention layers).

Projections run once over all rows of the step; the short convolution and the delta-rule recurrence
run per segment from that sequence's state slot. Multi-row segments use the chunked algorithm, single
rows the recurrent step; both keep the state in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.gdn_state import GDNStatePool
from ..config import ModelConfig
from ..ops.gdn import causal_conv1d, chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule
from .batch import ForwardBatch
from .linear import MergedLinear
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
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        r = x.shape[0]
        u, z, b, a = self.in_proj(x)
        z = z.reshape(r, self.hv, self.dv)
        beta = torch.sigmoid(b).float()          # sigmoid in model dtype, as transformers does
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o = torch.empty(r, self.hv, self.dv, dtype=x.dtype, device=x.device)
        for seg in batch.segments:
            rows = seg.rows
            out, k, v = self.mix(u[rows], g[rows], beta[rows], batch.gdn, seg.gdn_slot)
            o[rows] = out.to(x.dtype)
            if seg.gdn_hook is not None:    # deferred recovery bookkeeping (deferral/gdn_join.py)
                seg.gdn_hook(self, u[rows], beta[rows], g[rows], k, v)
        y = self.norm(o, z)
        return self.out_proj(y.reshape(r, self.value_dim))

    def mix(self, u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, pool: GDNStatePool,
            slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv + recurrence of one sequence's rows from state slot `slot`, which it advances.
        Returns the output `[T, Hv, Dv]` fp32 and the rows' prepared keys and values."""
        conv_hist = pool.conv[slot, self.gdn_index]
        ssm = pool.ssm[slot, self.gdn_index]
        q, k, v, new_hist = self.factors(u, conv_hist)
        rule = recurrent_gated_delta_rule if u.shape[0] == 1 else chunk_gated_delta_rule
        out, new_ssm = rule(q, k, v, g, beta, ssm)
        conv_hist.copy_(new_hist)
        ssm.copy_(new_ssm)
        return out, k, v

    def factors(self, u: torch.Tensor, conv_hist: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (fp32, prepared for the delta rule) of pre-conv inputs `u` after `conv_hist`, and
        the conv history after them."""
        c, new_hist = causal_conv1d(u, self.conv1d.weight[:, 0], conv_hist)
        c = F.silu(c)
        q, k, v = torch.split(c, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        t = c.shape[0]
        q, k = self.prepare_qk(q.reshape(t, self.hk, self.dk), k.reshape(t, self.hk, self.dk))
        return q, k, v.reshape(t, self.hv, self.dv).float(), new_hist

    def prepare_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32, L2-normalised, q scaled by Dk^-1/2, expanded to the value heads (head j uses key head j // r)."""
        rep = self.hv // self.hk
        q = l2norm(q.float()) * self.dk**-0.5
        k = l2norm(k.float())
        return q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
