"""`python -m bench.quality` end to end on a few held-out dialogues of every family: every arm runs through
the engine's public API, the JSON report carries the keys the docs and CI read (the single family's at the
top level, as before families existed, and every family's under `families`), and the values are shares."""

from __future__ import annotations

import json

from bench import quality
from raincheck_demo.world import FAMILIES

from .helpers import FOLDER, V2, needs_checkpoint, needs_v2

REPORT_KEYS = {"full_acc", "hard_acc", "raincheck_acc", "recovered_fraction", "recovered_fraction_ci95",
               "paper_selectors_recovered_fraction", "paper_selectors_ci95", "control_dialogues", "control",
               "per_selector", "arms", "seconds", "overlap"}


@needs_v2
def test_quick_report_has_the_documented_keys(tmp_path):
    path = tmp_path / "quality.json"
    args = quality.parse_args(["--quick", "--model", str(V2), "--dialogues", "2", "--control-dialogues", "1",
                               "--threads", "1", "--json", str(path), "--img", str(tmp_path)])
    out = quality.run(args)
    assert json.loads(path.read_text()) == json.loads(json.dumps(out))
    assert REPORT_KEYS | {"model", "dialogues", "quick", "seed", "default", "sweep", "families"} <= set(out)
    assert set(out["families"]) == set(FAMILIES)
    assert out["full_acc"] == out["families"]["single"]["full_acc"]
    for family, rep in out["families"].items():
        assert set(rep) >= REPORT_KEYS and rep["family"] == family
        for key in ("full_acc", "hard_acc", "raincheck_acc"):
            assert 0.0 <= rep[key] <= 1.0
        assert isinstance(rep["recovered_fraction"], float)
        assert set(rep["per_selector"]) == set(quality.PAPER_SELECTORS)
        for s in rep["per_selector"].values():
            assert {"full_acc", "hard_acc", "raincheck_acc", "recovered_fraction", "ci95"} <= set(s)
        assert set(rep["overlap"]) == {f"{a}/{b}" for i, a in enumerate(quality.PAPER_SELECTORS)
                                       for b in quality.PAPER_SELECTORS[i + 1:]}
        assert all(0.0 <= v["mean"] <= v["max"] <= 1.0 for v in rep["overlap"].values())
        assert rep["arms"]["full"]["later"] == 1.0          # v2 answers these dialogues
        assert rep["bounded"]["barrier_wait_s_max"] == 0.0      # the bounded arm's follow-ups never waited
    assert {p.name for p in tmp_path.glob("*.png")} == {"quality_per_turn.png", "quality_recovered.png"}


@needs_checkpoint
def test_v1_single_family_report_keeps_its_top_level_keys(tmp_path):
    """v1 (`models/demo`) through the single family only: the top-level keys as before families."""
    args = quality.parse_args(["--quick", "--model", str(FOLDER), "--families", "single", "--dialogues", "2",
                               "--control-dialogues", "1", "--threads", "1"])
    out = quality.run(args)
    assert set(out) >= REPORT_KEYS and set(out["families"]) == {"single"}
    assert out["arms"]["full"]["T2+"] == out["full_acc"] == 1.0     # v1 answers these two dialogues


@needs_v2
def test_a_subset_of_the_paper_selectors(tmp_path):
    """`--selectors hiprune`: its arms only (with the options v2 ships), the mean over what was measured."""
    args = quality.parse_args(["--quick", "--model", str(V2), "--families", "single", "--selectors", "hiprune",
                               "--dialogues", "2", "--control-dialogues", "1", "--threads", "1"])
    out = quality.run(args)
    rep = out["families"]["single"]
    assert set(rep["per_selector"]) == {"hiprune"} and rep["selector"] == "hiprune"
    assert set(rep["arms"]) == {"full", "hard/hiprune", "raincheck/hiprune", "bounded/hiprune", "control/fresh",
                                "control/kept"}
    assert out["selector_options"]["hiprune"]["object_layer"] == "last"
    assert rep["paper_selectors_recovered_fraction"] == rep["per_selector"]["hiprune"]["recovered_fraction"]


def test_ages_count_turns_since_the_asked_about_visual_arrived():
    import random

    from raincheck_demo.world import Dialogue, Question, Visual, random_scene

    scene = random_scene(random.Random(0), 4, 4)
    d = Dialogue([Visual("image", (scene,), 1), Visual("image", (scene,), 2)],
                 [Question("text", "", "", ()), Question("colour", "", "", ((0, 0),), 0),
                  Question("colour", "", "", ((0, 0),), 1), Question("colour", "", "", ((0, 0),), 0)], "multi")
    assert quality.ages(d) == [None, 0, 0, 2]
