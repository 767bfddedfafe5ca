"""Gated DeltaNet token mixer (Qwen3.5 linear-attention layers).

Projections run once over all rows of the step. The short convolution and the delta-rule recurrence
run over the step's packed sequences through the op the step prepared (ops/gdn_step.py): multi-row
sequences with the deferred joins, then one-row sequences (decode rows), each from its own state slot
or from a state a join just corrected. States stay fp32. New states go to the step's buffers, never
back into the pool (the engine's update writes them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel.group import RankGroup
from .batch import ForwardBatch
from .linear import Linear, MergedLinear
from .norm import GatedRMSNorm
from .parallel import RowParallelLinear, Target, copy_into, rows_of

# torch runs an elementwise op over whole vectors and a scalar tail, which round differently; the gates
# have a few values per row (one per head), so which path a row's values took depended on how many rows
# the step had. Each row padded to whole vectors (64 floats: a multiple of every CPU's two-vector stride)
# gets the same bits whatever rows run beside it (a verify segment's rows, another batch).
LANES = 64


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an elementwise `fn` of a 2-D `x`, each row computed on whole vectors."""
    rows, n = x.shape
    width = -(-n // LANES) * LANES
    if width == n:
        return fn(x)
    padded = x.new_zeros(rows, width)
    padded[:, :n] = x
    return fn(padded)[:, :n].contiguous()


class GatedDeltaNet(nn.Module):
    """With a rank group (tensor parallelism) this rank holds a block of the key heads and the value heads
    that read them: their rows of the input projections and conv channels, their decays, and its conv
    and recurrent states hold only them (the state pool, the join and the checkpoints follow); out_proj is
    row-parallel: one all-reduce."""

    def __init__(self, cfg: ModelConfig, gdn_index: int, tp: RankGroup | None = None):
        super().__init__()
        self.gdn_index = gdn_index
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        keys, values = range(hk), range(hv)
        if tp is not None:
            keys, values = tp.shard.even(hk, "the GDN key heads"), tp.shard.even(hv, "the GDN value heads")
        self.hk, self.hv = len(keys), len(values)
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        conv_dim = 2 * self.key_dim + self.value_dim
        kernel = cfg.linear_conv_kernel
        h = cfg.hidden_size
        # the checkpoint's conv channels are [q | k | v] over all heads: this rank's rows of each
        channels = [range(keys.start * dk, keys.stop * dk), range((hk + keys.start) * dk, (hk + keys.stop) * dk),
                    range(2 * hk * dk + values.start * dv, 2 * hk * dk + values.stop * dv)]
        value_rows = [range(values.start * dv, values.stop * dv)]
        full_conv = 2 * hk * dk + hv * dv
        parts = {"in_proj_qkv": full_conv, "in_proj_z": hv * dv, "in_proj_b": hv, "in_proj_a": hv}
        self.in_proj = MergedLinear(h, parts, select=None if tp is None else {
            "in_proj_qkv": channels, "in_proj_z": value_rows, "in_proj_b": [values], "in_proj_a": [values]})
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel, groups=conv_dim, bias=False, padding=kernel - 1)
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        if tp is None:
            self.out_proj = Linear(self.value_dim, h, bias=False)
        else:
            self.out_proj = RowParallelLinear(hv * dv, h, value_rows[0], tp)
        self.shards = (full_conv, hv, channels, values)

    def checkpoint_targets(self) -> dict[str, Target]:
        """The conv channels and decays this rank holds (all of them without a rank group)."""
        full_conv, hv, channels, values = self.shards
        kernel = self.conv1d.weight.shape[2]
        return {"conv1d.weight": Target(((full_conv, 1, kernel),), copy_into(self.conv1d.weight), rows_of(channels)),
                "A_log": Target(((hv,),), copy_into(self.A_log), rows_of([values])),
                "dt_bias": Target(((hv,),), copy_into(self.dt_bias), rows_of([values]))}

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        r = x.shape[0]
        u, z, b, a = self.in_proj(x)
        z = z.reshape(r, self.hv, self.dv)
        beta = rowwise(torch.sigmoid, b).float()          # sigmoid in model dtype, as transformers does
        g = -self.A_log.float().exp() * rowwise(F.softplus, a.float() + self.dt_bias)
        o = torch.empty(r, self.hv, self.dv, dtype=x.dtype, device=x.device)
        batch.gdn.layer(self.gdn_index, u, g, beta, self.conv1d.weight[:, 0], o)
        y = self.norm(o, z)
        return self.out_proj(y.reshape(r, self.value_dim))
