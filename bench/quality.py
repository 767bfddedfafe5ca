"""Answer quality of the demo model (models/demo) under full / hard / raincheck / post_answer.

    python -m bench.quality [--quick] [--families single,multi,video] [--dialogues 160] [--json PATH] [--img DIR]
                            [--speculative-tokens K [--speculative-method ngram|mtp]]
    python -m bench.quality --merge SINGLE.json MULTI.json VIDEO.json [--json PATH] [--img DIR]

Held-out dialogues of the demo world (seed `HELD_OUT_SEED` and the next ones, never used in training) run
through the engine's public API with greedy decoding, one session per dialogue and arm; an answer counts
when it equals the reference exactly. Three families (`raincheck_demo.world.FAMILIES`): one
image with the first question (single), 1–3 images arriving at any turn (multi), a short video (video).
An answer's *age* is how many turns ago the visual it asks about arrived: age 0 is the arrival turn, where
raincheck has only the kept part of that visual (turn 1 in the single family), and "later" answers
(age ≥ 1: turns 2+ in the single family) are where deferred prefill should give back what hard pruning
lost. Long answers (lists) also get an item score: the share of their tokens in the right place. Every arm
of one selector and retention uses the same selection (docs/mechanism.md §1), so arms are paired per
dialogue; the recovered fraction (raincheck − hard) / (full − hard) on later answers gets a paired
bootstrap 95% interval over dialogues. The negative control is in bench/quality_control.py, the selectors'
pairwise overlap in bench/quality_overlap.py. Selectors run with the options the model folder ships
(`selector_options.json`, raincheck_core/pruning/settings.py), else with their defaults.

The JSON's top-level keys are the single family's (as before families existed); `families` holds the same
report for every family.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from raincheck_core import DeferralConfig, Engine, Message, SamplingParams
from raincheck_core.speculative.config import METHODS, SpeculativeConfig
from raincheck_demo.world import FAMILIES, Dialogue, make

from . import quality_control, quality_overlap

HELD_OUT_SEED = 20_261_129               # the single family's seed; family k uses HELD_OUT_SEED + k
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
    barrier_timeout_s: float | None = None   # the bounded arm: 0, follow-ups never wait (think time 0)

    def config(self, options: dict[str, dict]) -> DeferralConfig:
        """The arm's deferral config, with the model's calibrated `options` for its selector."""
        return DeferralConfig(self.policy if self.control is None else "hard", selector=self.selector,
                              selector_options=options.get(self.selector, {}), retention=self.retention,
                              chunk_size=self.chunk, guard=16, barrier_timeout_s=self.barrier_timeout_s)


def arms(quick: bool, family: str = "single", paper: tuple[str, ...] = PAPER_SELECTORS) -> list[Arm]:
    """quick: the `paper` selectors under hard and raincheck, post_answer at the default selector (if among
    them). Full: every policy for every selector (single family: also the baselines and the MMTok sweeps)."""
    sweeps = not quick and family == "single"
    out = [Arm("full", "full")]
    for sel in (*paper, *SELECTORS[len(PAPER_SELECTORS):]) if sweeps else paper:
        out += [Arm(f"{p}/{sel}", p, sel) for p in (("hard", "raincheck") if quick else POLICIES)]
    if quick and DEFAULT[0] in paper:
        out.append(Arm(f"post_answer/{DEFAULT[0]}", "post_answer"))
    main = DEFAULT[0] if DEFAULT[0] in paper else paper[0]
    out.append(Arm(f"bounded/{main}", "raincheck", main, barrier_timeout_s=0.0))
    if sweeps:
        for r in RETENTIONS[1:]:
            out += [Arm(f"{p}/{SWEEP_SELECTOR}@{r}", p, SWEEP_SELECTOR, r) for p in POLICIES]
        out += [Arm(f"raincheck/{SWEEP_SELECTOR}/c{c}", "raincheck", SWEEP_SELECTOR, chunk=c)
                for c in CHUNKS if c != DEFAULT[2]]
    out += [Arm("control/fresh", "hard", control="fresh"), Arm("control/kept", "hard", control="kept")]
    return out


def held_out(family: str, n: int) -> list[Dialogue]:
    rng = random.Random(HELD_OUT_SEED + FAMILIES.index(family))
    return [make(family, rng) for _ in range(n)]


def max_new(engine: Engine, dialogue: Dialogue) -> list[int]:
    return [len(engine.formatter.encode(q.answer)) + 8 for q in dialogue.questions]


def run_engine_arm(engine: Engine, cfg: DeferralConfig, dialogue: Dialogue, messages: list[Message],
                   waits: list[float] | None = None) -> list[str]:
    """The dialogue's answers, each question sent as the previous answer ends (think time 0); `waits`
    receives each turn's barrier wait."""
    session = engine.open_session(deferral=cfg)
    answers = []
    try:
        for message, limit in zip(messages, max_new(engine, dialogue), strict=True):
            end = session.turn(message, SamplingParams(max_new_tokens=limit)).result()
            answers.append(end.text)
            if waits is not None:
                waits.append(end.metrics.barrier_wait_s)
    finally:
        session.close()
    return answers


