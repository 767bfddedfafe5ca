"""`python -m bench.spec --quick` end to end on one model: the JSON report has every policy and arm, no
drafts with speculation off, and the replayed answer's drafts all accepted (no timing is asserted)."""

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
        assert set(policy) == {"off", *(f"{d} k={k}" for d in ("ngram", "replay") for k in (1, 2, 3))}
        assert policy["off"]["drafts"] == 0 and policy["off"]["tpot_ratio"] == 1.0
        assert all(r["tokens_per_s"] > 0 and r["tokens_per_step"] >= 1 for r in policy.values())
    # replaying the answer speculation off gave: every draft is right (full's answers are the same)
    for k in (1, 2, 3):
        replay = arms["full"][f"replay k={k}"]
        assert replay["acceptance"] == 1.0 and replay["tokens_per_step"] > 1
