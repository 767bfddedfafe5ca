"""Deferred rows never attend to their turn's generated tokens, nor to a later turn's rows
(docs/mechanism.md §4, §10)."""

from __future__ import annotations

import torch

from raincheck_core import Engine, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.deferral.visibility import deferred_mask
from tests.deferral.helpers import image_prompt


def test_mask_hides_gen_and_is_causal_inside_the_chunk():
    turns = torch.tensor([0, 1, 1, 1, 1], dtype=torch.int32)
    generated = torch.tensor([False, False, True, False, True])
    mask = deferred_mask(turns, generated, 1, 3)
    assert mask.shape == (3, 8)
    assert not mask[:, 2].any() and not mask[:, 4].any()        # GEN slots: never
    assert mask[:, [0, 1, 3]].all()                             # context and earlier chunks: always
    assert torch.equal(mask[:, 5:], torch.ones(3, 3, dtype=torch.bool).tril())


def test_late_rows_see_their_turn_and_earlier_never_a_later_turn():
    # turn 0 (I0, GEN), turn 1's input (the previous answer's tail and the follow-up), its GEN
    turns = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.int32)
    generated = torch.tensor([False, False, True, False, False, True])
    late = deferred_mask(turns, generated, 0, 1)[0, :6]
    assert late.tolist() == [True, True, False, False, False, False]
    # the follow-up's own deferred rows see all of turn 0, answer included, and its own input
    own = deferred_mask(turns, generated, 1, 1)[0, :6]
    assert own.tolist() == [True, True, True, True, True, False]


def _deferred_kv_with_gen_corrupted(folder, corrupt: bool):
    engine = Engine.from_pretrained(folder)
    cfg = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7)
    session = engine.open_session(deferral=cfg)
    stream = session.turn(image_prompt(engine, seed=21), SamplingParams(max_new_tokens=8, ignore_eos=True),
                          return_logits=True)
    rec = session.cache.recovery
    events = []
    for event in stream:
        events.append(event)
        if corrupt and getattr(event, "index", None) == 2:
            # y1 and y2 are in the cache now, labelled GEN; the next step carries the first chunk
            slots = session.cache.generated_slots()
            assert len(slots) == 2
            engine.kv.k[:, slots] += 3.0
            engine.kv.v[:, slots] -= 3.0
    session.complete_recovery()
    slots = torch.cat(rec.slots)
    return engine.kv.k[:, slots].clone(), engine.kv.v[:, slots].clone(), events


def test_changing_generated_kv_leaves_deferred_rows_unchanged(tiny_checkpoints):
    folder = tiny_checkpoints["qwen3_vl"][1]
    k_ref, v_ref, events_ref = _deferred_kv_with_gen_corrupted(folder, corrupt=False)
    k, v, events = _deferred_kv_with_gen_corrupted(folder, corrupt=True)
    # decode rows see GEN, so the corruption shows in their logits …
    assert float((events[3].logits - events_ref[3].logits).abs().max()) > 1e-3
    # … while every deferred row's K/V, at every layer, is bit-identical
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
