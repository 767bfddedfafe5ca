"""bench/moe.py on the random `bench` MoE checkpoint: the expert counter sees plain and fused steps, and
the chunk-bucket costs cover every bucket for MoE and dense (no timing is asserted)."""

from __future__ import annotations

import torch

from bench import moe
from raincheck_core.deferral.policy import CHUNK_SIZES
from raincheck_core.models.random_init import MOE_SHAPES


def test_bucket_costs_and_expert_counts(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = moe.bucket_costs(("qwen3_5", "qwen3_5_moe"), side=8, text=16, max_new=20, repeats=1, workdir=tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert out["qwen3_5"]["experts_per_decode_step"] is None          # dense: no router to count
    shape = MOE_SHAPES["bench"]
    moe_res = out["qwen3_5_moe"]
    # one decode row routes to exactly top-k experts per layer; a fused chunk adds rows and experts
    assert moe_res["experts_per_decode_step"] == shape["num_experts_per_tok"]
    assert shape["num_experts_per_tok"] < moe_res["experts_per_fused_step"] <= shape["num_experts"]
    for family in out:
        assert set(out[family]["buckets"]) == set(CHUNK_SIZES)
        assert all(b["plain_ms"] > 0 for b in out[family]["buckets"].values())
    assert "| qwen3_5_moe |" in moe.bucket_table(out)
