"""The identities deferred prefill must keep (fp32, ≤ 1e-4), for both model families and their MoE variants."""

from __future__ import annotations

import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from tests.deferral.helpers import concat, hf_forward, image_prompt, record_prefix_states, split, token_rows

FAMILIES = ["qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe"]
TOL = 1e-4


@pytest.fixture(scope="module")
def engines(tiny_checkpoints, engine_backend):
    return {f: (hf, Engine.from_pretrained(folder, backend=engine_backend))
            for f, (hf, folder) in tiny_checkpoints.items()}


def _run(engine: Engine, prompt, cfg: DeferralConfig, n: int):
    session = engine.open_session(deferral=cfg)
    events = session.turn(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), return_logits=True).tokens()
    return session, [e.token_id for e in events], torch.stack([e.logits for e in events])


@pytest.mark.parametrize("family", FAMILIES)
def test_retention_one_is_full(engines, family, monkeypatch):
    _, engine = engines[family]
    # both runs prefill in the same steps: a prefix-cache hit would run the second over other row batches,
    # which MoE's grouped expert GEMM does not make bit-identical (the hit itself: test_prefix_cache.py)
    monkeypatch.setattr(engine.core, "prefix", None)
    prompt = image_prompt(engine, seed=1)
    s1, ids_full, logits_full = _run(engine, prompt, DeferralConfig("full"), 8)
    s2, ids_rc, logits_rc = _run(engine, prompt, DeferralConfig("raincheck", tpot_slo=None, retention=1.0, guard=0), 8)
    assert ids_full == ids_rc
    assert float((logits_full - logits_rc).abs().max()) == 0.0
    assert s2.pending_deferred == 0
    s1.close(), s2.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_hard_is_a_plain_forward_over_i0(engines, family):
    hf, engine = engines[family]
    prompt = image_prompt(engine, seed=2)
    cfg = DeferralConfig("hard", selector="uniform")
    session, ids, logits = _run(engine, prompt, cfg, 3)
    i0, d = split(engine, prompt, cfg)
    assert len(d) == 16 and len(i0) == len(prompt.token_ids) - 16
    gen = token_rows(engine, ids[:-1], i0.next_position)
    ref = hf_forward(hf, *concat(i0, gen))[len(i0) - 1:]
    assert float((logits - ref).abs().max()) <= TOL
    assert session.cached_tokens == len(i0) + 2           # D was never prefilled
    session.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_guard_zero_one_chunk_matches_plain_forward_over_i0_d_y1(engines, family):
    hf, engine = engines[family]
    prompt = image_prompt(engine, seed=3)
    cfg = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=0, chunk_size=31)
    session, ids, logits = _run(engine, prompt, cfg, 2)
    i0, d = split(engine, prompt, cfg)
    y1 = token_rows(engine, ids[:1], i0.next_position)
    first = hf_forward(hf, *concat(i0))[-1]
    second = hf_forward(hf, *concat(i0, d, y1))[-1]
    assert float((logits[0] - first).abs().max()) <= TOL       # the first token saw I0 only
    assert float((logits[1] - second).abs().max()) <= TOL      # the second saw I0 ‖ D ‖ y1
    assert session.pending_deferred == 0
    session.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_equals_serial(engines, family):
    _, engine = engines[family]
    prompt = image_prompt(engine, seed=4)
    fused = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7)
    serial = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7, fused=False)
    s1, ids_f, logits_f = _run(engine, prompt, fused, 10)
    s2, ids_s, logits_s = _run(engine, prompt, serial, 10)
    assert ids_f == ids_s
    assert float((logits_f - logits_s).abs().max()) <= TOL
    s1.close(), s2.close()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("answer", "pending"), [(1, 16), (4, 9), (8, 0)])
