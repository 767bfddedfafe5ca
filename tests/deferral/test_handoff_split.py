"""Recovery on a second engine (what a Ray deferred worker runs), shipped as soon as the turn's input is
in: the split between fused chunks and the worker's rows is made at the join, so each deferred row is
restored once, and the restored input (every deferred row's K/V, the GDN prefix state after D) equals
colocated recovery's whatever the split. A mid-answer join is exact for the recorded factors; a policy
without fused chunks joins only after the answer; a receiver holding part of the context is shipped the
rest; a result made for an undone attempt of the turn is refused."""

from __future__ import annotations

import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.errors import RecoveryStateError
from raincheck_core.ops.gdn import recurrent_gated_delta_rule
from tests.deferral.helpers import image_prompt, record_joined_states, rel_err

RAINCHECK = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7)    # D: 16 rows
POST_ANSWER = DeferralConfig("post_answer", selector="uniform")
ANSWER = SamplingParams(max_new_tokens=10, ignore_eos=True)


class Restored:
    """The restored input of each recovery that completes: D's K/V in D order, and the prefix state."""

    def __init__(self, engine: Engine):
        self.seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

        def spy(cache, rec):
            slots = torch.cat(rec.slots)
            ssm = engine.gdn.ssm[rec.join.prefix].clone() if rec.join is not None else None
            self.seen.append((engine.kv.k[:, slots].clone(), engine.kv.v[:, slots].clone(), ssm))

        engine.on_recovery_done(spy)


def _engines(tiny_checkpoints, family: str) -> tuple[Engine, Engine]:
    folder = tiny_checkpoints[family][1]
    return Engine.from_pretrained(folder), Engine.from_pretrained(folder)


def _until(engine: Engine, condition) -> None:
    while not condition():
        assert engine.step(), "the engine ran out of work first"


def _in_flight(engine: Engine, remote: Engine, cfg: DeferralConfig, fuse: bool, local_rows: int):
    """An image turn whose residual is shipped once its I0 is in and joined when `local_rows` rows have been
    fused (or after the answer, if they never are). Returns the session, the join and the result."""
    session = engine.open_session(deferral=cfg)
    stream = session.turn(image_prompt(engine, seed=41), ANSWER)
    ticket = engine.hold_residual(session, fuse=fuse)
    _until(engine, lambda: stream.request.decoding)
    result = remote.prefill_residual(engine.export_residual(session, ticket))
    assert (result.first, result.rows) == (0, 16)
    rec, req = session.cache.recovery, stream.request
    _until(engine, lambda: (rec.cursor >= local_rows and len(req.generated) - 1 >= cfg.guard) or req.finished)
    joined = engine.apply_residual(session, ticket, result)
    assert joined is not None and session.pending_deferred == 0
    stream.result()
    return session, joined, result


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize(("fuse", "local_rows"), [(False, 0), (True, 7)])
def test_any_split_restores_what_colocated_restores(tiny_checkpoints, family, fuse, local_rows):
    engine, remote = _engines(tiny_checkpoints, family)
    restored = Restored(engine)
    reference = engine.open_session(deferral=RAINCHECK)
    reference.turn(image_prompt(engine, seed=41), ANSWER).result()
    reference.complete_recovery()

    session, joined, result = _in_flight(engine, remote, RAINCHECK, fuse, local_rows)
    assert joined.offset == local_rows                       # fused chunks restored rows 0..offset, the worker the rest
    assert session.cached_tokens == reference.cached_tokens  # every deferred row once: 16 slots, not more
    (k_ref, v_ref, s_ref), (k, v, s) = restored.seen
    at = joined.positions
    slots = session.cache.table.slots(0, session.cache.length)[at]
    assert torch.equal(engine.kv.k[:, slots], result.k[:, local_rows:].to(engine.kv.k.dtype))
    assert rel_err(k, k_ref) <= 1e-5 and rel_err(v, v_ref) <= 1e-5
    if s_ref is not None:
        assert rel_err(s, s_ref) <= 1e-5


def test_a_result_after_every_row_was_fused_is_dropped(tiny_checkpoints):
    engine, remote = _engines(tiny_checkpoints, "qwen3_5")
    session = engine.open_session(deferral=RAINCHECK)
    stream = session.turn(image_prompt(engine, seed=42), SamplingParams(max_new_tokens=12, ignore_eos=True))
    ticket = engine.hold_residual(session)
    _until(engine, lambda: stream.request.decoding)
    result = remote.prefill_residual(engine.export_residual(session, ticket))
    stream.result()                                          # 3 fused chunks restored all 16 rows
    assert session.pending_deferred == 0
    with pytest.raises(RecoveryStateError, match="no deferred input"):
        engine.apply_residual(session, ticket, result)


