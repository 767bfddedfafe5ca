"""Tensor (and expert) parallelism on two gloo ranks: the logits at tensor_parallel_size 2 equal those at 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raincheck_core.errors import RankFailedError
from raincheck_core.parallel.launch import spawn
from tests import tiny
from tests.parallel import ranks

TOL = 1e-5
MODELS = Path(__file__).resolve().parents[2] / "models"
MOE = ("qwen3_vl_moe", "qwen3_5_moe")


def test_tp2_logits_equal_tp1_for_all_families(tiny_checkpoints):
    """Text, image and video prompts, the prefill's token then 20 decode steps; the MoE families with the
    experts' width split (TP) and with the experts split (EP)."""
    jobs = [(str(tiny_checkpoints[f][1]), ep) for f in ("qwen3_vl", "qwen3_5", *MOE)
            for ep in ((False, True) if f in MOE else (False,))]
    rank0, rank1 = spawn(ranks.answer_logits_of, 2, jobs, threads=1)
    for (folder, ep), got, other in zip(jobs, rank0, rank1, strict=True):
        want = ranks.answer_logits(None, folder)
        for g, o, w in zip(got, other, want, strict=True):
            assert g.shape == w.shape == (ranks.STEPS, w.shape[1])
            assert float((g - w).abs().max()) <= TOL, (folder, ep)
            assert (o == g).all()      # every rank gathers the same logits


def test_deferral_identities_hold_at_tp2(tiny_checkpoints):
    """At TP = 2: retention 1 is the full prefill, fused chunks (with the GDN join on Qwen3.5) equal serial
    ones, and every setting (hard and post-answer too), a second turn after the barrier and a follow-up
    admitted by a bounded barrier with D pending give TP = 1's logits (which tests/deferral checks against
    transformers)."""
    jobs = [(str(tiny_checkpoints["qwen3_vl"][1]), False), (str(tiny_checkpoints["qwen3_5"][1]), False),
            (str(tiny_checkpoints["qwen3_5_moe"][1]), True)]
    rank0, _ = spawn(ranks.deferral_logits_of, 2, jobs, threads=1)
    for (folder, ep), got in zip(jobs, rank0, strict=True):
        assert float((got["full"] - got["retention1"]).abs().max()) == 0.0, folder
        assert float((got["fused"] - got["serial"]).abs().max()) <= 1e-4, folder
        assert float(got["bounded_pending"]) > 0, folder      # the follow-up did not wait for D
        want = ranks.deferral_logits(None, folder, ep)
        for name, logits in want.items():
            assert float((got[name] - logits).abs().max()) <= TOL, (folder, name)


def test_a_dead_rank_fails_the_turn_with_a_typed_error(tiny_checkpoints, tmp_path):
    report = tmp_path / "rank0.txt"
    with pytest.raises(RankFailedError, match="rank 1: exited with code 3"):
        spawn(ranks.turn_after_peer_died, 2, str(tiny_checkpoints["qwen3_5"][1]), str(report), threads=1,
              timeout_s=30)
    assert report.read_text() == "RankFailedError"


def test_fewer_kv_heads_than_ranks_and_a_tied_head(tmp_path):
    """One KV head at TP = 2: each rank holds a copy of it (its query heads read it); the LM head tied to
    the vocabulary-parallel embedding."""
    import transformers

    cfg = tiny.build_config("qwen3_5", tie=True)
    cfg.text_config.num_key_value_heads = 1
    torch.manual_seed(1)
    folder = tiny.save_model(transformers.Qwen3_5ForConditionalGeneration(cfg).eval(), tmp_path)
    rank0, _ = spawn(ranks.answer_logits_of, 2, [(str(folder), False)], threads=1)
    for got, want in zip(rank0[0], ranks.answer_logits(None, str(folder)), strict=True):
        assert float((got - want).abs().max()) <= TOL


def test_a_prefix_cache_hit_at_tp2_is_its_cold_run(tiny_checkpoints):
    """Qwen3.5: the hit resumes from the GDN checkpoint each rank kept of its own heads."""
    folder = str(tiny_checkpoints["qwen3_5"][1])
    rank0, rank1 = spawn(ranks.prefix_hit, 2, folder, threads=1)
    (cold_hits, cold), (hits, warm) = rank0
    assert cold_hits == 0 and hits > 0
    assert rank1[1][0] == hits
    assert float((warm - cold).abs().max()) == 0.0
    assert float((cold - ranks.prefix_hit(None, folder)[0][1]).abs().max()) <= TOL


def test_ranks_given_other_ids_or_plans_fail_the_turn_instead_of_mixing_collectives(tiny_checkpoints):
    results = spawn(ranks.diverging_turns, 2, str(tiny_checkpoints["qwen3_vl"][1]), threads=1, timeout_s=30)
    assert results == [["RankFailedError: the 2 ranks disagree on a turn's input ids",
                        "RankFailedError: the 2 ranks disagree on the step's plan"]] * 2


@pytest.mark.skipif(not (MODELS / "demo-v2" / "model.safetensors").is_file(), reason="no demo-v2 checkpoint")
def test_the_demo_model_answers_the_same_at_tp2():
    """A trained checkpoint, a real image through the vision tower replicated on both ranks, a vocabulary
    that splits unevenly: the same answers, the same logits up to fp32 rounding. A trained model's logits
    reach |16| (the tiny random ones stay near 1), and the all-reduce sums the partial products in another
    order than one rank does, so the bound is relative: 1.7e-5 at most was measured, 1.1e-6 of the
    largest logit."""
    folder = str(MODELS / "demo-v2")
    rank0, rank1 = spawn(ranks.demo_dialogue, 2, folder, threads=1)
    for (ids, logits), (ids1, _), (want_ids, want) in zip(rank0, rank1, ranks.demo_dialogue(None, folder),
                                                          strict=True):
        assert ids == ids1 == want_ids
        assert float((logits - want).abs().max()) <= 2e-6 * float(want.abs().max())


def test_ranks_measure_with_rank_0s_clock_so_the_tpot_objective_decides_alike(tiny_checkpoints):
    """Rank 1's own clock is ignored: both ranks report rank 0's times and took the same steps (a
    different decision would have failed the step's plan digest)."""
    rank0, rank1 = spawn(ranks.objective_turn, 2, str(tiny_checkpoints["qwen3_5"][1]), threads=1)
    assert rank0[:3] == rank1[:3]
    assert torch.equal(rank0[3], rank1[3])


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_a_handoff_at_tp2_gives_tp1s_answers(tiny_checkpoints, family):
    """Each rank ships its own KV and GDN heads to its peer in the deferred worker's group; the next
    turn equals TP = 1's, handed off or finished locally."""
    folder = str(tiny_checkpoints[family][1])
    rank0, rank1 = spawn(ranks.handoff_turns, 2, folder, True, threads=1)
    full = ranks.handoff_turns(None, folder, True)
    local = ranks.handoff_turns(None, folder, False)
    for got in (rank0, rank1):
        assert got["ids"] == full["ids"] == local["ids"]
        assert float((got["logits"] - full["logits"]).abs().max()) <= TOL
        assert got["kv_heads"] == full["kv_heads"] // 2
        assert got["gdn_heads"] == (None if full["gdn_heads"] is None else full["gdn_heads"] // 2)
