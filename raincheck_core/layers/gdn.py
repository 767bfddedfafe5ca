"""Gated DeltaNet token mixer (Qwen3.5 linear-attention layers).

Projections run once over all rows of the step. The short convolution and the delta-rule recurrence
run as two packed calls (layers/batch.py, ops/gdn_varlen.py): multi-row sequences with the deferred
joins, then one-row sequences (decode rows), each from its own state slot or from a state a join just
corrected; states stay fp32. New states go to the batch's outputs, never back into the pool (the
engine's update writes them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..ops.gdn import causal_conv1d, recurrent_gated_delta_rule, split_qkv
from ..ops.gdn_varlen import gated_deltanet_rows, gated_deltanet_varlen
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
        if step.multi is not None:
            self._multi(step, u, g, beta, o)
        if step.single is not None:
            self._single(step, u, g, beta, o)
        y = self.norm(o, z)
        return self.out_proj(y.reshape(r, self.value_dim))

    def _multi(self, step: GDNStep, u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, o: torch.Tensor) -> None:
        """Multi-row sequences in one packed call, with the joins; their new states, and the corrected ones
        (the seeds of `_single`), go to the step's buffers."""
        m, c, i, w = step.multi, step.corrections, self.gdn_index, self.conv1d.weight[:, 0]
        if m.kernel is not None:
            m.kernel(i, u, g, beta, w, o)
            return
        extra = (c.extra_u[i], c.extra_g[i], c.extra_beta[i]) if c is not None and c.extra_u is not None else None
        maps = (c.p[:, i], c.s_ref[:, i]) if c is not None else None
        step.out.multi.store(i, *gated_deltanet_varlen(u, g, beta, extra, w, step.pool.conv[:, i],
                                                       step.pool.ssm[:, i], m.layout, self.hk, self.dk, o, maps))

    def _single(self, step: GDNStep, u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, o: torch.Tensor) -> None:
        """One-row sequences; those whose turn's chunk joined in this step start from the corrected state
        (and, within the lead, the chunk's conv tail): the layout's seed rows."""
        s, i, pool, w = step.single, self.gdn_index, step.pool, self.conv1d.weight[:, 0]
        factors = s.keep is not None
        if s.kernel is not None:     # k and v of the tracked rows stay in `step.out.x` for the runner
            s.kernel(i, u, g, beta, w, o, step.out.x[i] if factors else None)
            kv = (None, None) if factors else None
        else:
            multi = step.out.multi
            seeds = (multi.tails[:, i], multi.corrected[:, i]) if step.corrections is not None else (None, None)
            new_hist, state, kv = gated_deltanet_rows(u, g, beta, w, pool.conv[:, i], pool.ssm[:, i], s.layout,
                                                      self.hk, self.dk, o, seeds, factors=factors)
            step.out.single.store(i, state, None, new_hist, None, None)
        if kv is not None:      # every one-row sequence's: the runner picks the tracked rows once
            rows = s.layout.step_rows
            us, gs, bs = (u, g, beta) if rows is None else (u[rows], g[rows], beta[rows])
            step.out.factors.append((us, kv[0], kv[1], gs, bs))

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