def item_score(answer: str, reference: str) -> float:
    got, ref = answer.split(), reference.split()
    return sum(a == b for a, b in zip(got, ref, strict=False)) / len(ref)


def ages(dialogue: Dialogue) -> list[int | None]:
    """Per turn, how many turns ago the visual its question needs arrived (None: a text question)."""
    return [t - dialogue.visuals[q.visual].turn if q.cells else None for t, q in enumerate(dialogue.questions)]


def score(dialogues: list[Dialogue], answers: list[list[str]]) -> list[list[dict]]:
    """Per dialogue, per turn: kind, turn, age, exact match, item score."""
    return [[{"kind": q.kind, "turn": t + 1, "age": age, "exact": " ".join(a.split()) == q.answer,
              "items": item_score(a, q.answer)}
             for t, (q, a, age) in enumerate(zip(d.questions, ans, ages(d), strict=True))]
            for d, ans in zip(dialogues, answers, strict=True)]


def _later(s: dict) -> bool:
    return s["age"] is not None and s["age"] >= 1


def summarise(scored: list[list[dict]]) -> dict:
    flat = [s for d in scored for s in d]

    def acc(rows: list[dict], key: str = "exact") -> float | None:
        return float(np.mean([r[key] for r in rows])) if rows else None

    out = {"all": acc(flat), "T1": acc([s for s in flat if s["turn"] == 1]),
           "T2": acc([s for s in flat if s["turn"] == 2]), "T3+": acc([s for s in flat if s["turn"] >= 3]),
           "T2+": acc([s for s in flat if s["turn"] >= 2]),
           "arrival": acc([s for s in flat if s["age"] == 0]), "later": acc([s for s in flat if _later(s)])}
    for kind in sorted({s["kind"] for s in flat}):
        out[kind] = acc([s for s in flat if s["kind"] == kind])
    lists = [s for s in flat if s["kind"] == "list"]
    out["list_items_T1"] = acc([s for s in lists if s["turn"] == 1], "items")
    out["list_items_T2+"] = acc([s for s in lists if s["turn"] >= 2], "items")
    out["list_items_arrival"] = acc([s for s in lists if s["age"] == 0], "items")
    out["list_items_later"] = acc([s for s in lists if _later(s)], "items")
    return out


def later_answers(scored: list[list[dict]], which: Callable[[dict], bool] = _later) -> np.ndarray:
    """[dialogues, 2]: correct answers and answers about a visual sent in an earlier turn (or those `which`
    picks), per dialogue (turns 2+ in the single family)."""
    return np.array([[sum(s["exact"] for s in d if which(s)), sum(which(s) for s in d)] for d in scored])


def recovered(full: np.ndarray, hard: np.ndarray, rc: np.ndarray, idx: np.ndarray | None = None) -> float:
    if idx is not None:
        full, hard, rc = full[idx], hard[idx], rc[idx]
    n = full[:, 1].sum()
    f, h, r = full[:, 0].sum() / n, hard[:, 0].sum() / n, rc[:, 0].sum() / n
    return float((r - h) / (f - h)) if f > h else float("nan")


def accuracy_ci(scored: list[list[dict]], which: Callable[[dict], bool] = _later, reps: int = 2000, seed: int = 0
                ) -> list[float]:
    """Marginal 95% bootstrap interval (over dialogues) of one arm's exact match on later answers (or those
    `which` picks)."""
    per = later_answers(scored, which)
    idx = np.random.default_rng(seed).integers(0, len(per), (reps, len(per)))
    with np.errstate(invalid="ignore"):
        stats = per[idx, 0].sum(1) / per[idx, 1].sum(1)
    return [float(x) for x in np.nanpercentile(stats, [2.5, 97.5])]


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


