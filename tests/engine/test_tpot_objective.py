"""The TPOT objective (DeferralConfig.tpot_slo): the scheduler fuses deferred rows only while the answer's
mean TPOT stays within it, on a simulated clock whose step costs are known; the recovered rows are the
same whatever it chooses."""

from __future__ import annotations

import random

import pytest
import torch

from raincheck_core import Engine, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine.cost_model import StepCostModel
from raincheck_core.engine.plan import Kind, StepPlan
from raincheck_core.errors import InvalidInputError
from tests.deferral.helpers import image_prompt, record_prefix_states

GRID = (1, 24, 24)          # 144 visual tokens: D is ~100 rows at retention 0.3
ANSWER = 64


class SimulatedSteps:
    """The engine's clock advances by a synthetic cost per forward: a plain decode step of b rows costs
    10 ms + 0.2 ms * b; deferred rows on it add 20 ms + 1.5 ms per row (a CPU-like, expensive chunk);
    prefill rows 0.5 ms each. Records each decode step's cost and deferred rows."""

    def __init__(self, engine: Engine, fixed_s: float = 0.020, per_row_s: float = 0.0015, tracking_s: float = 0.0):
        self.t = 0.0
        self.fixed_s, self.per_row_s, self.tracking_s = fixed_s, per_row_s, tracking_s
        self.decode_steps: list[tuple[float, float, int]] = []    # (seconds, plain seconds, deferred rows)
        engine.use_clock(lambda: self.t)
        engine.on_plan(self.advance)

    def advance(self, plan: StepPlan) -> None:
        """The forward about to run takes its synthetic cost on the engine's clock."""
        self.t += self.cost(plan)

    def cost(self, plan: StepPlan) -> float:
        decode = sum(1 for s in plan.segments if s.kind is Kind.DECODE)
        deferred = sum(s.rows for s in plan.segments if s.kind in (Kind.DEFERRED, Kind.RECOVERY))
        prefill = sum(s.rows for s in plan.segments if s.kind is Kind.PREFILL)
        if not decode:
            return 0.0005 * (prefill + deferred)
        plain = 0.010 + 0.0002 * decode
        extra = self.fixed_s + self.per_row_s * deferred if deferred else 0.0
        # the GDN join's bookkeeping on each decode row of a turn with deferred rows pending
        extra += self.tracking_s * sum(1 for s in plan.segments if s.tracked)
        self.decode_steps.append((plain + extra, plain, deferred))
        return plain + extra + 0.0005 * prefill


def _answer(engine: Engine, tpot_slo: float | None, chunk_size: int = 31, seed: int = 0):
    cfg = DeferralConfig("raincheck", selector="uniform", chunk_size=chunk_size, tpot_slo=tpot_slo)
    session = engine.open_session(deferral=cfg)
    end = session.turn(image_prompt(engine, seed=seed, grid=GRID),
                       SamplingParams(max_new_tokens=ANSWER, ignore_eos=True)).result()
    return session, end.metrics


@pytest.fixture(params=["qwen3_vl", "qwen3_5"])
def engine(request, tiny_checkpoints):
    return Engine.from_pretrained(tiny_checkpoints[request.param][1])


@pytest.mark.parametrize("slo", [1.10, 1.5])
def test_mean_tpot_stays_within_the_objective(engine, slo):
    sim = SimulatedSteps(engine)
    session, m = _answer(engine, slo)
    steps = sim.decode_steps
    assert len(steps) == ANSWER - 1
    spent, plain = sum(s for s, _, _ in steps), sum(p for _, p, _ in steps)
    assert spent <= slo * plain * (1 + 1e-9)
    restored = m.deferred_tokens - m.deferred_pending
    assert restored > 0 and (slo > 1.2 or restored < m.deferred_tokens)   # tight: some fused, the rest after
    chunks = [r for _, _, r in steps if r]       # each in a bucket, but for D's last rows
    assert set(chunks[:-1]) <= {7, 15, 31, 63}
    session.complete_recovery()
    assert session.pending_deferred == 0


