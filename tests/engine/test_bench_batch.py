"""`python -m bench.batch` end to end on a small config: every run completes through the engine's public
API and the JSON report carries the keys the docs read (no timing is asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from bench import batch
from bench.common import build_engine


def test_quick_report_has_the_documented_keys(tmp_path):
    path = tmp_path / "batch.json"
    threads = torch.get_num_threads()
    try:         # one thread, as the bench sets it: two on a busy two-core machine are many times slower
        batch.main(["--quick", "--ns", "1,16", "--repeats", "1", "--max-new", "18", "--json", str(path),
                    "--plot", str(tmp_path / "batch.png")])
    finally:
        torch.set_num_threads(threads)
    out = json.loads(path.read_text())
    families = {"qwen3_5", "qwen3_vl"}
    assert set(out["scaling_32"]) == set(out["scaling_32_image"]) == set(out["fused_step_over_plain_16"]) == families
    assert out["scaling_n"] == 16 and "N = 16" in out["note"]
    for family in families:
        res = out["results"][family]
        for rows in res["scaling"].values():
            assert [r["n"] for r in rows] == [1, 16]
            assert rows[0]["ratio"] == 1.0 and all(r["steps"] > 0 and r["tokens_per_s"] > 0 for r in rows)
        assert res["scaling"]["text"][1]["deferred_rows_per_step"] == 0
        fused = res["fused"]
        # the 18-token answers pass the 16-token guard: some steps carry 31-row chunks, two per step at most
        assert fused["fused_steps"] > 0 and 0 < fused["deferred_rows_per_fused_step"] <= 63
        assert out["fused_step_over_plain_16"][family] == fused["over_hard"] > 0
    assert (tmp_path / "batch.png").stat().st_size > 0


def test_the_linear_layers_rates_bound_the_scaling(tmp_path):
    """`--profile`'s linear-layer rates: FLOPs of every linear weight per row over the layers' time, and the
    scaling the largest step could reach were all else as cheap as in one session's step."""
    engine = build_engine("qwen3_5", tmp_path, size="tiny")
    linear = batch.KINDS["Linear"]
    profiles = {"text N=1": {"step": 10.0, linear: 4.0}, "text N=16": {"step": 20.0, linear: 12.0}}
    rates = batch.linear_rates(engine, profiles, {"text N=1": 1, "text N=16": 16})
    assert rates["scaling_bound"] == pytest.approx(16 * 10 / (12 + 10 - 4))
    assert rates["text N=16"] == pytest.approx(16 * rates["text N=1"] * 4 / 12) and rates["text N=1"] > 0
    assert rates["large GEMM"] > 0
