"""`python -m bench.quality` end to end on two held-out dialogues: every arm runs through the engine's public
API, the JSON report carries the keys the docs and CI read, and the values are shares, not garbage."""

from __future__ import annotations

import json

from bench import quality

from .helpers import FOLDER, needs_checkpoint

pytestmark = needs_checkpoint


def test_quick_report_has_the_documented_keys(tmp_path):
    path = tmp_path / "quality.json"
    args = quality.parse_args(["--quick", "--model", str(FOLDER), "--dialogues", "2", "--control-dialogues", "1",
                               "--threads", "2", "--json", str(path), "--img", str(tmp_path)])
    out = quality.run(args)
    assert json.loads(path.read_text()) == json.loads(json.dumps(out))
    for key in ("full_acc", "hard_acc", "raincheck_acc"):
        assert 0.0 <= out[key] <= 1.0
    assert isinstance(out["recovered_fraction"], float)
    assert set(out["per_selector"]) == set(quality.PAPER_SELECTORS)
    for s in out["per_selector"].values():
        assert {"full_acc", "hard_acc", "raincheck_acc", "recovered_fraction", "ci95"} <= set(s)
    assert out["arms"]["full"]["T2+"] == 1.0                 # the shipped model answers these two dialogues
    assert {p.name for p in tmp_path.glob("*.png")} == {"quality_per_turn.png", "quality_recovered.png"}
