"""`python -m bench.spec --quick` end to end on one model: the JSON report has every policy and arm, drafts
are verified in the speculating arms and none with speculation off (no timing is asserted)."""

from __future__ import annotations

import json

import torch

from bench import spec


def test_quick_report(tmp_path):
    path = tmp_path / "spec.json"
    threads = torch.get_num_threads()
    try:
        spec.main(["--quick", "--models", "qwen3_vl", "--json", str(path)])
    finally:
        torch.set_num_threads(threads)
    arms = json.loads(path.read_text())["spec"]["bench qwen3_vl"]
    assert set(arms) == {"full", "raincheck"}
    for policy in arms.values():
        assert set(policy) == {"off", "k=1", "k=2", "k=3"}
        assert policy["off"]["drafts"] == 0 and policy["off"]["tpot_ratio"] == 1.0
        assert all(policy[k]["drafts"] > 0 and 0 <= policy[k]["acceptance"] <= 1 for k in ("k=1", "k=2", "k=3"))
        assert all(r["tokens_per_s"] > 0 and r["tokens_per_step"] >= 1 for r in policy.values())