def test_join_bookkeeping_is_charged_against_a_plain_step_without_it(engine):
    """A turn with deferred rows pending pays for tracking its GDN join on every decode step (here 4% of a
    plain step). Once a plain step without any deferral work was measured (a `full` turn before), the
    objective holds the turn's TPOT against that step, bookkeeping included (against its own tracked
    steps, Qwen3.5 would spend 1.12x here)."""
    sim = SimulatedSteps(engine, fixed_s=0.004, per_row_s=0.0004, tracking_s=0.0004)
    engine.open_session(deferral=DeferralConfig("full")).turn(
        image_prompt(engine, seed=1, grid=GRID), SamplingParams(max_new_tokens=40, ignore_eos=True)).result()
    sim.decode_steps.clear()
    _answer(engine, 1.10)
    spent, plain = sum(s for s, _, _ in sim.decode_steps), sum(p for _, p, _ in sim.decode_steps)
    assert spent <= 1.10 * plain * (1 + 1e-9)


def test_the_cost_model_keeps_join_tracking_steps_apart():
    model = StepCostModel()
    model.observe(1, 0, 0.012, tracked=True)
    assert model.plain_s(1) == pytest.approx(0.012)          # all that is known stands in
    model.observe(2, 0, 0.010)
    assert model.plain_s(1) == pytest.approx(0.012)          # this size is known, if only with tracking
    model.observe(1, 0, 0.010)
    model.observe(1, 7, 0.020)
    assert model.plain_s(1) == pytest.approx(0.010)
    assert model.chunk_cost()(7) == pytest.approx(0.010)     # extra over the step without deferral work


def test_a_looser_objective_restores_more_during_the_answer(engine):
    restored = {}
    for slo in (1.05, 1.3, 2.0, 4.0):
        SimulatedSteps(engine)
        _, m = _answer(engine, slo)
        restored[slo] = m.deferred_tokens - m.deferred_pending
    assert list(restored.values()) == sorted(restored.values()), restored
    assert restored[1.05] < restored[4.0]


