"""What the engine's own steps cost, learned online: the input of the TPOT objective (docs/mechanism.md §7).

Two things are tracked, both from measured step durations (the engine's clock, whole steps):
- the plain decode step, per batch size (decode rows in the step): a step with no deferral work at all.
  A step whose decode rows only extend a GDN join's map (a turn with deferred rows still pending) is kept
  apart and stands in only while no plain step of that size was measured: that bookkeeping is part of
  what deferral costs, so the objective charges it instead of hiding it in its reference;
- the *extra* cost of a decode step that also carries deferred rows, over the plain step of its batch
  size, as `fixed + per_row * rows` (`ChunkCost`). Observations are grouped by chunk bucket
  (7/15/31/63 rows); each group keeps a rolling median, and the line is fitted through the medians, so
  one slow step (a page fault, a noisy neighbour, a GC pause) moves nothing.

Decisions read each estimate (a batch size's plain step, a bucket's extra cost) held: it follows its
rolling median freely while the median's window is filling (the warm-up fills them), then only once the
median has been more than `DRIFT` away for `SETTLE` observations in a row. Timing noise and short bursts
(a new shape's first steps, a GC pause) then never change a decision, so the same request on an idle
server gets the same chunks (and the same answer), while a sustained change (load, a slower machine)
still moves the estimates.

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
DRIFT = 0.20          # how far a rolling median moves from its frozen estimate before the estimate follows
SETTLE = 8            # observations in a row the median must stay that far (a burst of slow steps does not)


@dataclass(frozen=True)
class ChunkCost:
    """Extra seconds of a decode step that carries `rows` deferred rows, over the plain step."""

    fixed_s: float
    per_row_s: float

    def __call__(self, rows: int) -> float:
        return self.fixed_s + self.per_row_s * rows if rows > 0 else 0.0


def _bucket(rows: int) -> int:
    return next((b for b in CHUNK_SIZES if rows <= b), CHUNK_SIZES[-1])


class StepCostModel:
    def __init__(self, window: int = WINDOW, drift: float = DRIFT, settle: int = SETTLE):
        self.window = window
        self.drift = drift
        self.settle = settle
        self._plain: dict[int, deque[float]] = {}
        self._tracked: dict[int, deque[float]] = {}                # steps that only track joins
        self._extra: dict[int, deque[tuple[int, float]]] = {}   # chunk bucket -> (rows, extra seconds)
        # the frozen estimates decisions read (module docstring): plain and join-tracking steps by batch
        # size, and (rows, extra seconds) by chunk bucket
        self._plain_at: dict[int, float] = {}
        self._tracked_at: dict[int, float] = {}
        self._extra_at: dict[int, tuple[float, float]] = {}
        self._drifting: dict[tuple[str, int], int] = {}   # estimate -> observations in a row past its band

    def observe(self, batch: int, deferred_rows: int, seconds: float, tracked: bool = False) -> None:
        """A decode step of `batch` decode rows that carried `deferred_rows` deferred rows took `seconds`;
        `tracked`: some of its decode rows extend a GDN join's map."""
        if deferred_rows == 0:
            windows, frozen = (self._tracked, self._tracked_at) if tracked else (self._plain, self._plain_at)
            obs = windows.setdefault(batch, deque(maxlen=self.window))
            obs.append(seconds)
            live = statistics.median(obs)
            old = frozen.get(batch)
            if self._moved(("tracked" if tracked else "plain", batch), old, live, self.drift * (old or 0.0), obs):
                frozen[batch] = live
            return
        plain = self.plain_s(batch)
        if plain is not None:
            bucket = _bucket(deferred_rows)
            obs = self._extra.setdefault(bucket, deque(maxlen=self.window))
            obs.append((deferred_rows, seconds - plain))
            live = (statistics.median(r for r, _ in obs), statistics.median(e for _, e in obs))
            old = self._extra_at.get(bucket)
            # an extra cost is small beside the step it rides on: it moves when it moves by a share of that
            tolerance = self.drift * max(abs(old[1]), plain) if old is not None else 0.0
            if self._moved(("extra", bucket), old and old[1], live[1], tolerance, obs):
                self._extra_at[bucket] = live

    def _moved(self, key: tuple[str, int], old: float | None, live: float, tolerance: float, obs: deque) -> bool:
        """Should estimate `key` (now `old`; None: none yet) follow its median `live`: always while its
        window `obs` is filling (a few first steps are no estimate to hold), then once the median has been
        more than `tolerance` away for `settle` observations in a row."""
        if old is None or len(obs) < self.window:
            return True
        if abs(live - old) <= tolerance:
            self._drifting.pop(key, None)
            return False
        self._drifting[key] = self._drifting.get(key, 0) + 1
        if self._drifting[key] < self.settle:
            return False
        del self._drifting[key]
        return True

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
