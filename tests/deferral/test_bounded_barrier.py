"""A bounded completion barrier (docs/mechanism.md §10): the follow-up is admitted with the previous
turn's deferred rows still pending, and they are restored during and after it with cross-turn
visibility. Against tests/deferral/cross_turn.py's reference (transformers with visibility masks for
attention layers, token-wise re-application of the recorded suffix for GDN layers), both families:
every logit of the follow-up and, after recovery, every K/V row and the GDN live state. One recovery
chunk of 5 rows goes ahead of the follow-up's input where the step has room (not when its input is split
over steps); the rest are late rows."""

from __future__ import annotations

import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine.plan import Kind
from tests.deferral.cross_turn import RowLog, reference
from tests.deferral.helpers import image_prompt, rel_err, slow_decays, two_attention_hybrid
from tests.engine.reference import image_tokens

FAMILIES = ["qwen3_vl", "qwen3_5"]
TOL = 1e-4
FIRST = DeferralConfig("post_answer", selector="uniform", chunk_size=7)        # all of D left after the answer
FOLLOW = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7, barrier_timeout_s=0)
OWN_GRID = (1, 8, 8)          # the follow-up's own image: 16 visual tokens, 5 kept, 11 deferred
AHEAD = 5                     # rows of the previous turn's D ahead of the follow-up's input (recovery_chunk)


@pytest.fixture(scope="module")
def engines(tiny_checkpoints, tmp_path_factory, engine_backend):
    """On both backends: on FlexAttention a late row's read list leaves out the follow-up's slots, which the
    layout reads its pages from (ops/flex_runs.py)."""
    out = {}
    checkpoints = {"qwen3_vl": tiny_checkpoints["qwen3_vl"], "qwen3_5": two_attention_hybrid(tmp_path_factory)}
    for family, (hf, folder) in checkpoints.items():
        engine = Engine.from_pretrained(folder, backend=engine_backend)
        if engine.gdn is not None:
            slow_decays(hf, engine)
        out[family] = (hf, engine)
    return out


def _follow_up(engine: Engine, own_image: bool) -> Prompt:
    if not own_image:
        return Prompt([11, 12, 13, 14, 15])
    from tests.engine.reference import random_visual

    mc = engine.model_config
    visual = random_visual("image", OWN_GRID, mc.hidden_size, mc.deepstack_levels, seed=31)
    return Prompt([11, 12, *image_tokens(OWN_GRID), 13], [visual])


def _dialogue(engine: Engine, answer: int, own_image: bool, split: bool, ahead: int = AHEAD):
    """Turn 1 leaves all 16 deferred rows pending; the follow-up does not wait. Returns the row log, the
    follow-up's stream end and logits, and the session after everything is restored."""
    log = RowLog()
    remove = engine.on_plan(lambda plan: log.record(engine, plan))
    scheduler = engine.core.scheduler
    rows_before, chunk_before = scheduler.max_rows, scheduler.recovery_chunk
    scheduler.recovery_chunk = ahead
    session = engine.open_session(deferral=FIRST)
    try:
        first = session.turn(image_prompt(engine, seed=30), SamplingParams(max_new_tokens=answer, ignore_eos=True))
        assert first.result().metrics.deferred_pending == 16
        if split:       # a step boundary inside the follow-up's input: it is prefilled in two steps
            engine.core.scheduler.max_rows = 3
        stream = session.turn(_follow_up(engine, own_image), SamplingParams(max_new_tokens=8, ignore_eos=True),
                              deferral=FOLLOW, return_logits=True)
        assert session.pending_deferred == 16 + (11 if own_image else 0)     # nothing restored before it
        events = stream.tokens()
        end = stream.result()
        session.complete_recovery()
    finally:
        scheduler.max_rows, scheduler.recovery_chunk = rows_before, chunk_before
        remove()
    return log, end, torch.stack([e.logits for e in events]), session


CASES = [(1, False, False, AHEAD), (1, False, True, AHEAD), (6, False, False, AHEAD), (6, True, False, AHEAD),
         (1, True, True, AHEAD), (6, True, True, AHEAD), (1, True, False, 16)]
IDS = ["1tok-answer", "1tok-answer-split-input", "6tok-answer", "6tok-own-image", "1tok-own-image-split",
       "6tok-own-image-split", "1tok-own-image-all-ahead"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("answer", "own_image", "split", "ahead"), CASES, ids=IDS)
def test_bounded_follow_up_equals_the_cross_turn_reference(engines, family, answer, own_image, split, ahead):
    hf, engine = engines[family]
    log, end, logits, session = _dialogue(engine, answer, own_image, split, ahead)
    assert end.metrics.barrier_wait_s == 0.0 and end.metrics.previous_pending == 16
    assert session.pending_deferred == 0
    ref = reference(hf, log.rows)
    # the follow-up's logits: its first token without the late rows, the later ones with those restored
    assert float((logits - ref.logits[log.sampled(1)]).abs().max()) <= TOL
    # the cache after completion: every row's K/V, in processing order
    slots = session.cache.table.slots(0, session.cache.length)
    assert len(slots) == len(log.rows)
    attn = sorted(ref.keys)
    for a, layer in enumerate(attn):
        assert float((engine.kv.k[a][slots] - ref.keys[layer]).abs().max()) <= TOL, layer
        assert float((engine.kv.v[a][slots] - ref.values[layer]).abs().max()) <= TOL, layer
    for g, layer in enumerate(sorted(ref.live)):
        assert rel_err(engine.gdn.ssm[session.cache.gdn_slot][g], ref.live[layer]) <= 1e-5, layer
    session.close()


