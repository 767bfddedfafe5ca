"""Tensor (and expert) parallelism on two gloo ranks: the logits at tensor_parallel_size 2 equal those at 1."""

from __future__ import annotations

from raincheck_core.parallel.launch import spawn
from tests.parallel import ranks

TOL = 1e-5
MOE = ("qwen3_vl_moe", "qwen3_5_moe")


def test_tp2_logits_equal_tp1_for_all_families(tiny_checkpoints):
    """Text and image prompts, the prefill's token then 20 decode steps; the MoE families with the
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