def test_recovered_cache_equals_one_plain_pass_over_i0_d(engines, family, answer, pending, monkeypatch):
    """After recovery (during decode and after the answer), D's K/V and the GDN prefix state are
    those of one plain pass over I0 ‖ D with the original positions."""
    from transformers import DynamicCache

    hf, engine = engines[family]
    prefix_states = record_prefix_states(monkeypatch)
    prompt = image_prompt(engine, seed=5)
    cfg = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7)
    session = engine.open_session(deferral=cfg)
    stream = session.turn(prompt, SamplingParams(max_new_tokens=answer, ignore_eos=True))
    rec = session.cache.recovery
    end = stream.result()
    # guard 2: chunks of 7 ride on the decode steps that feed y3, y4, …; what is left goes after the answer
    assert end.metrics.deferred_pending == pending
    session.complete_recovery()
    assert session.pending_deferred == 0 and session.cache.recovery is None

    i0, d = split(engine, prompt, cfg)
    cache = DynamicCache(config=hf.config.get_text_config())
    hf_forward(hf, *concat(i0, d), cache=cache)
    attn_layers = [i for i, t in enumerate(engine.model_config.layer_types) if t == "full_attention"]
    # D's slots, in processing order, from the recovery that wrote them
    slots = torch.cat(rec.slots)
    for a, layer in enumerate(attn_layers):
        ref_k = cache.layers[layer].keys[0, :, len(i0):].transpose(0, 1)     # [|D|, kv, d]
        ref_v = cache.layers[layer].values[0, :, len(i0):].transpose(0, 1)
        assert float((engine.kv.k[a][slots] - ref_k).abs().max()) <= TOL
        assert float((engine.kv.v[a][slots] - ref_v).abs().max()) <= TOL
    if engine.gdn is not None:
        conv, ssm = prefix_states[-1]
        gdn_layers = [i for i, t in enumerate(engine.model_config.layer_types) if t == "linear_attention"]
        for g, layer in enumerate(gdn_layers):
            ref_ssm = cache.layers[layer].recurrent_states[0][0]
            ref_conv = cache.layers[layer].conv_states[0][0, :, 1:].transpose(0, 1)
            assert float((ssm[g] - ref_ssm).abs().max()) <= TOL
            assert float((conv[g] - ref_conv).abs().max()) <= TOL
    session.close()


def test_hard_turn_two_never_sees_d_and_barrier_makes_post_answer_see_all(engines):
    """post_answer with a one-token answer leaves no generated token in the cache, so after the
    barrier the cache is exactly I0 ‖ D and turn 2 equals a plain forward over I0 ‖ D ‖ y1 ‖ turn 2."""
    for family in FAMILIES:
        hf, engine = engines[family]
        prompt = image_prompt(engine, seed=6)
        for policy in ("post_answer", "hard"):
            cfg = DeferralConfig(policy, selector="uniform")
            session = engine.open_session(deferral=cfg)
            y1 = session.turn(prompt, SamplingParams(max_new_tokens=1)).result().token_ids
            if policy == "post_answer":
                assert session.pending_deferred == 16
            turn2 = Prompt([11, 12, 13])
            stream = session.turn(turn2, SamplingParams(max_new_tokens=1), return_logits=True)
            assert session.pending_deferred == 0
            event = next(iter(stream))
            end = stream.result()
            i0, d = split(engine, prompt, cfg)
            rows = token_rows(engine, y1 + turn2.token_ids, i0.next_position)
            parts = (i0, d, rows) if policy == "post_answer" else (i0, rows)
            ref = hf_forward(hf, *concat(*parts))[-1]
            assert float((event.logits - ref).abs().max()) <= TOL, (family, policy)
            if policy == "post_answer":
                assert end.metrics.barrier_wait_s > 0
                assert end.metrics.previous_recovery_s is not None
            session.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_raincheck_turn_two_waits_at_the_barrier_then_sees_every_token(engines, family):
    _, engine = engines[family]
    prompt = image_prompt(engine, seed=7)
    cfg = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7)
    session = engine.open_session(deferral=cfg)
    first = session.turn(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True)).result()
    assert first.metrics.deferred_pending == 9 and session.pending_deferred == 9
    stream = session.turn(Prompt([11, 12]), SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert session.pending_deferred == 0                      # the barrier ran before admission
    # every input token of turn 1 (I0 and all of D) and its 3 fed answer tokens
    assert session.cached_tokens == len(prompt.token_ids) + 3
    assert not len(session.cache.generated_slots())                   # no slot is hidden any more
    end = stream.result()
    assert session.cached_tokens == len(prompt.token_ids) + 3 + 3 + 1   # + y4, turn 2, one answer token
    assert end.metrics.barrier_wait_s > 0 and end.metrics.previous_recovery_s is not None
    session.close()


def test_background_steps_finish_recovery_in_the_idle_gap(engines):
    import time

    _, engine = engines["qwen3_5"]
    session = engine.open_session(deferral=DeferralConfig("post_answer", selector="uniform"))
    session.turn(image_prompt(engine, seed=8), SamplingParams(max_new_tokens=2)).result()
    assert session.pending_deferred == 16
    engine.start_background()
    try:
        deadline = time.monotonic() + 30
        while session.pending_deferred and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.stop_background()
    assert session.pending_deferred == 0 and session.cache.last_recovery_s is not None
    session.close()