def _check_against_reference(hf, engine: Engine, log: RowLog, logits: torch.Tensor, session) -> None:
    ref = reference(hf, log.rows)
    assert float((logits - ref.logits[log.sampled(session.turns - 1)]).abs().max()) <= TOL
    slots = session.cache.table.slots(0, session.cache.length)
    assert len(slots) == len(log.rows)
    for a, layer in enumerate(sorted(ref.keys)):
        assert float((engine.kv.k[a][slots] - ref.keys[layer]).abs().max()) <= TOL, layer
    for g, layer in enumerate(sorted(ref.live)):
        assert rel_err(engine.gdn.ssm[session.cache.gdn_slot][g], ref.live[layer]) <= 1e-5, layer


@pytest.mark.parametrize("family", FAMILIES)
def test_a_failed_follow_up_leaves_the_previous_rows_pending_as_they_were(engines, family):
    """The follow-up fails after a late chunk rode on its first decode step: it is undone, and the
    previous turn's rows are pending again as at its admission (the chunk undone with it); a new
    follow-up then gives what it would have given without the failure."""
    from raincheck_core.errors import StepFailedError

    hf, engine = engines[family]
    log = RowLog()
    remove_log = engine.on_plan(lambda plan: log.record(engine, plan))
    scheduler = engine.core.scheduler
    chunk_before, scheduler.recovery_chunk = scheduler.recovery_chunk, AHEAD
    session = engine.open_session(deferral=FIRST)
    try:
        session.turn(image_prompt(engine, seed=30), SamplingParams(max_new_tokens=6, ignore_eos=True)).result()
        rows, length = len(log.rows), session.cached_tokens
        late = []

        def fail_after_a_late_chunk(plan) -> None:
            if late:
                raise RuntimeError("injected")
            if any(s.kind is Kind.DEFERRED for s in plan.segments):
                late.append(plan)

        remove_fault = engine.on_plan(fail_after_a_late_chunk)
        stream = session.turn(_follow_up(engine, False), SamplingParams(max_new_tokens=8, ignore_eos=True),
                              deferral=FOLLOW)
        with pytest.raises(StepFailedError):
            stream.result()
        remove_fault()
        assert late                                                   # a late chunk had run
        assert session.pending_deferred == 16 and session.cached_tokens == length
        del log.rows[rows:]
        stream = session.turn(_follow_up(engine, False), SamplingParams(max_new_tokens=8, ignore_eos=True),
                              deferral=FOLLOW, return_logits=True)
        logits = torch.stack([e.logits for e in stream.tokens()])
        assert stream.result().metrics.previous_pending == 16
        session.complete_recovery()
    finally:
        scheduler.recovery_chunk = chunk_before
        remove_log()
    _check_against_reference(hf, engine, log, logits, session)
    session.close()


def test_no_timeout_waits_as_before(engines):
    _, engine = engines["qwen3_5"]
    session = engine.open_session(deferral=FIRST)
    session.turn(image_prompt(engine, seed=30), SamplingParams(max_new_tokens=2, ignore_eos=True)).result()
    waiting = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7)
    stream = session.turn(_follow_up(engine, False), SamplingParams(max_new_tokens=2), deferral=waiting)
    assert session.pending_deferred == 0
    end = stream.result()
    assert end.metrics.barrier_wait_s > 0 and end.metrics.previous_pending == 0
    session.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_residual_held_for_a_deferred_worker_joins_across_the_boundary(engines, family):
    """Disaggregated mode: the previous turn's residual is out on another engine when the follow-up comes;
    nothing goes ahead of the input, the result is refused while the input prefills and joins once it is
    in, as late rows would (the reference takes its rows at that point)."""
    from tests.deferral.cross_turn import Row

    hf, engine = engines[family]
    log = RowLog()
    remove = engine.on_plan(lambda plan: log.record(engine, plan))
    session = engine.open_session(deferral=FIRST)
    try:
        session.turn(image_prompt(engine, seed=30), SamplingParams(max_new_tokens=6, ignore_eos=True)).result()
        ticket = engine.hold_residual(session)
        payload = engine.export_residual(session, ticket)
        result = engine.prefill_residual(payload)      # what a deferred worker runs, on a scratch session
        rec = session.cache.recovery
        stream = iter(session.turn(_follow_up(engine, False), SamplingParams(max_new_tokens=8, ignore_eos=True),
                                   deferral=FOLLOW, return_logits=True))
        assert engine.apply_residual(session, ticket, result) is None      # the input is not in yet
        events = [next(stream)]
        assert engine.apply_residual(session, ticket, result) is not None
        rows = rec.rows
        for r in range(rec.total):
            at = (rows.deepstack_index == r).nonzero().flatten()
            log.rows.append(Row(None, rows.embeds[r].clone(), rows.positions[:, r].clone(),
                                [level[at[0]].clone() for level in rows.deepstack] if len(at) else [], 0, False,
                                True, join=r == rec.total - 1))
        events += [e for e in stream if hasattr(e, "logits")]
        assert session.pending_deferred == 0
    finally:
        remove()
    _check_against_reference(hf, engine, log, torch.stack([e.logits for e in events]), session)
    session.close()