def test_a_mid_answer_join_is_exact_for_the_recorded_factors(tiny_checkpoints, monkeypatch):
    """As tests/deferral/test_gdn_join.py checks fused joins: the joined live state equals S_lead' with the
    recorded suffix re-applied token by token (slow decays, so that the join matters)."""
    engine, remote = _engines(tiny_checkpoints, "qwen3_5")
    for e in (engine, remote):
        with torch.no_grad():
            for layer in e.model.layers:
                if hasattr(layer, "linear_attn"):
                    layer.linear_attn.A_log.fill_(-4.0)
    snapshots = record_joined_states(monkeypatch)
    engine.audit_gdn_join = True
    cfg = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=5, chunk_size=7)
    _in_flight(engine, remote, cfg, fuse=False, local_rows=0)
    (s_lead, live, factors), = snapshots
    for layer, recorded in enumerate(factors):
        assert len(recorded) == 5 - 3                        # joined after y5: those past the 3-token lead
        k, v, g, beta = (torch.cat(parts) for parts in zip(*recorded, strict=True))
        _, reapplied = recurrent_gated_delta_rule(k, k, v, g, beta, s_lead[layer])
        assert rel_err(live[layer], reapplied) <= 1e-5


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_post_answer_joins_only_after_the_answer_and_equals_colocated(tiny_checkpoints, family):
    engine, remote = _engines(tiny_checkpoints, family)

    def two_turns(ship: bool):
        session = engine.open_session(deferral=POST_ANSWER)
        stream = session.turn(image_prompt(engine, seed=43), ANSWER)
        if ship:
            ticket = engine.hold_residual(session)
            _until(engine, lambda: stream.request.decoding)
            result = remote.prefill_residual(engine.export_residual(session, ticket))
            assert engine.apply_residual(session, ticket, result) is None    # mid-answer: not under post_answer
            assert session.pending_deferred == 16
        answer = [e.token_id for e in stream.tokens()]
        if ship:
            assert engine.apply_residual(session, ticket, result).offset == 0
        events = session.turn(Prompt([11, 12, 13]), SamplingParams(max_new_tokens=6, ignore_eos=True),
                              return_logits=True).tokens()
        session.close()
        return answer, [e.token_id for e in events], torch.stack([e.logits for e in events])

    local, shipped = two_turns(False), two_turns(True)
    assert local[:2] == shipped[:2]
    assert float((local[2] - shipped[2]).abs().max()) <= 1e-4


def test_a_receiver_holding_context_gets_only_the_rest(tiny_checkpoints):
    """Turn 1's export ships everything; after its result is joined, turn 3's export with `have` (turn 1's
    context and result rows) ships only what came since, and those rows with the held ones, put in cache
    order, are exactly turn 3's full export."""
    engine, remote = _engines(tiny_checkpoints, "qwen3_5")
    session = engine.open_session(deferral=POST_ANSWER)
    session.turn(image_prompt(engine, seed=44), ANSWER).result()
    ticket = engine.hold_residual(session)
    first = engine.export_residual(session, ticket)
    result = remote.prefill_residual(first)
    joined = engine.apply_residual(session, ticket, result)
    held_index = torch.cat([first.context_index, joined.positions])
    held_k = torch.cat([first.context_k, result.k[:, joined.offset:]], dim=1)
    session.turn(Prompt([21, 22]), ANSWER).result()
    session.turn(image_prompt(engine, seed=45), ANSWER).result()
    ticket = engine.hold_residual(session)
    full = engine.export_residual(session, ticket)
    delta = engine.export_residual(session, ticket, have=held_index)
    assert delta.visible == full.visible == len(held_index) + len(delta.context_index)
    assert not torch.isin(held_index, delta.context_index).any()       # turn 1's image is not shipped again
    index = torch.cat([held_index, delta.context_index])
    order = index.argsort()
    assert torch.equal(index[order], full.context_index)
    assert torch.equal(torch.cat([held_k, delta.context_k], dim=1)[:, order], full.context_k)
    with pytest.raises(RecoveryStateError, match="does not have visible"):
        engine.export_residual(session, ticket, have=torch.tensor([session.cached_tokens + 5]))


def test_a_result_for_an_undone_attempt_is_refused(tiny_checkpoints):
    engine, remote = _engines(tiny_checkpoints, "qwen3_5")
    session = engine.open_session(deferral=POST_ANSWER)
    stream = session.turn(image_prompt(engine, seed=46), ANSWER)
    ticket = engine.hold_residual(session)
    _until(engine, lambda: stream.request.decoding)
    stale = remote.prefill_residual(engine.export_residual(session, ticket))
    session.abort()                                          # undone: the same turn is sent again
    session.turn(image_prompt(engine, seed=46), ANSWER).result()
    assert engine.hold_residual(session) == ticket
    with pytest.raises(RecoveryStateError, match="another recovery"):
        engine.apply_residual(session, ticket, stale)
    assert session.pending_deferred == 16


def test_a_racing_barrier_and_a_late_result_split_the_rows(tiny_checkpoints):
    """The next turn waits: local recovery runs on the held residual; a result arriving after one local
    chunk joins the rest."""
    engine, remote = _engines(tiny_checkpoints, "qwen3_5")
    engine.scheduler.recovery_chunk = 8
    session = engine.open_session(deferral=POST_ANSWER)
    session.turn(image_prompt(engine, seed=47), ANSWER).result()
    ticket = engine.hold_residual(session)
    result = remote.prefill_residual(engine.export_residual(session, ticket))
    assert not engine.step()                                 # held: no gap recovery
    session.cache.recovery.race()
    assert engine.step() and session.pending_deferred == 8
    assert engine.apply_residual(session, ticket, result).offset == 8
    assert session.pending_deferred == 0