def run_family(engine: Engine, family: str, args: argparse.Namespace) -> dict:
    dialogues = held_out(family, args.dialogues)
    messages = [[d.message(t) for t in range(len(d.questions))] for d in dialogues]
    options = args.selector_options
    results, timing, waits = {}, {}, {}
    for arm in arms(args.quick, family, args.selectors):
        cfg = arm.config(options)
        n = args.control_dialogues if arm.control else len(dialogues)
        t0 = time.perf_counter()
        answers = []
        for d, m in tqdm(list(zip(dialogues[:n], messages[:n], strict=True)), desc=f"{family} {arm.name}",
                         leave=False):
            if arm.control:
                answers.append(quality_control.run_dialogue(engine, d, m, cfg, arm.control == "fresh",
                                                            max_new(engine, d)))
            else:
                answers.append(run_engine_arm(engine, cfg, d, m, waits.setdefault(arm.name, [])))
        results[arm.name] = score(dialogues[:n], answers)
        timing[arm.name] = time.perf_counter() - t0
        tqdm.write(f"{family:6s} {arm.name:28s} {summarise(results[arm.name])['all']:.3f}  ({timing[arm.name]:.0f} s)")
    t0 = time.perf_counter()
    overlap = quality_overlap.measure(engine, messages[:args.control_dialogues], PAPER_SELECTORS, DEFAULT[1], options)
    timing["overlap"] = time.perf_counter() - t0
    return family_report(family, results, timing, overlap, args, waits)


def bounded_report(results: dict, waits: dict[str, list[float]], summary: dict) -> dict | None:
    """The bounded arm beside the waiting raincheck arm of its selector: later-answer accuracy, recovered
    fraction, and the barrier waits of its follow-ups (0 when none waited)."""
    name = next((n for n in results if n.startswith("bounded/")), None)
    if name is None:
        return None
    sel = name.split("/")[1]
    full, hard = later_answers(results["full"]), later_answers(results[f"hard/{sel}"])
    return {"selector": sel, "acc": summary[name]["later"], "raincheck_acc": summary[f"raincheck/{sel}"]["later"],
            "recovered_fraction": recovered(full, hard, later_answers(results[name])),
            "raincheck_recovered_fraction": recovered(full, hard, later_answers(results[f"raincheck/{sel}"])),
            "barrier_wait_s_max": max(waits[name]), "raincheck_barrier_wait_s_max": max(waits[f"raincheck/{sel}"])}


def family_report(family: str, results: dict, timing: dict, overlap: dict, args: argparse.Namespace,
                  waits: dict[str, list[float]] | None = None) -> dict:
    summary = {name: {**summarise(scored), "later_ci95": accuracy_ci(scored),
                      "T2+_ci95": accuracy_ci(scored, lambda s: s["turn"] >= 2)} for name, scored in results.items()}
    full = later_answers(results["full"])
    selectors = {}
    for sel in sorted({name.split("/")[1] for name in results if name.startswith("hard/") and "@" not in name},
                      key=SELECTORS.index):
        hard, rc = later_answers(results[f"hard/{sel}"]), later_answers(results[f"raincheck/{sel}"])
        point, lo, hi = bootstrap(full, [(hard, rc)])
        selectors[sel] = {"full_acc": summary["full"]["later"], "hard_acc": summary[f"hard/{sel}"]["later"],
                          "raincheck_acc": summary[f"raincheck/{sel}"]["later"],
                          "post_answer_acc": summary.get(f"post_answer/{sel}", {}).get("later"),
                          "recovered_fraction": point, "ci95": [lo, hi]}
    paper = [s for s in PAPER_SELECTORS if s in selectors]
    pairs = [(later_answers(results[f"hard/{s}"]), later_answers(results[f"raincheck/{s}"])) for s in paper]
    mean_point, mean_lo, mean_hi = bootstrap(full, pairs)
    n_ctrl = len(results["control/fresh"])
    ctrl_full = later_answers(results["full"][:n_ctrl])
    # the top-level per-selector keys: the default selector's, or the first measured one's (`--selectors`)
    main = DEFAULT[0] if DEFAULT[0] in selectors else paper[0]
    default = selectors[main]
    return {
        "family": family, "dialogues": len(results["full"]), "answers": sum(map(len, results["full"])),
        "selector": main, "paper_selectors": paper,
        "later_answers": int(full[:, 1].sum()),
        "full_acc": default["full_acc"], "hard_acc": default["hard_acc"], "raincheck_acc": default["raincheck_acc"],
        "full_acc_all": summary["full"]["all"],
        "recovered_fraction": default["recovered_fraction"], "recovered_fraction_ci95": default["ci95"],
        "paper_selectors_recovered_fraction": mean_point, "paper_selectors_ci95": [mean_lo, mean_hi],
        "control_dialogues": n_ctrl,
        "control": {"fresh_acc": summary["control/fresh"]["later"], "kept_acc": summary["control/kept"]["later"],
                    "full_acc_same_dialogues": float(ctrl_full[:, 0].sum() / ctrl_full[:, 1].sum())},
        "overlap": overlap, "per_selector": selectors, "arms": summary, "seconds": timing,
        "bounded": bounded_report(results, waits or {}, summary),
    }


