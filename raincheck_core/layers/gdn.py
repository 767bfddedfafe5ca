"""Gated DeltaNet token mixer (Qwen3.5 linear-attention layers).

Projections run once over all rows of the step. The short convolution and the delta-rule recurrence
run over the step's packed sequences (layers/batch.py, ops/gdn_varlen.py): multi-row sequences with the
deferred joins, then one-row sequences (decode rows), each from its own state slot or from a state a
join just corrected; one native call on the CPU, else two groups of torch ops. States stay fp32. New
states go to the batch's outputs, never back into the pool (the engine's update writes them).
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
        if step.kernel is not None:     # both groups and the joins in one native call
            factors = step.single is not None and step.single.keep is not None
            step.kernel(self.gdn_index, u, g, beta, self.conv1d.weight[:, 0], o,
                        step.out.x[self.gdn_index] if factors else None)
            if factors:                 # k and v of the tracked rows stay in `step.out.x` for the runner
                self._keep_factors(step, u, g, beta, (None, None))
        else:
            if step.multi is not None:
                self._multi(step, u, g, beta, o)
            if step.single is not None:
                self._single(step, u, g, beta, o)
        y = self.norm(o, z)
        return self.out_proj(y.reshape(r, self.value_dim))

    def _multi(self, step: GDNStep, u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, o: torch.Tensor) -> None:
        """The torch path's multi-row sequences, with the joins; their new states, and the corrected ones
        (the seeds of `_single`), go to the step's buffers."""
        c, i = step.corrections, self.gdn_index
        extra = (c.extra_u[i], c.extra_g[i], c.extra_beta[i]) if c is not None and c.extra_u is not None else None
        maps = (c.p[:, i], c.s_ref[:, i]) if c is not None else None
        step.out.multi.store(i, *gated_deltanet_varlen(u, g, beta, extra, self.conv1d.weight[:, 0],
                                                       step.pool.conv[:, i], step.pool.ssm[:, i], step.multi.layout,
                                                       self.hk, self.dk, o, maps))

    def _single(self, step: GDNStep, u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, o: torch.Tensor) -> None:
        """The torch path's one-row sequences; those whose turn's chunk joined in this step start from the
        corrected state (and, within the lead, the chunk's conv tail): the layout's seed rows."""
        s, i, pool, multi = step.single, self.gdn_index, step.pool, step.out.multi
        seeds = (multi.tails[:, i], multi.corrected[:, i]) if step.corrections is not None else (None, None)
        new_hist, state, kv = gated_deltanet_rows(u, g, beta, self.conv1d.weight[:, 0], pool.conv[:, i],
                                                  pool.ssm[:, i], s.layout, self.hk, self.dk, o, seeds,
                                                  factors=s.keep is not None)
        step.out.single.store(i, state, None, new_hist, None, None)
        if kv is not None:
            self._keep_factors(step, u, g, beta, kv)

    @staticmethod
    def _keep_factors(step: GDNStep, u: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      kv: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
        """Every one-row sequence's u, k, v, g, beta (the runner picks the tracked rows once)."""
        rows = step.single.layout.step_rows
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
