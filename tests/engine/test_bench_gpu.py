"""The device script's CPU dry run (`python -m bench.gpu --device cpu --tiny`): every part runs at tiny
shapes and writes the keys the device run writes."""

from __future__ import annotations

import json

from bench.gpu.__main__ import main
from bench.gpu.timing import POLICIES


def test_dry_run_writes_the_device_runs_keys(tmp_path):
    path = tmp_path / "gpu.json"
    main(["--device", "cpu", "--tiny", "--json", str(path)])
    result = json.loads(path.read_text())
    assert (tmp_path / "gpu.log").read_text()
    for family, by_dtype in result["exactness"].items():
        for backend, errors in by_dtype["float32"].items():
            assert errors["full"] <= 1e-4 and errors["raincheck"] <= 1e-4, (family, backend)
    assert set(result["shapes"]) == {"tiny-qwen3_vl", "tiny-qwen3_5"}
    for rows in result["shapes"].values():
        for row in rows.values():
            assert row["transformers"]["ttft"] > 0 and row["transformers"]["tpot"] > 0
            for graphs in ("graphs_on", "graphs_off"):
                for policy in POLICIES:
                    assert row[graphs][policy]["ttft"] > 0 and row[graphs][policy]["tpot"] > 0
                assert row[graphs]["raincheck"]["restoring_steps"] > 0       # fused chunks ran
            assert row["tpot_over_floor"]["plain"] > 0 and row["tpot_over_floor"]["fused"] > 0
    assert result["gdn"]["join_us"] > 0 and "aten::" in result["profile"]
