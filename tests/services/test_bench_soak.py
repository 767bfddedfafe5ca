"""bench.soak's code path, small, as its command runs (a process of its own: it sets the process's malloc
options as `raincheck serve` does): sessions in rounds, the table, the summary and the plot. The
measurement itself is docs/BENCHMARKS.md's."""

from __future__ import annotations

import json
import subprocess
import sys


def test_soak_reports_rss_and_the_encoder_cache_per_round(tmp_path):
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    subprocess.run([sys.executable, "-m", "bench.soak", "--sessions", "6", "--rounds", "2", "--concurrency", "2",
                    "--long-every", "3", "--max-new", "2", "--json", str(out), "--plot", str(png)],
                   check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert [r["sessions"] for r in result["rounds"]] == [3, 6]
    assert all(r["rss_mib"] > 0 for r in result["rounds"])
    assert 0 < result["rounds"][0]["encoder_cache_mib"] <= result["rounds"][1]["encoder_cache_mib"]  # new images
    assert result["rss_growth_after_warmup_less_encoder_cache"] <= result["rss_growth_after_warmup"]
    assert png.stat().st_size > 0
