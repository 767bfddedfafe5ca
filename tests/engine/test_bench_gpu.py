"""The device script's CPU dry run (`python -m bench.gpu --device cpu --tiny`): every part runs at tiny
shapes and writes the keys the device run writes; the timed backend is FlexAttention through the padded,
bucketed decode path (eager on the CPU). Parts are isolated: one that raises is recorded and the run goes
on; past the budget, parts are skipped, not started."""

from __future__ import annotations

import json

import pytest

from bench.gpu import kernels, parts, report
from bench.gpu.__main__ import main
from bench.gpu.timing import POLICIES
from tests.ops.fla_naive import naive_kernels


def test_dry_run_writes_the_device_runs_keys(tmp_path):
    path = tmp_path / "gpu.json"
    main(["--device", "cpu", "--tiny", "--json", str(path)])
    result = json.loads(path.read_text())
    assert (tmp_path / "gpu.log").read_text()
    assert result["backend"] == "flex" and result["reference_gdn"].endswith("torch_chunk_gated_delta_rule")
    for family, by_dtype in result["exactness"].items():
        for backend, errors in by_dtype["float32"].items():
            assert errors["full"] <= 1e-4 and errors["raincheck"] <= 1e-4, (family, backend)
    assert list(result["shapes"]) == ["tiny-qwen3_5", "tiny-qwen3_vl"]       # the GDN model first
    for rows in result["shapes"].values():
        for row in rows.values():
            assert row["transformers"]["ttft"] > 0 and row["transformers"]["tpot"] > 0
            for graphs in ("graphs_on", "graphs_off"):
                for policy in POLICIES:
                    assert row[graphs][policy]["ttft"] > 0 and row[graphs][policy]["tpot"] > 0
                assert row[graphs]["raincheck"]["restoring_steps"] > 0       # fused chunks ran
            assert row["graphs_on"]["skeletons"] > 0 and row["graphs_on"]["not_captured"] == 0   # the padded path
            assert row["tpot_over_floor"]["plain"] > 0 and row["tpot_over_floor"]["fused"] > 0
    assert all(part["ok"] for part in result["timeline"]), result["timeline"]
    for arms in result["speculation"].values():          # bench.spec's arms, on the device's engines
        assert set(arms) == {"full", "raincheck"} and arms["full"]["replay k=3"]["acceptance"] == 1.0
    assert result["gdn"]["join_us"] > 0 and "aten::" in result["profile"]["table"]
    assert result["profile"]["top"] and result["profile"]["wall_ms_per_step"] > 0
    groups = result["flex_check"]["groups"]       # each group kind against the fp32 reference
    assert list(groups) == ["fp32_gqa3"] and groups["fp32_gqa3"]["max_error"] <= 1e-5
    assert groups["fp32_gqa3"]["buckets"] == [1, 4, 16, 32]
    assert all(r["ms"] > 0 and r["kv_read_over_visible"] < 1.25 for r in result["flex_check"]["decode"])
    for rows in result["batched_decode"].values():       # more sessions, more tokens per second; one copy a step
        assert rows["64"]["tokens_per_s"] > rows["1"]["tokens_per_s"] > 0
        assert rows["1"]["staged_copies"] == rows["64"]["staged_copies"] == 1
    text = report.report(result)          # the tables docs/BENCHMARKS.md carries
    assert "| qwen3_5 | float32 | flex |" in text and "| tiny-qwen3_vl | 16 | on | raincheck_objective |" in text
    assert "| tiny-qwen3_5 | 16 |" in text.split("fused TPOT / floor")[1]
    assert "| 4 x 64 |" in text and "| tiny-qwen3_vl | 64 |" in text


def test_the_fla_smoke_part_measures_each_case():
    """The smoke part on fla's naive references (the device runs fla's Triton kernels): near-exact there."""
    out = kernels.fla_smoke("cpu", True, naive_kernels())
    for case in ("adapter_fp32", "adapter_bf16_inputs", "direct_bf16"):
        assert out[case]["finite"] and out[case]["warm_ms"] > 0
    assert all(e <= 1e-5 for e in out["adapter_fp32"]["errors"].values())
    assert 1e-5 < out["direct_bf16"]["errors"]["o"] <= 2e-2          # bf16 operands: their rounding shows


def test_a_failing_part_is_recorded_and_the_run_goes_on_and_the_budget_skips(tmp_path):
    path = tmp_path / "gpu.json"
    result: dict = {}
    run = parts.Parts(result, path, budget_s=3600)

    def broken() -> None:
        raise RuntimeError("no kernel image for this device")

    assert run.run(("a", "first"), broken) is None
    assert run.run(("a", "second"), lambda: {"x": 1}) == {"x": 1}
    saved = json.loads(path.read_text())
    assert "no kernel image" in saved["a"]["first"]["error"] and "Traceback" in saved["a"]["first"]["traceback"]
    assert saved["a"]["second"] == {"x": 1} and [p["ok"] for p in saved["timeline"]] == [False, True]
    late = parts.Parts({}, path, budget_s=0)
    assert late.run(("b",), pytest.fail) is None
    assert json.loads(path.read_text())["b"] == {"skipped": "budget"}


def test_a_resumed_run_keeps_what_succeeded_and_runs_the_rest(tmp_path):
    path = tmp_path / "gpu.json"
    first = parts.Parts({}, path, budget_s=3600)
    first.run(("a",), lambda: 1)
    first.run(("b",), lambda: 1 / 0)
    again = parts.Parts(json.loads(path.read_text()), path, budget_s=3600)
    assert again.done(("a",)) and not again.done(("b",))
    again.run(("a",), pytest.fail)
    again.run(("b",), lambda: 2)
    saved = json.loads(path.read_text())
    assert saved["a"] == 1 and saved["b"] == 2
    assert [(p["part"], p["run"], p["ok"]) for p in saved["timeline"]] == [("a", 1, True), ("b", 1, False),
                                                                            ("b", 2, True)]
