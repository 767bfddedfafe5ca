"""What the engine's own steps cost, measured at calibration: the input of the TPOT objective (docs/mechanism.md §7).

Two things are tracked, both from measured step durations (the engine's clock, whole steps):
- the plain decode step, per batch size (decode rows in the step): a step with no deferral work at all.
  A step whose decode rows only extend a GDN join's map (a turn with deferred rows still pending) is kept
  apart and stands in only while no plain step of that size was measured: that bookkeeping is part of
  what deferral costs, so the objective charges it instead of hiding it in its reference;
- the *extra* cost of a decode step that also carries deferred rows, over the plain step of its batch
  size, as `fixed + per_row * rows` (`ChunkCost`). Observations are grouped by chunk bucket
  (7/15/31/63 rows); each group keeps a rolling median, and the line is fitted through the medians, so
  one slow step (a page fault, a noisy neighbour, a GC pause) moves nothing.

Decisions read each estimate (a batch size's plain step, a bucket's extra cost) frozen: it follows its
rolling median while the median's window is filling (the warm-up fills them), then stays, so a decision
depends only on the calibration and on what the step holds, never on timing noise, and the same request
on an idle server gets the same chunks (and the same answer). That gives up nothing the objective needs:
it compares a chunk's extra cost with the slack saved in plain steps, both from the same estimates, so a
machine that gets uniformly slower or faster (load on the host, another clock speed) changes no decision.
`drift()` reports how far the live medians have moved from the frozen estimates (a worker gauge); only a
change in the *ratios* (a chunk costing more relative to a plain step than at calibration) would call for
a fresh calibration, which is a restart of the worker.

Before any chunk step has been measured the model assumes a deliberately expensive prior (a chunk step
costs one extra plain step plus a sixteenth of one per row): the first chunk runs only once the turn has
saved that much slack, and its measurement replaces the prior.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from ..deferral.policy import CHUNK_SIZES

WINDOW = 31           # observations kept per batch size / chunk bucket (rolling medians)


@dataclass(frozen=True)
class ChunkCost:
    """Extra seconds of a decode step that carries `rows` deferred rows, over the plain step."""

    fixed_s: float
    per_row_s: float

    def __call__(self, rows: int) -> float:
        return self.fixed_s + self.per_row_s * rows if rows > 0 else 0.0


def _bucket(rows: int) -> int:
    return next((b for b in CHUNK_SIZES if rows <= b), CHUNK_SIZES[-1])


def _medians(obs: deque[tuple[int, float]]) -> tuple[float, float]:
    """(rows, extra seconds): the medians of a chunk bucket's window."""
    return statistics.median(r for r, _ in obs), statistics.median(e for _, e in obs)


class StepCostModel:
    def __init__(self, window: int = WINDOW):
        self.window = window
        self._plain: dict[int, deque[float]] = {}
        self._tracked: dict[int, deque[float]] = {}                # steps that only track joins
        self._extra: dict[int, deque[tuple[int, float]]] = {}   # chunk bucket -> (rows, extra seconds)
        # the frozen estimates decisions read (module docstring): plain and join-tracking steps by batch
        # size, and (rows, extra seconds) by chunk bucket
        self._plain_at: dict[int, float] = {}
        self._tracked_at: dict[int, float] = {}
        self._extra_at: dict[int, tuple[float, float]] = {}

    def observe(self, batch: int, deferred_rows: int, seconds: float, tracked: bool = False) -> None:
        """A decode step of `batch` decode rows that carried `deferred_rows` deferred rows took `seconds`;
        `tracked`: some of its decode rows extend a GDN join's map."""
        if deferred_rows == 0:
            windows, frozen = (self._tracked, self._tracked_at) if tracked else (self._plain, self._plain_at)
            obs = windows.setdefault(batch, deque(maxlen=self.window))
            filling = len(obs) < self.window     # a full window's median is the estimate from then on
            obs.append(seconds)
            if filling:
                frozen[batch] = statistics.median(obs)
            return
        plain = self.plain_s(batch)
        if plain is not None:
            bucket = _bucket(deferred_rows)
            obs = self._extra.setdefault(bucket, deque(maxlen=self.window))
            filling = len(obs) < self.window
            obs.append((deferred_rows, seconds - plain))
            if filling:
                self._extra_at[bucket] = _medians(obs)

    def drift(self) -> float:
        """How far the live medians of full windows stand from the frozen estimates, at most: a plain or
        join-tracking step as a share of its estimate, a chunk's extra cost as a share of the plain step
        it rides on (it is small beside it). 0.0 before any window is full."""
        gaps = [abs(statistics.median(obs) / frozen[b] - 1.0)
                for windows, frozen in ((self._plain, self._plain_at), (self._tracked, self._tracked_at))
                for b, obs in windows.items() if len(obs) >= self.window and frozen[b] > 0]
        reference = self.plain_s(1)
        if reference:
            gaps += [abs(_medians(obs)[1] - self._extra_at[b][1]) / reference
                     for b, obs in self._extra.items() if len(obs) >= self.window]
        return max(gaps, default=0.0)

    def plain_s(self, batch: int) -> float | None:
        """The plain decode step at this batch size: measured without deferral work, else with join
        tracking only; the nearest measured size's when this one is not."""
        for table in (self._plain_at, self._tracked_at):
            if batch in table:
                return table[batch]
        table = self._plain_at or self._tracked_at
        if not table:
            return None
        return table[min(table, key=lambda b: (abs(b - batch), b))]

    def expected_s(self, batch: int, deferred_rows: int, tracked: bool) -> float | None:
        """What a decode step of `batch` rows carrying `deferred_rows` is expected to take: the estimate of
        its kind (join-tracking steps apart from plain ones), plus the fitted chunk cost."""
        base = self._tracked_at[batch] if tracked and batch in self._tracked_at else self.plain_s(batch)
        if base is None:
            return None
        predict = self.predictor(batch) if deferred_rows else None
        return base + (predict(deferred_rows) if predict is not None else 0.0)

    def batches_measured(self) -> set[int]:
        """Batch sizes with a measured plain decode step."""
        return set(self._plain_at)

    def buckets_measured(self) -> int:
        """Chunk buckets with at least one measured step."""
        return len(self._extra_at)

    def buckets_full(self) -> int:
        """Chunk buckets whose window of measured steps is full."""
        return sum(1 for obs in self._extra.values() if len(obs) >= self.window)

    def chunk_cost(self) -> ChunkCost | None:
        """The fitted extra cost of carrying deferred rows; None before any chunk step was measured."""
        points = list(self._extra_at.values())
        if not points:
            return None
        if len(points) == 1:   # one size measured: split it evenly between fixed and per-row cost
            rows, extra = points[0]
            extra = max(extra, 0.0)
            return ChunkCost(extra / 2, extra / (2 * rows))
        rows, extra = zip(*points, strict=True)
        slope = max(statistics.linear_regression(rows, extra).slope, 0.0)
        # the line through the means with the (clamped) slope; a negative fixed cost is noise
        return ChunkCost(max(statistics.fmean(extra) - slope * statistics.fmean(rows), 0.0), slope)

    def predictor(self, batch: int) -> ChunkCost | None:
        """What deferred rows add to a decode step of `batch` rows, as known now: the fit, else the prior
        (one plain step + 1/16 of one per row); None before any plain step was measured."""
        cost = self.chunk_cost()
        if cost is not None:
            return cost
        plain = self.plain_s(batch)
        return None if plain is None else ChunkCost(plain, plain / 16)
