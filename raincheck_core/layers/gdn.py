"""Gated DeltaNet token mixer (Qwen3.5 linear-attention layers).

Projections run once over all rows of the step. The short convolution and the delta-rule recurrence
run as two packed calls (layers/batch.py): multi-row sequences through the chunked rule, then one-row
sequences through one batched recurrent step, each from its own state slot; states stay fp32. New
states go to the batch's outputs, never back into the pool (the engine's update writes them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..ops import gdn_state_map
from ..ops.gdn import causal_conv1d, recurrent_gated_delta_rule, split_qkv
from ..ops.gdn_varlen import conv_step, gated_delta_step, gated_deltanet_varlen
from .batch import ForwardBatch, GDNStep
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
        step = batch.gdn
        corrected = self._multi(step, u, g, beta, o) if step.multi is not None else None
        if step.single is not None:
            self._single(step, u, g, beta, o, corrected)
        y = self.norm(o, z)
        return self.out_proj(y.reshape(r, self.value_dim))

    def _multi(self, step: GDNStep, u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, o: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Multi-row sequences in one packed call; returns the corrected states and the conv tails of
        their driving sequences, if the step has corrections."""
        m, c, i = step.multi, step.corrections, self.gdn_index
        extra = (c.extra_u[i], c.extra_g[i], c.extra_beta[i]) if c is not None and c.extra_u is not None else None
        pool = step.pool
        finals, split_states, tails, split_tails = gated_deltanet_varlen(
            u, g, beta, extra, self.conv1d.weight[:, 0], pool.conv[:, i].index_select(0, m.slots),
            pool.ssm[:, i].index_select(0, m.slots), m.layout, self.hk, self.dk, o)
        step.out.multi.append((tails, finals, split_tails, split_states))
        if c is None:
            return None
        live = pool.ssm[:, i].index_select(0, c.slots)
        live = gdn_state_map.join_state(live, c.p[:, i], finals[c.seqs] - c.s_ref[:, i])
        step.out.corrected.append(live)
        return live, tails[c.seqs]

    def _single(self, step: GDNStep, u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, o: torch.Tensor,
                corrected: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        s, i, pool = step.single, self.gdn_index, step.pool
        # gathered copies: safe to overwrite rows, and the recurrent step updates `state` in place
        hist, state = pool.conv[:, i].index_select(0, s.slots), pool.ssm[:, i].index_select(0, s.slots)
        c = step.corrections
        if corrected is not None and c.starts_single is not None:
            live, tails = corrected
            at, into = c.starts_single
            state[into] = live[at]
            if c.repairs_single is not None:
                at, into = c.repairs_single
                hist[into] = tails[at].to(hist.dtype)
        if s.all_rows:      # a step of decode rows only: no gather, no scatter
            us, gs, bs = u, g, beta
        else:
            us, gs, bs = u[s.step_rows], g[s.step_rows], beta[s.step_rows]
        conv, new_hist = conv_step(us, self.conv1d.weight[:, 0], hist)
        q, k, v = self._qkv(conv)
        out = gated_delta_step(q, k, v, gs, bs, state)
        if s.all_rows:
            o.copy_(out)
        else:
            o[s.step_rows] = out.to(o.dtype)
        step.out.single.append((new_hist, state))
        if s.keep is not None:     # views of every one-row sequence's: the runner picks the tracked rows once
            step.out.factors.append((us, k, v, gs, bs))

    def rerun(self, u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_hist: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run recorded rows (pre-conv inputs `u [T, conv dim]`, `g`, `beta [T, H]`) of one sequence from
        the given conv history and state; returns the history and state after them (nothing written)."""
        conv, new_hist = causal_conv1d(u, self.conv1d.weight[:, 0], conv_hist)
        q, k, v = self._qkv(conv)
        _, final = recurrent_gated_delta_rule(q, k, v, g, beta, state)
        return new_hist, final

    def _qkv(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (fp32, prepared for the delta rule) from conv outputs `[T, conv dim]`."""
        return split_qkv(conv, self.hk, self.dk, self.hv, self.dv)
