"""The scheduler alone: plans built from fake session views, no model, no pools.

A plan is plain data (engine/plan.py), so what the scheduler decides can be read off it directly:
admission order and the row budget, the guard, fixed chunks and the TPOT objective's chunk buckets,
the deferred budget across turns, post-answer recovery in the gaps and at a barrier, solo re-runs,
what each segment may read, and a turn's drafts beside or instead of its chunk by their expected value."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import torch

from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.deferral.recovery import Recovery
from raincheck_core.engine.cost_model import StepCostModel
from raincheck_core.engine.draft_choice import Prices, acceptance, drafts_win, expected_accepted
from raincheck_core.engine.plan import Kind
from raincheck_core.engine.scheduler import Scheduler
from raincheck_core.engine.speculation import Speculation

RAINCHECK = DeferralConfig("raincheck", selector="uniform", guard=4, chunk_size=7, tpot_slo=None)


class Rows:
    """A recovery's deferred rows, as far as the scheduler reads them: how many."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


@dataclass
class Join:
    prefix: int
    live: int
    lead_rows: int = 0


@dataclass(eq=False)
class Cache:
    """A session's cache view: `length` filled slots; claims hand out the next slot ids."""

    session: str
    length: int = 0
    gdn_slot: int | None = None
    recovery: Recovery | None = None
    deterministic: bool = False
    claimed: int = 0
    reads: list[tuple[int, bool]] = field(default_factory=list)
    labels: list[tuple[int, int | None, bool]] = field(default_factory=list)    # per claim: n, turn, GEN

    @property
    def next_position(self) -> int:
        return self.length

    def claim(self, n: int, turn: int | None = None, generated: bool = False) -> torch.Tensor:
        start = self.length + self.claimed
        self.claimed += n
        self.labels.append((n, turn, generated))
        return torch.arange(start, start + n)

    def readable(self, n: int) -> torch.Tensor:
        self.reads.append((n, False))
        return torch.arange(self.length + self.claimed)

    @property
    def pages(self) -> np.ndarray:      # slot i is on page i // 16, as `readable` numbers them
        return np.arange(-(-(self.length + self.claimed) // 16), dtype=np.int64)

    def deferred_readable(self, n: int, turn: int) -> tuple[torch.Tensor, np.ndarray]:
        self.reads.append((n, True))
        return torch.arange(self.length + self.claimed), np.zeros(0, dtype=np.int64)

    def recoveries(self) -> list[Recovery]:
        return [self.recovery] if self.recovery is not None else []


@dataclass(eq=False)
class Turn:
    cache: Cache
    input_rows: int = 10
    cursor: int = 0
    generated: int = 0                   # tokens sampled so far
    turn: int = 0
    tpot_slo: float | None = None
    decode_s: float = 0.0
    plain_s: float = 0.0
    step_tokens: int = 1                 # tokens its latest decode step emitted
    drafts_accepted: int = 0             # over the turn: its acceptance rate (engine/draft_choice.py)
    drafts_tried: int = 0

    @property
    def decoding(self) -> bool:
        return self.cursor >= self.input_rows

    @property
    def input_remaining(self) -> int:
        return self.input_rows - self.cursor

    @property
    def answer_fed(self) -> int:
        return self.generated - 1

    @property
    def last_token(self) -> int:
        return 100 + self.generated

    @property
    def draft_room(self) -> int:
        return 20 - self.generated - 1       # max_new_tokens 20

    def history(self) -> list[int]:
        return [100 + i for i in range(self.generated)]

    def slack_s(self, plain_step_s: float) -> float:
        return self.tpot_slo * (self.plain_s + plain_step_s) - self.decode_s - plain_step_s

    def charge(self, seconds: float, plain_step_s: float) -> None:
        self.decode_s += seconds
        self.plain_s += plain_step_s


def _decoding(name: str, generated: int = 10, deferred: int = 0, cfg: DeferralConfig = RAINCHECK,
              join: Join | None = None, tpot_slo: float | None = None) -> Turn:
    cache = Cache(name, length=20)
    if deferred:
        cache.recovery = Recovery(Rows(deferred), cfg, join)
    return Turn(cache, input_rows=10, cursor=10, generated=generated, tpot_slo=tpot_slo)


def _kinds(plan) -> list[tuple[Kind, str, int]]:
    return [(s.kind, s.session, s.rows) for s in plan.segments]


def test_decode_rows_first_then_prefill_oldest_first_within_the_row_budget():
    sched = Scheduler(max_rows_per_step=12, deferred_budget=63, recovery_chunk=64)
    old, new = Turn(Cache("old"), input_rows=8), Turn(Cache("new"), input_rows=8)
    dec = _decoding("dec")
    for t in (old, new, dec):
        sched.add(t)
    plan = sched.schedule()
    assert _kinds(plan) == [(Kind.DECODE, "dec", 1), (Kind.PREFILL, "old", 8), (Kind.PREFILL, "new", 3)]
    assert plan.rows == 12
    first, rest = plan.segments[1], plan.segments[2]
    assert first.sample and not rest.sample          # only the chunk that ends a turn's input samples
    assert torch.equal(rest.write_slots, torch.arange(0, 3)) and rest.first == 0
    decode = plan.segments[0]
    assert decode.token == 110 and decode.position == 20 and not decode.tracked
    assert dec.cache.labels == [(1, None, True)]            # the decode row's slot is labelled GEN


def test_the_guard_holds_fused_chunks_back_and_a_fixed_chunk_follows_it():
    sched = Scheduler(64, 63, 64)
    early = _decoding("early", generated=4, deferred=20)     # 3 tokens fed: inside a guard of 4
    late = _decoding("late", generated=5, deferred=20, join=Join(prefix=7, live=3, lead_rows=2))
    sched.add(early)
    sched.add(late)
    plan = sched.schedule()
    assert _kinds(plan) == [(Kind.DECODE, "early", 1), (Kind.DEFERRED, "late", 7), (Kind.DECODE, "late", 1)]
    chunk = plan.segments[1]
    assert chunk.gdn_slot == 7 and chunk.live_slot == 3 and chunk.lead == 2 and chunk.joins
    assert late.cache.reads == [(7, True), (1, False)]      # the chunk reads without GEN slots, its row with
    assert late.cache.labels == [(7, 0, False), (1, None, True)]   # chunk rows of turn 0, then a GEN row
    assert plan.segments[2].tracked
    assert not plan.segments[0].tracked    # no GDN join: nothing to track


def test_the_deferred_budget_is_shared_in_order_and_the_last_chunk_is_short():
    sched = Scheduler(64, deferred_budget=10, recovery_chunk=64)
    a, b = _decoding("a", deferred=20), _decoding("b", deferred=20)
    sched.add(a)
    sched.add(b)
    assert _kinds(sched.schedule()) == [(Kind.DEFERRED, "a", 7), (Kind.DECODE, "a", 1),
                                        (Kind.DEFERRED, "b", 3), (Kind.DECODE, "b", 1)]
    sched = Scheduler(64, 63, 64)
    sched.add(_decoding("c", deferred=5))
    assert _kinds(sched.schedule())[0] == (Kind.DEFERRED, "c", 5)    # fewer rows left than a chunk


def _measured(plain_s: float = 0.010) -> StepCostModel:
    """A cost model that has seen plain steps and two chunk buckets: extra = 1 ms + 0.1 ms per row."""
    cost = StepCostModel()
    for _ in range(3):
        cost.observe(1, 0, plain_s)
        cost.observe(1, 7, plain_s + 0.001 + 0.0007)
        cost.observe(1, 31, plain_s + 0.001 + 0.0031)
    return cost


def test_the_tpot_objective_fuses_the_largest_bucket_its_slack_pays_for():
    cfg = DeferralConfig("raincheck", selector="uniform", guard=0, tpot_slo=1.10)

    def fused(saved_s: float) -> int:
        sched = Scheduler(128, 63, 64, _measured())
        turn = _decoding("t", deferred=100, cfg=cfg, tpot_slo=1.10)
        turn.plain_s, turn.decode_s = 1.0, 1.0 + 0.1 - saved_s   # slack so far: what earlier steps saved
        sched.add(turn)
        plan = sched.schedule()
        return plan.rows_of(Kind.DEFERRED)

    # slack = 1.1 * (plain_s + 10 ms) - decode_s - 10 ms = saved + 1 ms
    assert fused(0.0) == 0                   # 1 ms of slack: not even 7 rows (1.7 ms)
    assert fused(0.0010) == 7                # 2 ms: 7 rows (1.7 ms), not 15 (2.5 ms)
    assert fused(0.0035) == 31               # 4.5 ms: 31 rows (4.1 ms), not 63 (7.3 ms)
    assert fused(0.0100) == 63


class _Fixed:
    """A drafter that always proposes the same three tokens."""

    needs_hidden = False

    def propose(self, session, history, k):
        return [7, 8, 9][:k]


def test_draft_rows_cost_rows_under_the_objective_and_respect_the_length_limit():
    """A verify segment (the last token and its drafts) takes the decode row's place; its draft rows are
    carried rows, so the same slack pays for a smaller chunk beside them; near `max_new_tokens` fewer
    drafts are verified."""
    cfg = DeferralConfig("raincheck", selector="uniform", guard=0, tpot_slo=1.10)

    def plan(k: int | None, generated: int = 10):
        sched = Scheduler(128, 63, 64, _measured(), speculation=None if k is None else Speculation(_Fixed(), k, 1000))
        turn = _decoding("t", generated=generated, deferred=100, cfg=cfg, tpot_slo=1.10)
        turn.plain_s, turn.decode_s = 1.0, 1.0 + 0.1 - 0.0008      # 1.8 ms of slack
        sched.add(turn)
        return sched.schedule()

    assert _kinds(plan(None)) == [(Kind.DEFERRED, "t", 7), (Kind.DECODE, "t", 1)]    # 7 rows: 1.7 ms
    verify = plan(3)
    assert _kinds(verify) == [(Kind.VERIFY, "t", 4)]            # 3 drafts + 7 rows would cost 2.0 ms
    assert verify.segments[0].tokens == (110, 7, 8, 9) and verify.segments[0].position == 20
    # room for one draft before the limit (and beside one draft row, 7 rows cost 1.8 ms: they fit)
    assert _kinds(plan(3, generated=18)) == [(Kind.DEFERRED, "t", 7), (Kind.VERIFY, "t", 2)]
    assert _kinds(plan(3, generated=19)) == [(Kind.DEFERRED, "t", 7), (Kind.DECODE, "t", 1)]


class _Broken:
    needs_hidden = False

    def __init__(self, drafts):
        self.out = drafts

    def propose(self, session, history, k):
        if isinstance(self.out, Exception):
            raise self.out
        return self.out


def test_a_failing_drafter_or_a_token_outside_the_vocabulary_leaves_plain_decoding():
    def kinds(drafter) -> list:
        sched = Scheduler(128, 63, 64, speculation=Speculation(drafter, 3, vocab_size=50))
        sched.add(_decoding("t"))
        return [(s.kind, s.drafts) for s in sched.schedule().segments]

    assert kinds(_Broken(RuntimeError("drafter bug"))) == [(Kind.DECODE, ())]
    assert kinds(_Broken([7, 50, 8])) == [(Kind.VERIFY, (7,))]        # 50 is past the vocabulary: drafts end
    assert kinds(_Broken([-1])) == [(Kind.DECODE, ())]


def test_no_plain_step_measured_yet_means_no_fused_rows_under_an_objective():
    cfg = DeferralConfig("raincheck", selector="uniform", guard=0, tpot_slo=1.10)
    sched = Scheduler(128, 63, 64, StepCostModel())
    sched.add(_decoding("t", deferred=100, cfg=cfg, tpot_slo=1.10))
    assert sched.schedule().rows_of(Kind.DEFERRED) == 0


def test_post_answer_recovery_takes_the_whole_budget_alone_and_the_deferred_budget_beside_decode():
    cfg = DeferralConfig("post_answer", selector="uniform")
    sched = Scheduler(max_rows_per_step=40, deferred_budget=9, recovery_chunk=32)
    idle = Cache("idle", length=30, recovery=Recovery(Rows(100), cfg, None))
    idle.recovery.mark_answer_done(0.0)
    sched.add_recovering(idle)
    assert _kinds(sched.schedule()) == [(Kind.RECOVERY, "idle", 32)]       # a recovery chunk, alone
    idle.claimed = 0
    sched.add(_decoding("busy"))
    assert _kinds(sched.schedule()) == [(Kind.DECODE, "busy", 1), (Kind.RECOVERY, "idle", 9)]
    idle.claimed = 0
    # a barrier wait for this session may take the whole remaining budget, whatever else decodes
    assert _kinds(sched.schedule(only=idle)) == [(Kind.DECODE, "busy", 1), (Kind.RECOVERY, "idle", 32)]


def test_a_recovery_complete_but_not_settled_leaves_the_budget_to_the_next():
    # a step planned during the one whose chunk completed a recovery (engine/ahead.py) still finds it listed
    cfg = DeferralConfig("post_answer", selector="uniform")
    sched = Scheduler(max_rows_per_step=40, deferred_budget=9, recovery_chunk=32)
    for name, rows in (("done", 0), ("idle", 100)):
        cache = Cache(name, length=30, recovery=Recovery(Rows(rows), cfg, None))
        cache.recovery.mark_answer_done(0.0)
        sched.add_recovering(cache)
    sched.add(_decoding("busy"))
    assert _kinds(sched.schedule()) == [(Kind.DECODE, "busy", 1), (Kind.RECOVERY, "idle", 9)]


def test_a_held_recovery_is_left_to_its_deferred_worker_until_a_barrier_races_it():
    cfg = DeferralConfig("post_answer", selector="uniform")
    sched = Scheduler(64, 63, 64)
    cache = Cache("held", length=30, recovery=Recovery(Rows(16), cfg, None))
    cache.recovery.mark_answer_done(0.0)
    cache.recovery.hold(fuse=True)
    sched.add_recovering(cache)
    assert not sched.schedule()
    cache.recovery.race()
    assert _kinds(sched.schedule()) == [(Kind.RECOVERY, "held", 16)]


def test_a_solo_rerun_plans_one_session_only():
    sched = Scheduler(64, 63, 64)
    a, b = _decoding("a", deferred=20), Turn(Cache("b"), input_rows=5)
    sched.add(a)
    sched.add(b)
    assert {s.session for s in sched.schedule(solo=b.cache).segments} == {"b"}
    assert {s.session for s in sched.schedule(solo=a.cache).segments} == {"a"}


def test_serial_mode_puts_the_chunk_in_a_pass_before_the_rest():
    cfg = DeferralConfig("raincheck", selector="uniform", guard=0, chunk_size=7, tpot_slo=None, fused=False)
    sched = Scheduler(64, 63, 64)
    sched.add(_decoding("s", deferred=20, cfg=cfg))
    sched.add(_decoding("f", deferred=20))
    first, rest = sched.schedule().passes()
    assert _kinds(first) == [(Kind.DEFERRED, "s", 7)]
    assert _kinds(rest) == [(Kind.DECODE, "s", 1), (Kind.DEFERRED, "f", 7), (Kind.DECODE, "f", 1)]


def test_accounting_teaches_the_cost_model_and_charges_each_decoding_turn():
    sched = Scheduler(64, 63, 64)
    a, b = _decoding("a"), _decoding("b")
    sched.add(a)
    sched.add(b)
    turns = {"a": a, "b": b}
    sched.account(sched.schedule(), 0.020, turns.get)
    assert sched.cost.plain_s(2) == 0.020
    assert a.decode_s == b.decode_s == 0.020 and a.plain_s == 0.020


def test_a_deterministic_session_never_shares_a_step_and_takes_turns_with_the_rest():
    sched = Scheduler(64, 63, 64)
    a, b = _decoding("a"), _decoding("b")
    det = _decoding("det", deferred=40, cfg=replace(RAINCHECK, chunk_size=15, tpot_slo=1.1,
                                                    deterministic=True))
    det.cache.deterministic = True
    for t in (a, det, b):
        sched.add(t)
    plans = [_kinds(sched.schedule()) for _ in range(4)]
    groups = [{s for _, s, _ in plan} for plan in plans]
    assert groups in ([{"det"}, {"a", "b"}] * 2, [{"a", "b"}, {"det"}] * 2)
    alone = next(plan for plan in plans if plan[-1][1] == "det")
    assert alone == [(Kind.DEFERRED, "det", 15), (Kind.DECODE, "det", 1)]   # its fixed chunk, no objective
    # its barrier steps it alone; another session's barrier steps the shared group only
    assert {s for _, s, _ in _kinds(sched.schedule(only=det.cache))} == {"det"}
    assert {s for _, s, _ in _kinds(sched.schedule(only=a.cache))} == {"a", "b"}


# the choice between draft rows and deferred rows of a decoding turn (engine/draft_choice.py, docs/mechanism.md
# §13): by expected value, from the cost model's estimates and the turn's own acceptance
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
