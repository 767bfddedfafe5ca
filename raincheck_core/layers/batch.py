"""What one forward pass reads: the packed rows of a step, the ops it runs and, per mixer kind, where
the rows go.

The model runner builds a `ForwardBatch` from the step's plan (engine/runner.py); the layers read it
and never see sessions. `ops` is the step's op set, chosen once per step (ops/backend.py): attention
layers call `ops.attention` over one shared `AttentionLayout`, GDN layers the op prepared for the step's
`GDNStep` (ops/gdn_step.py), so no layer asks which backend runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache.kv_pool import KVPool
from ..ops.attention import AttentionLayout
from ..ops.backend import OpSet
from ..ops.flex_layout import FlexLayout
from ..ops.gdn_step import GDNStep


@dataclass
class ForwardBatch:
    embeds: torch.Tensor                     # [R, hidden]
    positions: torch.Tensor                  # [3, R]
    kv: KVPool | None
    ops: OpSet
    attention: AttentionLayout | FlexLayout | None     # built by `ops.attention`
    gdn: GDNStep | None                      # its `op` prepared by `ops.gdn`
    logit_rows: torch.Tensor | None = None   # rows whose logits are needed; None = all
    deepstack_rows: torch.Tensor | None = None          # visual rows that receive DeepStack features
    deepstack: list[torch.Tensor] = field(default_factory=list)   # per level, [len(deepstack_rows), hidden]
    hidden_rows: torch.Tensor | None = None  # rows whose final-norm hidden states the model leaves in `hidden`
    hidden: torch.Tensor | None = None       # [len(hidden_rows), hidden], filled by the model
    cos: torch.Tensor | None = None          # filled by the model once per step (ops/rope.py rope_cos_sin:
    sin: torch.Tensor | None = None          # [R, 1, rotary_dim], sin with its first half negated)
