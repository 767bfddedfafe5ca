"""Answer quality of the demo model (models/demo) under full / hard / raincheck / post_answer.

    python -m bench.quality [--quick] [--dialogues 160] [--json PATH] [--img docs/img]

Held-out dialogues of the demo world (seed `HELD_OUT_SEED`, never used in training) run through the
engine's public API with greedy decoding, one session per dialogue and arm; an answer counts when it
equals the reference exactly. Long answers (lists) also get an item score: the share of their tokens in
the right place. Every arm of one selector and retention uses the same selection (docs/mechanism.md §1), so
arms are paired per dialogue; the recovered fraction (raincheck − hard) / (full − hard) on turns 2+ gets
a paired bootstrap 95% interval over dialogues. The negative control is in bench/quality_control.py.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from raincheck_core import DeferralConfig, Engine, Message, SamplingParams
from raincheck_core.models.demo.world import Dialogue, make_dialogue

from . import quality_control

HELD_OUT_SEED = 20_261_129
PAPER_SELECTORS = ("mmtok", "hiprune", "divprune", "visionzip")
SELECTORS = (*PAPER_SELECTORS, "uniform", "query_topk")
POLICIES = ("hard", "raincheck", "post_answer")
DEFAULT = ("divprune", 0.3, 31)          # the engine's default selector, the paper's retention and chunk
SWEEP_SELECTOR = "mmtok"                 # retention and chunk sweeps (the paper's Figure 9 sweeps MMTok)
RETENTIONS = (0.3, 0.5, 0.7)
CHUNKS = (7, 15, 31, 63)


@dataclass(frozen=True)
class Arm:
    name: str
    policy: str
    selector: str = DEFAULT[0]
    retention: float = DEFAULT[1]
    chunk: int = DEFAULT[2]
    control: str | None = None           # "fresh" / "kept": bench/quality_control.py layouts

    @property
    def config(self) -> DeferralConfig:
        return DeferralConfig(self.policy if self.control is None else "hard", selector=self.selector,
                              retention=self.retention, chunk_size=self.chunk, guard=16)


def arms(quick: bool) -> list[Arm]:
    out = [Arm("full", "full")]
    for sel in PAPER_SELECTORS if quick else SELECTORS:
        out += [Arm(f"{p}/{sel}", p, sel) for p in (("hard", "raincheck") if quick else POLICIES)]
    if quick:
        out.append(Arm(f"post_answer/{DEFAULT[0]}", "post_answer"))
    else:
        for r in RETENTIONS[1:]:
            out += [Arm(f"{p}/{SWEEP_SELECTOR}@{r}", p, SWEEP_SELECTOR, r) for p in POLICIES]
        out += [Arm(f"raincheck/{SWEEP_SELECTOR}/c{c}", "raincheck", SWEEP_SELECTOR, chunk=c)
                for c in CHUNKS if c != DEFAULT[2]]
    out += [Arm("control/fresh", "hard", control="fresh"), Arm("control/kept", "hard", control="kept")]
    return out


def max_new(engine: Engine, dialogue: Dialogue) -> list[int]:
    return [len(engine.formatter.encode(q.answer)) + 8 for q in dialogue.questions]


def run_engine_arm(engine: Engine, arm: Arm, dialogue: Dialogue, png: bytes) -> list[str]:
    session = engine.open_session(deferral=arm.config)
    answers = []
    try:
        for t, (q, limit) in enumerate(zip(dialogue.questions, max_new(engine, dialogue), strict=True)):
            message = Message(q.text, images=[png] if t == 0 else [])
            answers.append(session.turn(message, SamplingParams(max_new_tokens=limit)).text())
    finally:
        session.close()
    return answers


def item_score(answer: str, reference: str) -> float:
    got, ref = answer.split(), reference.split()
    return sum(a == b for a, b in zip(got, ref, strict=False)) / len(ref)


def score(dialogues: list[Dialogue], answers: list[list[str]]) -> list[list[dict]]:
    """Per dialogue, per turn: kind, turn, exact match, item score."""
    return [[{"kind": q.kind, "turn": t + 1, "exact": " ".join(a.split()) == q.answer,
              "items": item_score(a, q.answer)} for t, (q, a) in enumerate(zip(d.questions, ans, strict=True))]
            for d, ans in zip(dialogues, answers, strict=True)]


def summarise(scored: list[list[dict]]) -> dict:
    flat = [s for d in scored for s in d]

    def acc(rows: list[dict], key: str = "exact") -> float | None:
        return float(np.mean([r[key] for r in rows])) if rows else None

    out = {"all": acc(flat), "T1": acc([s for s in flat if s["turn"] == 1]),
           "T2": acc([s for s in flat if s["turn"] == 2]), "T3+": acc([s for s in flat if s["turn"] >= 3]),
           "T2+": acc([s for s in flat if s["turn"] >= 2])}
    for kind in sorted({s["kind"] for s in flat}):
        out[kind] = acc([s for s in flat if s["kind"] == kind])
    lists = [s for s in flat if s["kind"] == "list"]
    out["list_items_T1"] = acc([s for s in lists if s["turn"] == 1], "items")
    out["list_items_T2+"] = acc([s for s in lists if s["turn"] >= 2], "items")
    return out


def later_turns(scored: list[list[dict]]) -> np.ndarray:
    """[dialogues, 2]: correct answers and answers on turns 2+, per dialogue."""
    return np.array([[sum(s["exact"] for s in d if s["turn"] >= 2), sum(s["turn"] >= 2 for s in d)] for d in scored])


def recovered(full: np.ndarray, hard: np.ndarray, rc: np.ndarray, idx: np.ndarray | None = None) -> float:
    if idx is not None:
        full, hard, rc = full[idx], hard[idx], rc[idx]
    n = full[:, 1].sum()
    f, h, r = full[:, 0].sum() / n, hard[:, 0].sum() / n, rc[:, 0].sum() / n
    return float((r - h) / (f - h)) if f > h else float("nan")


def accuracy_ci(scored: list[list[dict]], reps: int = 2000, seed: int = 0) -> list[float]:
    """Marginal 95% bootstrap interval (over dialogues) of the turns-2+ exact match of one arm."""
    per = later_turns(scored)
    idx = np.random.default_rng(seed).integers(0, len(per), (reps, len(per)))
    stats = per[idx, 0].sum(1) / per[idx, 1].sum(1)
    return [float(x) for x in np.percentile(stats, [2.5, 97.5])]


def bootstrap(full: np.ndarray, pairs: list[tuple[np.ndarray, np.ndarray]], reps: int = 2000,
              seed: int = 0) -> tuple[float, float, float]:
    """Mean recovered fraction over `pairs` of (hard, raincheck) and its paired 95% interval."""
    rng = np.random.default_rng(seed)
    point = float(np.mean([recovered(full, h, r) for h, r in pairs]))
    stats = []
    for _ in range(reps):
        idx = rng.integers(0, len(full), len(full))
        stats.append(np.mean([recovered(full, h, r, idx) for h, r in pairs]))
    lo, hi = np.nanpercentile(stats, [2.5, 97.5])
    return point, float(lo), float(hi)


def run(args: argparse.Namespace) -> dict:
    engine = Engine.from_pretrained(args.model, num_threads=args.threads)
    rng = random.Random(HELD_OUT_SEED)
    dialogues = [make_dialogue(rng) for _ in range(args.dialogues)]
    pngs = [d.scene.png() for d in dialogues]
    results, timing = {}, {}
    for arm in arms(args.quick):
        subset = dialogues[:args.control_dialogues] if arm.control else dialogues
        t0 = time.perf_counter()
        answers = []
        for d, png in tqdm(list(zip(subset, pngs, strict=False)), desc=arm.name, leave=False):
            if arm.control:
                answers.append(quality_control.run_dialogue(engine, d, png, arm.config, arm.control == "fresh",
                                                            max_new(engine, d)))
            else:
                answers.append(run_engine_arm(engine, arm, d, png))
        results[arm.name] = score(subset, answers)
        timing[arm.name] = time.perf_counter() - t0
        tqdm.write(f"{arm.name:28s} {summarise(results[arm.name])['all']:.3f}  ({timing[arm.name]:.0f} s)")
    return report(results, timing, args)


def report(results: dict, timing: dict, args: argparse.Namespace) -> dict:
    summary = {name: {**summarise(scored), "T2+_ci95": accuracy_ci(scored)} for name, scored in results.items()}
    full = later_turns(results["full"])
    selectors = {}
    for sel in (PAPER_SELECTORS if args.quick else SELECTORS):
        hard, rc = later_turns(results[f"hard/{sel}"]), later_turns(results[f"raincheck/{sel}"])
        point, lo, hi = bootstrap(full, [(hard, rc)])
        selectors[sel] = {"full_acc": summary["full"]["T2+"], "hard_acc": summary[f"hard/{sel}"]["T2+"],
                          "raincheck_acc": summary[f"raincheck/{sel}"]["T2+"],
                          "post_answer_acc": summary.get(f"post_answer/{sel}", {}).get("T2+"),
                          "recovered_fraction": point, "ci95": [lo, hi]}
    pairs = [(later_turns(results[f"hard/{s}"]), later_turns(results[f"raincheck/{s}"])) for s in PAPER_SELECTORS]
    mean_point, mean_lo, mean_hi = bootstrap(full, pairs)
    n_ctrl = len(results["control/fresh"])
    ctrl_full = later_turns(results["full"][:n_ctrl])
    default = selectors[DEFAULT[0]]
    out = {
        "model": str(args.model), "dialogues": args.dialogues, "quick": args.quick, "seed": HELD_OUT_SEED,
        "default": {"selector": DEFAULT[0], "retention": DEFAULT[1], "chunk_size": DEFAULT[2]},
        "full_acc": default["full_acc"], "hard_acc": default["hard_acc"], "raincheck_acc": default["raincheck_acc"],
        "recovered_fraction": default["recovered_fraction"], "recovered_fraction_ci95": default["ci95"],
        "paper_selectors_recovered_fraction": mean_point, "paper_selectors_ci95": [mean_lo, mean_hi],
        "control_dialogues": n_ctrl,
        "control": {"fresh_acc": summary["control/fresh"]["T2+"], "kept_acc": summary["control/kept"]["T2+"],
                    "full_acc_same_dialogues": float(ctrl_full[:, 0].sum() / ctrl_full[:, 1].sum())},
        "per_selector": selectors, "sweep": {"selector": SWEEP_SELECTOR, "retentions": RETENTIONS,
                                             "chunks": CHUNKS},
        "arms": summary, "seconds": timing,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    from . import quality_plots

    print(quality_plots.markdown(out))
    if args.img:
        quality_plots.plot(out, Path(args.img))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/demo")
    p.add_argument("--quick", action="store_true", help="fewer dialogues and arms (about 5 minutes)")
    p.add_argument("--dialogues", type=int, default=None, help="held-out dialogues (default 160, quick 24)")
    p.add_argument("--control-dialogues", type=int, default=None, help="dialogues for the control arms")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--img", default=None, help="folder for the PNG plots (e.g. docs/img)")
    args = p.parse_args(argv)
    args.dialogues = args.dialogues or (24 if args.quick else 160)
    args.control_dialogues = min(args.dialogues, args.control_dialogues or (12 if args.quick else 80))
    return args


if __name__ == "__main__":
    run(parse_args())
