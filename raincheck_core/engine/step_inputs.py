"""A step's inputs as the runner built them (engine/runner.py `prepare`): the forward's batch and where each
segment's rows sit (`StepInputs`), and a step staged, built but not sent (`Staged`: `ModelRunner.stage`, and the
next decode step staged ahead, engine/ahead.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ..layers.batch import ForwardBatch
from ..ops.backend import OpSet
from ..ops.uploads import Uploads
from .gdn_inputs import Placed
from .graphs import Walked
from .padding import Bucket, Padded
from .plan import Kind, Segment, StepPlan


@dataclass
class StepInputs:
    batch: ForwardBatch
    placed: list[Placed]        # every segment, in plan order; the groups below are read off it
    # the tracked rows among the one-row sequences (`keep`), where not all are: on the step's device
    kept_rows: torch.Tensor | None = None
    # staged: the answer rows' input tokens in the host staging buffer (`PackedRows.tokens`), rewritable
    # until the step's copy
    tokens: np.ndarray | None = None

    @cached_property
    def multi(self) -> list[Segment]:
        return [p.segment for p in self.placed if p.multi and not p.idle]

    @cached_property
    def single(self) -> list[Segment]:
        return [p.segment for p in self.placed if not p.multi and not p.idle]

    @cached_property
    def joins(self) -> list[Segment]:
        return [s for s in self.multi if s.joins]

    @cached_property
    def keep(self) -> list[Segment]:
        """One-row sequences whose factors a pending join records (tracked decode rows)."""
        return [s for s in self.single if s.tracked]

    @cached_property
    def inputs(self) -> list[Segment]:
        """Multi-row sequences a pending join tracks (a follow-up's input, a verify segment)."""
        return [s for s in self.multi if s.tracked]


@dataclass
class Staged:
    """A step's inputs built and not yet sent (`ModelRunner.stage`); `ModelRunner.launch` sends them and runs
    its forward."""

    plan: StepPlan                  # as it runs: padded to `bucket` where a graph replays it
    ops: OpSet
    inputs: StepInputs
    uploads: Uploads                # whose copy sends the inputs
    bucket: Bucket | None = None    # the graph's bucket (None: an eager forward)
    padded: Padded | None = None
    walked: Walked | None = None    # the batch walked for its graph (`StepGraphs.walk`)

    def retoken(self, tokens: list[int]) -> None:
        """The decode rows' input tokens, drawn after the step was staged (engine/ahead.py), into its segments
        and its staged token ids (the embedding lookup reads them after the copy)."""
        decode = [s for s in self.plan.segments if s.kind is Kind.DECODE]
        staged = self.inputs.tokens
        if staged is None or len(staged) != len(decode) or len(tokens) != len(decode):
            raise ValueError(f"{len(tokens)} tokens for a staged step of {len(decode)} decode rows")
        for seg, token in zip(decode, tokens, strict=True):
            seg.token = token
        staged[:] = tokens
