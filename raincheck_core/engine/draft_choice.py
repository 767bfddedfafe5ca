"""Draft rows or deferred rows: what a decoding turn's step carries when it could carry both, by their
expected value (docs/mechanism.md §13, "Drafts or a chunk").

Both are priced from the cost model's frozen estimates (engine/cost_model.py) and the turn's own draws,
never a step's timing, so the same request on an idle server makes the same choices:
- k drafts, each accepted with probability α given the ones before it, save `E(k) = α + α² + … + α^k`
  plain decode steps, and cost their marginal extra rows on the step's line: `V_d = E(k)·T_plain −
  ΔC(k)`. α is the turn's share of accepted drafts among those a draw was compared with, with a prior of
  one accepted and one rejected (1/2 before the first verify);
- c deferred rows now save what they would cost later in a post-answer chunk, a step of its own of
  `recovery_chunk` rows R (a one-row step's base and R rows on the line), and cost their marginal rows
  now: `V_c = c·(T_plain(1) + C(R))/R − ΔC(c)`.
`ΔC(n) = C(carried + n) − C(carried)` with `C(n) = fixed + per_row·n` and `carried` the extra rows the
step already holds. Before any plain step is measured the plain step is the unit and the line is the cost
model's prior (one plain step + 1/16 of one per row).
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost_model import ChunkCost, StepCostModel


def acceptance(accepted: int, tried: int) -> float:
    """α: the turn's accepted share of the drafts a draw was compared with, one of each assumed beforehand."""
    return (accepted + 1) / (tried + 2)


def expected_accepted(alpha: float, k: int) -> float:
    """E(k): expected accepted drafts of k, each accepted with probability `alpha` after the previous was."""
    return sum(alpha ** i for i in range(1, k + 1))


@dataclass(frozen=True)
class Prices:
    """A step's prices in seconds, from the cost model's estimates."""

    plain_s: float          # the plain decode step at the step's batch size
    line: ChunkCost         # extra rows on a decode step: fixed + per_row · rows
    later_row_s: float      # one deferred row in a post-answer chunk

    @classmethod
    def of(cls, cost: StepCostModel, batch: int, recovery_chunk: int) -> Prices:
        plain = cost.plain_s(batch)
        line = cost.predictor(batch)
        if plain is None or line is None:      # nothing measured yet: in units of a plain step, the prior line
            plain, line = 1.0, ChunkCost(1.0, 1 / 16)
        alone = cost.plain_s(1) or plain
        return cls(plain, line, (alone + line(recovery_chunk)) / recovery_chunk)

    def marginal_s(self, carried: int, rows: int) -> float:
        """What `rows` more extra rows add to a step that already carries `carried`."""
        return self.line(carried + rows) - self.line(carried)

    def drafts(self, k: int, alpha: float, carried: int) -> float:
        """V_d: the expected value of `k` drafts."""
        return expected_accepted(alpha, k) * self.plain_s - self.marginal_s(carried, k)

    def chunk(self, c: int, carried: int) -> float:
        """V_c: the value of `c` deferred rows in this step."""
        return c * self.later_row_s - self.marginal_s(carried, c)


def drafts_win(prices: Prices, k: int, alpha: float, c: int, carried: int, exclusive: bool) -> bool:
    """Whether `k` drafts (acceptance `alpha`) take the turn's rows before `c` deferred rows of its session
    (the higher value per row first), or, `exclusive` (a tracked hybrid session: one or the other), instead
    of them (the higher value). Ties go to the drafts, the answer's own tokens."""
    v_d, v_c = prices.drafts(k, alpha, carried), prices.chunk(c, carried)
    return v_d >= v_c if exclusive else v_d / k >= v_c / c