def test_without_an_objective_every_step_past_the_guard_fuses_chunk_size(engine):
    sim = SimulatedSteps(engine)
    _, m = _answer(engine, None, chunk_size=7)
    rows = [r for _, _, r in sim.decode_steps]
    fused = m.deferred_tokens - m.deferred_pending
    assert rows[:16] == [0] * 16                       # guard 16: the steps that feed y1 … y16 carry nothing
    assert rows[16:16 + fused // 7] == [7] * (fused // 7)


def test_an_expensive_batch_of_other_turns_gets_no_chunks(engine):
    """Sharing the steps with a turn whose slack is spent (it was slowed by a prefill of someone else's
    long input): the objective of the tightest turn holds the chunks back."""
    sim = SimulatedSteps(engine, fixed_s=0.5)      # a chunk costs 50 plain steps: nothing can pay for it
    _, m = _answer(engine, 1.10)
    assert m.deferred_pending == m.deferred_tokens - sum(r for _, _, r in sim.decode_steps)
    assert sum(r for _, _, r in sim.decode_steps) <= 7     # at most the first try, on the prior


def test_every_schedule_restores_the_same_rows(engine, monkeypatch):
    """Fixed chunks of 7 or 31, objectives tight or loose: D's K/V and the GDN prefix state after I0 ‖ D
    come out the same once recovery completes (D never sees the answer: the order of chunks is free)."""
    prefix_states = record_prefix_states(monkeypatch)
    restored = []
    for slo, chunk in ((None, 7), (None, 31), (1.10, 31), (2.0, 31), (1e9, 63)):
        SimulatedSteps(engine)
        cfg = DeferralConfig("raincheck", selector="uniform", chunk_size=chunk, tpot_slo=slo)
        session = engine.open_session(deferral=cfg)
        stream = session.turn(image_prompt(engine, seed=3, grid=GRID), SamplingParams(max_new_tokens=40,
                                                                                   ignore_eos=True))
        rec = session.cache.recovery
        stream.result()
        session.complete_recovery()
        slots = torch.cat(rec.slots)
        restored.append((engine.kv.k[:, slots].clone(), engine.kv.v[:, slots].clone()))
        session.close()
    for k, v in restored[1:]:
        assert torch.allclose(k, restored[0][0], atol=1e-5) and torch.allclose(v, restored[0][1], atol=1e-5)
    for conv, ssm in prefix_states[1:]:
        assert torch.allclose(conv, prefix_states[0][0], atol=1e-5)
        assert torch.allclose(ssm, prefix_states[0][1], atol=1e-5)


def test_the_cost_model_ignores_outliers():
    rng = random.Random(0)
    model = StepCostModel()
    for i in range(200):
        noise = 1 + rng.uniform(-0.05, 0.05)
        spike = 40.0 if i % 17 == 0 else 1.0          # a GC pause, a noisy neighbour
        model.observe(16, 0, 0.009 * noise * spike)
        rows = rng.choice([7, 15, 31, 63])
        model.observe(16, rows, (0.009 + 0.006 + 0.0004 * rows) * noise * (40.0 if i % 23 == 0 else 1.0))
    assert model.plain_s(16) == pytest.approx(0.009, rel=0.05)
    assert model.plain_s(20) == model.plain_s(16)     # the nearest measured batch size stands in
    cost = model.chunk_cost()
    assert cost.fixed_s == pytest.approx(0.006, rel=0.15)
    assert cost.per_row_s == pytest.approx(0.0004, rel=0.1)


def test_estimates_are_frozen_once_calibrated_and_drift_is_reported():
    """Decisions read the estimates frozen when their windows filled: more noise, a burst of slow steps, or
    a machine that got slower for good change no decision (the same request on an idle server gets the
    same chunks; the objective compares costs measured on one clock); `drift()` shows the gap."""
    rng = random.Random(1)
    model = StepCostModel()
    assert model.drift() == 0.0
    for _ in range(40):
        model.observe(1, 0, 0.010 * (1 + rng.uniform(-0.05, 0.05)))
        model.observe(1, 15, 0.016 * (1 + rng.uniform(-0.05, 0.05)))
    plain, cost = model.plain_s(1), model.chunk_cost()
    assert plain == pytest.approx(0.010, rel=0.05) and model.drift() < 0.1
    seen = set()
    for i in range(300):                        # noise, a burst, then 50% slower for good
        slow = 1.5 if i >= 100 else (4.0 if 40 <= i < 50 else 1.0)
        model.observe(1, 0, slow * 0.010 * (1 + rng.uniform(-0.05, 0.05)))
        model.observe(1, 15, slow * 0.016 * (1 + rng.uniform(-0.05, 0.05)))
        seen.add((model.plain_s(1), model.chunk_cost(), model.expected_s(1, 15, False)))
    assert seen == {(plain, cost, model.expected_s(1, 15, False))}
    assert model.drift() > 0.45      # plain steps 50% over their estimate (chunk steps more, over the old plain)


def test_the_cost_model_knows_nothing_before_a_plain_step():
    model = StepCostModel()
    assert model.plain_s(4) is None and model.predictor(4) is None and model.chunk_cost() is None
    model.observe(4, 7, 0.05)                          # a chunk step with no plain step to compare: dropped
    assert model.chunk_cost() is None
    model.observe(4, 0, 0.01)
    assert model.predictor(4)(16) == pytest.approx(0.01 + 0.01)   # the prior: one plain step + 1/16 per row


@pytest.mark.parametrize("slo", [0.9, 0.0, float("nan"), float("inf"), -1.0])
def test_an_objective_below_one_is_refused(slo):
    with pytest.raises(InvalidInputError, match="tpot_slo"):
        DeferralConfig("raincheck", tpot_slo=slo)


@pytest.mark.parametrize("fused", [True, False])
def test_tokens_after_a_chunk_count_as_restoring_in_both_modes(engine, fused):
    """A serial step runs its chunk in a pass of its own: the token after it still had a restoring gap."""
    SimulatedSteps(engine)
    cfg = DeferralConfig("raincheck", selector="uniform", chunk_size=7, tpot_slo=None, fused=fused)
    end = engine.open_session(deferral=cfg).turn(image_prompt(engine, grid=GRID),
                                                  SamplingParams(max_new_tokens=24, ignore_eos=True)).result()
    assert end.metrics.tpot_restoring_s is not None and end.metrics.tpot_restoring_s > end.metrics.tpot_s
