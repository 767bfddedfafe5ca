"""Turn-boundary recovery on a second engine (what a Ray deferred worker runs): shipping the residual
and joining the result gives the same cache, and the same next turn, as finishing locally."""

from __future__ import annotations

import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine.plan import Kind
from raincheck_core.errors import RecoveryStateError, StepFailedError
from tests.deferral.helpers import image_prompt

CFG = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7)


def _two_turns(engine: Engine, remote: Engine | None):
    session = engine.open_session(deferral=CFG)
    session.turn(image_prompt(engine, seed=31), SamplingParams(max_new_tokens=4, ignore_eos=True)).result()
    assert session.pending_deferred == 9
    if remote is not None:
        ticket = engine.hold_residual(session)
        assert session.status().handed_off and session.status().recovery_ticket == ticket == 0
        payload = engine.export_residual(session, ticket)
        assert payload.rows == 9 and payload.context_k.shape[1] == session.cached_tokens - 3   # GEN not shipped
        engine.apply_residual(session, ticket, remote.prefill_residual(payload))
        assert session.pending_deferred == 0 and not session.status().recovering
    events = session.turn(Prompt([11, 12, 13]), SamplingParams(max_new_tokens=6, ignore_eos=True),
                          return_logits=True).tokens()
    session.close()
    return [e.token_id for e in events], torch.stack([e.logits for e in events])


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_disaggregated_equals_colocated(tiny_checkpoints, family):
    folder = tiny_checkpoints[family][1]
    local = Engine.from_pretrained(folder)
    ids_local, logits_local = _two_turns(local, None)
    ids_remote, logits_remote = _two_turns(Engine.from_pretrained(folder), Engine.from_pretrained(folder))
    assert ids_local == ids_remote
    assert float((logits_local - logits_remote).abs().max()) <= 1e-4


def test_lost_worker_is_taken_back_and_finished_locally(tiny_checkpoints):
    engine = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1])
    session = engine.open_session(deferral=CFG)
    session.turn(image_prompt(engine, seed=32), SamplingParams(max_new_tokens=4, ignore_eos=True)).result()
    ticket = engine.hold_residual(session)
    payload = engine.export_residual(session, ticket)
    assert not engine.step()                 # handed off: no local gap work for it
    assert engine.take_back(session, ticket)
    assert not engine.take_back(session, ticket)       # not held any more: nothing to do
    result = engine.prefill_residual(payload)
    with pytest.raises(RecoveryStateError, match="not held"):   # a late result after the take-back
        engine.apply_residual(session, ticket, result)
    session.complete_recovery()
    assert session.pending_deferred == 0
    with pytest.raises(RecoveryStateError, match="no deferred input"):
        engine.export_residual(session, ticket)
    session.close()


def test_a_stale_result_is_never_applied(tiny_checkpoints):
    """A result for turn 1's recovery that arrives after turn 2 started its own recovery is refused,
    and turn 2's recovery is untouched."""
    engine = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1])
    remote = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1])
    session = engine.open_session(deferral=CFG)
    session.turn(image_prompt(engine, seed=33), SamplingParams(max_new_tokens=4, ignore_eos=True)).result()
    first = engine.hold_residual(session)
    stale = remote.prefill_residual(engine.export_residual(session, first))
    session.turn(image_prompt(engine, seed=34), SamplingParams(max_new_tokens=4, ignore_eos=True)).result()
    second = engine.hold_residual(session)
    assert second == 1 and session.pending_deferred == 9
    with pytest.raises(RecoveryStateError, match="turn 0 is over"):
        engine.apply_residual(session, first, stale)
    assert session.pending_deferred == 9 and session.status().handed_off
    engine.apply_residual(session, second, remote.prefill_residual(engine.export_residual(session, second)))
    assert session.pending_deferred == 0
    session.close()


def test_a_residual_prefill_runs_through_the_ordinary_step_and_fails_alone(tiny_checkpoints):
    folder = tiny_checkpoints["qwen3_5"][1]
    engine, remote = Engine.from_pretrained(folder), Engine.from_pretrained(folder, max_rows_per_step=4)
    session = engine.open_session(deferral=CFG)
    session.turn(image_prompt(engine, seed=33), SamplingParams(max_new_tokens=4, ignore_eos=True)).result()
    payload = engine.export_residual(session, engine.hold_residual(session))
    plans = []
    remove = remote.on_plan(lambda plan: plans.append([(s.kind, s.rows) for s in plan.segments]))
    remote.prefill_residual(payload)
    assert plans == [[(Kind.RESIDUAL, 4)], [(Kind.RESIDUAL, 4)], [(Kind.RESIDUAL, 1)]]   # 9 rows, 4 per step
    remove()

    free = remote.pool_stats().free_pages

    def fail(plan):
        raise RuntimeError("injected forward failure")

    remove = remote.on_plan(fail)
    with pytest.raises(StepFailedError, match="injected forward failure"):
        remote.prefill_residual(payload)
    remove()
    assert remote.pool_stats().free_pages == free and not remote.has_work()     # the scratch session is gone
    remote.prefill_residual(payload)                                             # and the engine goes on
    session.close()