def run(args: argparse.Namespace) -> dict:
    if args.merge:
        # families measured by separate runs (e.g. in parallel), in FAMILIES order
        runs = [json.loads(Path(path).read_text()) for path in args.merge]
        found = {name: rep for run in runs for name, rep in run["families"].items()}
        args.model, args.quick = runs[0]["model"], runs[0]["quick"]
        args.selector_options = runs[0].get("selector_options", {})
        args.dialogues = max(run["dialogues"] for run in runs)
        args.speculative_tokens = runs[0].get("speculative_tokens", 0)
        args.speculative_method = runs[0].get("speculative_method") or "ngram"
        return report({name: found[name] for name in FAMILIES if name in found}, args)
    # with speculative decoding: under raincheck it changes which tokens see which chunk
    k = args.speculative_tokens
    speculative = SpeculativeConfig(args.speculative_method, k) if k else SpeculativeConfig()
    engine = Engine.from_pretrained(args.model, num_threads=args.threads, speculative=speculative)
    args.selector_options = engine.selector_options     # what the folder ships, as its sessions use them
    families = {family: run_family(engine, family, args) for family in args.families}
    return report(families, args)


def report(families: dict[str, dict], args: argparse.Namespace) -> dict:
    main = families.get("single") or next(iter(families.values()))
    out = {
        "model": str(args.model), "dialogues": args.dialogues, "quick": args.quick, "seed": HELD_OUT_SEED,
        "speculative_tokens": args.speculative_tokens,
        "speculative_method": args.speculative_method if args.speculative_tokens else None,
        "default": {"selector": DEFAULT[0], "retention": DEFAULT[1], "chunk_size": DEFAULT[2]},
        "selector_options": args.selector_options,
        **{k: v for k, v in main.items() if k not in ("family", "dialogues")},
        "sweep": {"selector": SWEEP_SELECTOR, "retentions": RETENTIONS, "chunks": CHUNKS},
        "families": families,
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
    p.add_argument("--quick", action="store_true", help="fewer dialogues and arms (a few minutes)")
    p.add_argument("--families", default=",".join(FAMILIES), help="dialogue families to run, comma-separated")
    p.add_argument("--dialogues", type=int, default=None, help="held-out dialogues per family (default 160, quick 24)")
    p.add_argument("--control-dialogues", type=int, default=None,
                   help="dialogues for the control arms and the selection overlap")
    p.add_argument("--selectors", default=",".join(PAPER_SELECTORS),
                   help="paper selectors to measure, comma-separated (default: all four)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--speculative-tokens", type=int, default=0, help="drafts per decode step (0: off)")
    p.add_argument("--speculative-method", choices=METHODS, default="ngram",
                   help="who drafts: prompt lookup, or the checkpoint's MTP head (demo-v2 ships one)")
    p.add_argument("--json", default=None)
    p.add_argument("--img", default=None, help="folder for the PNG plots (e.g. docs/img)")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="measure nothing: combine the families of earlier runs' --json reports into one report")
    args = p.parse_args(argv)
    args.families = args.families.split(",")
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        p.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    chosen = args.selectors.split(",")
    if not set(chosen) <= set(PAPER_SELECTORS):
        p.error(f"unknown selectors {sorted(set(chosen) - set(PAPER_SELECTORS))}; "
                f"choose from {', '.join(PAPER_SELECTORS)}")
    args.selectors = tuple(s for s in PAPER_SELECTORS if s in chosen)
    args.dialogues = args.dialogues or (24 if args.quick else 160)
    args.control_dialogues = min(args.dialogues, args.control_dialogues or (12 if args.quick else 80))
    return args


if __name__ == "__main__":
    run(parse_args())
