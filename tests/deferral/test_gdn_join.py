"""The engine's GDN join against token-by-token re-application of the recorded suffix factors
(fp32, ≤ 1e-5 relative), over several chunks — one shorter than the conv lead — and joins after the
answer. A transposed join must fail the same check."""

from __future__ import annotations

import pytest
import torch

from raincheck_core import Engine, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.ops import gdn_state_map, native
from raincheck_core.ops.gdn import recurrent_gated_delta_rule
from tests.deferral.helpers import image_prompt, record_joined_states, rel_err

# 16 deferred tokens, chunks of 7: 7 + 7 ride on the steps feeding y4, y5 (guard 3), then 2 after the
# answer (a chunk shorter than the 3-token lead); y1..y5 are fed, 2 of them after the lead
FUSED = (DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=3, chunk_size=7), 6, 2, 5 - 3)
# all 16 after a 45-token answer: 44 fed, 41 after the lead, more than one buffer of factors to fold
AFTER_LONG_ANSWER = (DeferralConfig("post_answer", selector="uniform"), 45, 16, 44 - 3)


def _joined_vs_reapplied(engine: Engine, monkeypatch, setting=FUSED) -> float:
    """Worst relative error over GDN layers between the joined live state and S_lead' with the
    recorded suffix re-applied token by token, captured when the recovery completes."""
    cfg, max_new, pending, after_lead = setting
    snapshots = record_joined_states(monkeypatch)
    engine.audit_gdn_join = True
    session = engine.open_session(deferral=cfg)
    end = session.turn(image_prompt(engine, seed=11),
                       SamplingParams(max_new_tokens=max_new, ignore_eos=True)).result()
    assert end.metrics.deferred_pending == pending
    session.complete_recovery()
    session.close()
    engine.audit_gdn_join = False
    (s_lead, live, factors), = snapshots
    worst = 0.0
    for layer, recorded in enumerate(factors):
        assert len(recorded) == after_lead
        k, v, g, beta = (torch.cat(parts) for parts in zip(*recorded, strict=True))
        _, reapplied = recurrent_gated_delta_rule(k, k, v, g, beta, s_lead[layer])
        worst = max(worst, rel_err(live[layer], reapplied))
    return worst


def _slow_decay_engine(folder, backend: str | None = None) -> Engine:
    """Slow decays (as trained models have on many heads): with transformers' random init the state
    forgets within a token or two, P_rest ≈ 0, and no join — right or wrong — would matter."""
    engine = Engine.from_pretrained(folder, **({"backend": backend} if backend else {}))
    with torch.no_grad():
        for layer in engine.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.fill_(-4.0)
    return engine


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def engine(tiny_checkpoints, request):
    return _slow_decay_engine(tiny_checkpoints[request.param][1])


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def backend_engine(tiny_checkpoints, engine_backend, request):
    return _slow_decay_engine(tiny_checkpoints[request.param][1], engine_backend)


@pytest.mark.parametrize("setting", [FUSED, AFTER_LONG_ANSWER], ids=["fused", "after-long-answer"])
def test_join_equals_token_by_token_reapplication(backend_engine, monkeypatch, setting):
    assert _joined_vs_reapplied(backend_engine, monkeypatch, setting) <= 1e-5


def test_a_turn_whose_answer_ended_keeps_no_step_factors_waiting(engine):
    """A join keeps its tokens' factors as the steps handed them over (views of each step's tensors for all
    its tracked rows) until it folds them: once its turn's answer is over (here 9 tokens past the last fold
    of 32, D still pending after the answer), it has folded them, so no step's tensors wait on a gap."""
    cfg, max_new, pending, _ = AFTER_LONG_ANSWER
    session = engine.open_session(deferral=cfg)
    end = session.turn(image_prompt(engine, seed=11), SamplingParams(max_new_tokens=max_new, ignore_eos=True)).result()
    assert end.metrics.deferred_pending == pending
    join = engine.core.cache(session.id).recovery.join
    held = join.nbytes
    join.fold_buffered(engine.core.runner.ops().gdn)       # nothing left to fold: the same bytes
    assert join.nbytes == held
    session.complete_recovery()
    session.close()


def test_transposed_join_fails_the_same_check(engine, monkeypatch):
    """On the torch path, whose join is `join_state` (the native kernel's is checked against the same
    formula in tests/ops/test_varlen.py)."""
    monkeypatch.setattr(native, "gated_deltanet_available", lambda *a: False)
    monkeypatch.setattr(gdn_state_map, "join_state", lambda s, p, d: s + d @ p)   # ΔS·P: wrong side
    assert _joined_vs_reapplied(engine, monkeypatch) > 1e-3


def test_native_and_torch_paths_give_the_same_turn(engine, monkeypatch):
    """A fused turn (chunks joined mid-answer, tracked decode rows, lead repair) and its recovery with the
    step's GDN groups through the native kernel, prepared once per step with every layer's rows in one
    buffer, and through the torch ops: the same tokens, joined S_lead' and live states."""
    if not native.gated_deltanet_available("cpu", torch.float32):
        pytest.skip("the native kernel cannot be built here (no C compiler)")

    def turn() -> tuple[list[int], torch.Tensor, torch.Tensor]:
        snapshots = record_joined_states(monkeypatch)
        session = engine.open_session(deferral=FUSED[0])
        end = session.turn(image_prompt(engine, seed=11), SamplingParams(max_new_tokens=6, ignore_eos=True)).result()
        session.complete_recovery()
        session.close()
        (s_lead, live, _), = snapshots
        return end.token_ids, s_lead, live

    native_tokens, native_lead, native_live = turn()
    monkeypatch.undo()
    monkeypatch.setattr(native, "gated_deltanet_available", lambda *a: False)
    torch_tokens, torch_lead, torch_live = turn()
    assert native_tokens == torch_tokens
    assert rel_err(native_lead, torch_lead) <= 1e-5 and rel_err(native_live, torch_live) <= 1e-5
