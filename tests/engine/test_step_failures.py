"""A step that fails changes nothing, and fails only the turn whose own rows caused it: that turn is
undone (cache, pages, GDN state as before it), the session stays usable, and the others in the step go
on exactly as they would have."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.errors import SamplingError, StepFailedError
from tests.deferral.helpers import image_prompt

RC = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7)


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def _logits(stream) -> torch.Tensor:
    return torch.stack([e.logits for e in stream.tokens()])


def _fail_when(engine: Engine, session, after_steps: int) -> tuple[list[int], Callable[[], None]]:
    """Make every forward that holds `session`'s rows raise, from its `after_steps`-th such forward on;
    returns the count of such forwards and the hook's remover."""
    seen = [0]

    def forward(plan):
        if session.id in plan.sessions():
            seen[0] += 1
            if seen[0] > after_steps:
                raise RuntimeError("injected forward failure")

    return seen, engine.on_plan(forward)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("after_steps", [0, 4])          # during the prefill; mid-answer, with chunks fused
def test_a_failed_turn_is_undone_and_the_others_go_on(tiny_checkpoints, family, after_steps):
    folder = tiny_checkpoints[family][1]
    engine = Engine.from_pretrained(folder)
    victim, bystander = engine.open_session(deferral=RC), engine.open_session(deferral=RC)
    victim.turn(Prompt([5, 6, 7, 8]), _params(3)).result()
    before = (victim.cached_tokens, len(victim.cache.table.pages), victim.turns)
    if engine.gdn is not None:
        state = engine.gdn.ssm[victim.cache.gdn_slot].clone()

    ref = engine.open_session(deferral=RC)                   # what the bystander must see
    ref_logits = _logits(ref.turn(image_prompt(engine, seed=51), _params(8), return_logits=True))
    ref.close()

    seen, heal = _fail_when(engine, victim, after_steps)
    failing = victim.turn(image_prompt(engine, seed=50), _params(8), return_logits=True)
    other = bystander.turn(image_prompt(engine, seed=51), _params(8), return_logits=True)
    with pytest.raises(StepFailedError, match="injected forward failure"):
        failing.result()
    assert seen[0] > after_steps
    other_logits = _logits(other)
    assert float((other_logits - ref_logits).abs().max()) <= 1e-5
    heal()

    # the failed turn left no trace: cache length, pages, turn count and recurrent state as before it
    assert (victim.cached_tokens, len(victim.cache.table.pages), victim.turns) == before
    if engine.gdn is not None:
        assert torch.equal(engine.gdn.ssm[victim.cache.gdn_slot], state)
    assert victim.pending_deferred == 0 and not victim.busy
    # and the next turn answers as if the failed one never ran
    fresh = engine.open_session(deferral=RC)
    fresh.turn(Prompt([5, 6, 7, 8]), _params(3)).result()
    want = _logits(fresh.turn(Prompt([11, 12, 13]), _params(4), return_logits=True))
    got = _logits(victim.turn(Prompt([11, 12, 13]), _params(4), return_logits=True))
    assert float((got - want).abs().max()) <= 1e-5
    for s in (victim, bystander, fresh):
        s.close()
    stats = engine.pool_stats()
    assert stats.free_pages == stats.total_pages                 # nothing leaked
    if engine.gdn is not None:
        assert engine.gdn.free_slots == engine.config.max_gdn_slots


def test_a_sampling_failure_fails_that_turn_only(tiny_checkpoints):
    engine = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1])
    a, b = engine.open_session(deferral=RC), engine.open_session(deferral=RC)
    ref = engine.open_session(deferral=RC)
    ref_logits = _logits(ref.turn(image_prompt(engine, seed=61), _params(6), return_logits=True))
    ref.close()
    bad = a.turn(image_prompt(engine, seed=60), _params(6), return_logits=True)
    good = b.turn(image_prompt(engine, seed=61), _params(6), return_logits=True)

    def broken(logits: torch.Tensor) -> int:
        raise SamplingError("probabilities are not finite")

    bad.request.sampler = broken
    with pytest.raises(SamplingError, match="not finite"):
        bad.result()
    assert float((_logits(good) - ref_logits).abs().max()) <= 1e-5
    assert a.cached_tokens == 0 and a.turns == 0 and a.pending_deferred == 0
    a.turn(Prompt([5, 6]), _params(2)).result()               # usable again
    for s in (a, b):
        s.close()


def test_a_recovery_that_keeps_failing_is_given_up_and_the_session_goes_on(tiny_checkpoints):
    engine = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1])
    session = engine.open_session(deferral=DeferralConfig("post_answer", selector="uniform"))
    session.turn(image_prompt(engine, seed=70), _params(2)).result()
    assert session.pending_deferred == 16
    _, heal = _fail_when(engine, session, after_steps=0)
    session.complete_recovery()                               # three failed chunks, then given up
    heal()
    assert session.pending_deferred == 0 and not session.status().recovering
    session.turn(Prompt([11, 12]), _params(2)).result()
    session.close()
