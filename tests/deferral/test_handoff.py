"""Turn-boundary recovery on a second engine (what a Ray deferred worker runs): shipping the residual
and joining the result gives the same cache, and the same next turn, as finishing locally."""

from __future__ import annotations

import pytest
import torch

from raincheck_core import Engine, InvalidInputError, Prompt, SamplingParams
from raincheck_core.deferral.handoff import apply_residual, export_residual, prefill_residual, take_back
from raincheck_core.deferral.policy import DeferralConfig
from tests.deferral.helpers import image_prompt

CFG = DeferralConfig("raincheck", selector="uniform", guard=2, chunk_size=7)


def _two_turns(engine: Engine, remote: Engine | None):
    session = engine.open_session(deferral=CFG)
    session.turn(image_prompt(engine, seed=31), SamplingParams(max_new_tokens=4, ignore_eos=True)).result()
    assert session.pending_deferred == 9
    if remote is not None:
        payload = export_residual(engine, session)
        assert payload.rows == 9 and payload.context_k.shape[1] == session.cached_tokens - 3   # GEN not shipped
        apply_residual(engine, session, prefill_residual(remote, payload))
        assert session.pending_deferred == 0
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
    export_residual(engine, session)
    assert not engine.step()                 # handed off: no local gap work for it
    take_back(engine, session)
    session.complete_recovery()
    assert session.pending_deferred == 0
    with pytest.raises(InvalidInputError, match="no deferred input"):
        export_residual(engine, session)
    session.close()
