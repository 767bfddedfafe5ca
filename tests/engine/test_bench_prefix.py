"""`python -m bench.prefix --quick` end to end: the JSON report carries the documented keys, the regenerate
prefills no more than its new turn and the repeated image is served by the encoder cache (no timing is
asserted)."""

from __future__ import annotations

import json

import torch

from bench import prefix


def _report(tmp_path, *args: str) -> dict:
    """bench.prefix's JSON report of a run with `args` (the torch threads it sets put back)."""
    path = tmp_path / "prefix.json"
    threads = torch.get_num_threads()
    try:
        prefix.main([*args, "--repeats", "1", "--json", str(path)])
    finally:
        torch.set_num_threads(threads)
    return json.loads(path.read_text())


def test_quick_report(tmp_path):
    out = _report(tmp_path, "--quick")
    families = {"qwen3_5", "qwen3_vl"}
    assert set(out["warm_over_cold_ttft"]) == set(out["regenerate_prefilled_rows"]) == families
    for family in families:
        res = out["families"][family]
        assert res["regenerate"]["prefilled_rows"] <= res["regenerate"]["new_turn_rows"]
        assert out["encoder_cache_hits"][family] == 1 and res["encoder"]["tower_runs"] == 1
        assert res["encoder"]["second_session_cached_rows"] > res["encoder"]["visual_tokens"]
        for scenario in ("system", "image_full", "image_raincheck"):
            assert res[scenario]["hit_share"] > 0.85
    assert out["families"]["qwen3_5"]["system"]["memory"]["gdn_checkpoints"] > 0


def test_cold_only_report(tmp_path):
    cold = _report(tmp_path, "--cold-only")["cold_1024"]
    assert set(cold) == {"qwen3_5", "qwen3_vl"}
    for res in cold.values():
        assert set(res) == {"cold_ttft_ms", "cold_anywhere_ttft_ms", "aligned_over_anywhere"}
