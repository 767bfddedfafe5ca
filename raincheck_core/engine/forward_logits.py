"""The session-free forward (`Engine.forward_logits`): one sequence's full-prefill logits outside any
session, as a reference for identity checks and for clients that score text (log-likelihoods). The rows
are built here and run as one residual-kind segment of a scratch session (engine/core.py)."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..errors import InvalidInputError
from ..inputs import VisualInput
from ..models import DecoderLM
from ..multimodal.turn_input import TurnInput, build_turn_input
from .core import EngineCore
from .plan import Segment, StepPlan


def sequence_rows(model: DecoderLM, cfg: ModelConfig, input_ids: torch.Tensor | list[int] | None,
                  inputs_embeds: torch.Tensor | None, position_ids: torch.Tensor | None,
                  visual: list[VisualInput] | None, device: torch.device, dtype: torch.dtype) -> TurnInput:
    """The rows of `input_ids [T]` (placeholders for `visual`, which are scattered in and get 3-D
    positions) or `inputs_embeds [T, d]`; `position_ids [T]` or `[3, T]` override the computed positions."""
    if (input_ids is None) == (inputs_embeds is None):
        raise InvalidInputError("pass exactly one of input_ids and inputs_embeds")
    if input_ids is not None:
        rows = build_turn_input(model, cfg, _as_list(input_ids), list(visual or []), 0)
    else:
        if visual:
            raise InvalidInputError("visual inputs need input_ids with their placeholder tokens")
        embeds = inputs_embeds.to(device=device, dtype=dtype)
        if embeds.dim() != 2 or embeds.shape[1] != cfg.hidden_size:
            raise InvalidInputError(f"inputs_embeds must be [T, {cfg.hidden_size}], got {tuple(embeds.shape)}")
        t = embeds.shape[0]
        rows = TurnInput([0] * t, embeds, torch.arange(t).expand(3, -1), t, None,
                         torch.empty(0, dtype=torch.long), [])
    if position_ids is not None:
        rows.positions = _positions(position_ids, len(rows))
    return rows


def scratch_logits(core: EngineCore, rows: TurnInput) -> torch.Tensor:
    """`[T, vocab]` fp32 logits of `rows` run as one segment of a scratch session (the caller holds the
    engine's lock)."""
    with core.scratch_session(rows) as cache:
        n = len(rows)
        write = cache.claim(n)
        runner = core.runner
        plan = StepPlan([Segment.residual(cache.session, 0, n, write, cache.readable(n), cache.gdn_slot)])
        ops = runner.ops()
        inputs = runner.prepare(core.resolve(plan, ops.gdn), ops)
        inputs.batch.logit_rows = None
        return runner.forward(inputs).logits


def _as_list(ids: torch.Tensor | list[int]) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise InvalidInputError(f"input_ids must be 1-D [T], got shape {tuple(ids.shape)}")
        return ids.tolist()
    return list(ids)


def _positions(position_ids: torch.Tensor, t: int) -> torch.Tensor:
    if position_ids.dim() == 1:
        position_ids = position_ids.expand(3, -1)
    if tuple(position_ids.shape) != (3, t):
        raise InvalidInputError(f"position_ids must be [T] or [3, T] with T={t}, got {tuple(position_ids.shape)}")
    return position_ids.long()
