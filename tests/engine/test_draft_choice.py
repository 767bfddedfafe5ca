"""The choice between draft rows and deferred rows of a decoding turn (engine/draft_choice.py,
docs/mechanism.md §13): by expected value, from the cost model's estimates and the turn's own
acceptance. A tracked hybrid session carries one or the other; an attention-only one both, the higher
value per row first."""

from __future__ import annotations

import pytest

from raincheck_core.engine.cost_model import StepCostModel
from raincheck_core.engine.draft_choice import Prices, acceptance, drafts_win, expected_accepted
from raincheck_core.engine.plan import Kind
from raincheck_core.engine.scheduler import Scheduler
from raincheck_core.engine.speculation import Speculation
from tests.engine.test_scheduler import Join, _decoding, _Fixed, _kinds, _measured

HIGH, ZERO = (30, 30), (0, 30)       # (accepted, tried): every draft accepted, none


def test_the_prices_follow_the_formula():
    prices = Prices.of(_measured(), 1, 64)      # plain 10 ms, extra rows 1 ms + 0.1 ms per row
    assert prices.plain_s == pytest.approx(0.010)
    assert prices.later_row_s == pytest.approx((0.010 + 0.001 + 0.0064) / 64)
    assert acceptance(0, 0) == 0.5 and acceptance(3, 4) == pytest.approx(4 / 6)
    assert expected_accepted(0.5, 3) == pytest.approx(0.875)
    # V_d = E(k) T_plain - dC(k); dC on top of 7 carried rows has no fixed part
    assert prices.drafts(3, 0.5, 0) == pytest.approx(0.875 * 0.010 - 0.0013)
    assert prices.drafts(3, 0.5, 7) == pytest.approx(0.875 * 0.010 - 0.0003)
    assert prices.chunk(7, 0) == pytest.approx(7 * prices.later_row_s - 0.0017)
    # nothing measured: the plain step is the unit, the prior line (1 + 1/16 per row) its price
    unit = Prices.of(StepCostModel(), 1, 64)
    assert unit.plain_s == 1.0 and unit.marginal_s(0, 16) == pytest.approx(2.0)


def test_acceptance_decides_between_the_two():
    prices = Prices.of(_measured(), 1, 64)
    for exclusive in (True, False):
        assert drafts_win(prices, 3, acceptance(*HIGH), 7, 0, exclusive)
        assert not drafts_win(prices, 3, acceptance(*ZERO), 7, 0, exclusive)


def _plan(accept: tuple[int, int], join: bool, max_rows: int = 128):
    sched = Scheduler(max_rows, 63, 64, _measured(), speculation=Speculation(_Fixed(), 3, 1000))
    turn = _decoding("t", deferred=100, join=Join(prefix=7, live=3) if join else None)   # fixed 7-row chunks
    turn.drafts_accepted, turn.drafts_tried = accept
    sched.add(turn)
    return sched.schedule()


def test_a_tracked_hybrid_session_carries_drafts_or_a_chunk():
    """A GDN join pending: a chunk that joins would seed the verify rows inside the fused kernel, so the
    step carries the higher-valued one only; drafts that are always accepted win, drafts never accepted
    lose to the chunk."""
    drafts = _plan(HIGH, join=True)
    assert _kinds(drafts) == [(Kind.VERIFY, "t", 4)] and drafts.segments[0].tracked
    chunk = _plan(ZERO, join=True)
    assert _kinds(chunk) == [(Kind.DEFERRED, "t", 7), (Kind.DECODE, "t", 1)] and chunk.segments[1].tracked


def test_an_attention_only_session_carries_both_the_better_first():
    """No join: both ride on the step within the row budget; the higher value per row takes its rows
    first, so a tight budget cuts the other."""
    assert _kinds(_plan(HIGH, join=False)) == [(Kind.DEFERRED, "t", 7), (Kind.VERIFY, "t", 4)]
    assert _kinds(_plan(ZERO, join=False)) == [(Kind.DEFERRED, "t", 7), (Kind.VERIFY, "t", 4)]
    # 8 rows besides the decode row: the drafts first leave 5 for the chunk, the chunk first leaves 1 draft
    assert _kinds(_plan(HIGH, join=False, max_rows=9)) == [(Kind.DEFERRED, "t", 5), (Kind.VERIFY, "t", 4)]
    assert _kinds(_plan(ZERO, join=False, max_rows=9)) == [(Kind.DEFERRED, "t", 7), (Kind.VERIFY, "t", 2)]


def test_the_choice_depends_on_the_calibration_not_on_later_timings():
    """The estimates are frozen once a window is full: steps timed afterwards move no decision."""
    cost = _measured()
    for _ in range(40):
        cost.observe(1, 0, 0.010)
        cost.observe(1, 7, 0.0117)
    before = Prices.of(cost, 1, 64)
    for _ in range(40):
        cost.observe(1, 0, 0.100)      # a noisy neighbour
        cost.observe(1, 7, 0.500)
    assert Prices.of(cost, 1, 64) == before
