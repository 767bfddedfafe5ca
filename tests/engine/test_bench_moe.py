"""bench/moe.py on the random `bench` MoE checkpoint: the expert counter sees plain and fused steps, and
the chunk-bucket costs cover every bucket for MoE and dense (no timing is asserted)."""

from __future__ import annotations

import time

import torch

from bench import latency, moe
from bench.common import Arm
from raincheck_core.deferral.policy import CHUNK_SIZES, DeferralConfig
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
    assert moe_res["buckets"][7]["experts"] > shape["num_experts_per_tok"]
    assert "| qwen3_5_moe |" in moe.bucket_table(out)


def test_latency_section_reports_the_experts_of_decode_and_fused_steps(tmp_path):
    args = latency.parse_args(["--quick", "--side", "8", "--repeats", "1", "--max-new", "24"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        arms = [Arm(a, DeferralConfig(a, selector="uniform", retention=0.3, guard=16, tpot_slo=2.0))
                for a in moe.MOE_ARMS]
        res = moe.latency_section(args, tmp_path, arms, time.thread_time)
    finally:
        torch.set_num_threads(threads)
    assert set(res["arms"]) == {"full", "hard", "raincheck"} and res["arms"]["full"]["ttft_ratio"] == 1.0
    assert res["experts_per_decode_step"] == MOE_SHAPES["bench"]["num_experts_per_tok"]
    assert "experts_per_decode_step 4.0" in moe.latency_table(res)
