"""Deferred multimodal prefill latency: full / hard / raincheck / post_answer side by side, the TPOT
objective's trade-off, the cost of a chunk-carrying step, and think time between turns.

    python -m bench.latency [--quick] [--clock cpu|wall] [--threads N] [--repeats N] [--max-new T] [--json PATH]

One image turn (32×32 = 1,024 merged visual tokens between 64 text tokens) on the random `bench`
checkpoints, 30% retention (uniform selector), 128-token answers. Arms: full, hard, raincheck (the
default TPOT objective, `tpot_slo` 1.10), raincheck_fixed (`tpot_slo=None`: c = 31 on every step past
the guard, the paper's setting) and post_answer. Per arm: TTFT, mean TPOT, TPOT during restoration,
E2E, the share of the deferred tokens D restored before the answer ended, post-response completion
time, with ratios to `full`. Then, on one family:
- an objective sweep (`tpot_slo` from 1.0 to 2.0, and None): mean TPOT ratio vs share of D restored;
- a chunk-size sweep at `tpot_slo=None` (fused and serial), and from it the extra cost of a
  chunk-carrying step over a plain decode step, fitted as fixed + per-row (least squares over c);
- a retention sweep (full run only) and the GDN state-join micro-benchmark;
- the MoE shape (bench/moe.py): full / hard / raincheck on the random MoE checkpoint, with the
  distinct experts a plain decode step and a fused step route to;
- think time: 3 turns (image, then two text questions) with t seconds between an answer's end and
  the next question while the engine steps in the background; per policy the TTFT of turn 1, its
  mean TPOT, the barrier wait at turns 2-3 and the share of D restored before turn 1's answer ended;
  at think time 0 also the follow-up's barrier wait and TTFT with and without a bounded barrier
  (`barrier_timeout_s` 0 vs None, bench/bounded.py).

Clocks: the engine times everything (its step costs for the objective, `TurnMetrics`) with
`engine.clock`. `--clock cpu` (the default) sets it to the thread's CPU time: with one torch thread the
forward computes in the calling thread, so a step's CPU time is its own cost, not moved by another
process holding the core, as wall time on this shared 2-core machine is. The think-time scenario always
uses wall time (a user's think time is wall time, and the background stepper runs in another thread).

Settings compared with each other run side by side in one process, order reversed every other
round. Tables give the best of the repeats and, as a cross-check, a step estimate (mean TPOT rebuilt
from the 20th percentile of plain and of chunk-carrying step times pooled over all repeats) or the
median of same-round ratios (`paired`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from raincheck_core import Engine, Prompt, TurnMetrics
from raincheck_core.deferral.policy import CHUNK_SIZES, DeferralConfig

from . import bounded, moe, plots
from .common import (
    FAMILIES,
    Arm,
    TurnStats,
    add_ratios,
    build_engine,
    gdn_join_bench,
    image_prompt,
    ratio,
    run_dialogue,
    run_rounds,
    setup_torch,
    summarise,
    text_prompt,
    use_clock,
)
from .latency_tables import (
    chunk_table,
    gdn_table,
    goal_table,
    objective_table,
    policy_table,
    retention_table,
    think_table,
)

ARMS = ("full", "hard", "raincheck", "raincheck_fixed", "post_answer")
GAP_ARMS = ("raincheck", "raincheck_fixed", "post_answer")
DEFAULT_SLO = 1.10
OBJECTIVES = (1.0, 1.05, 1.1, 1.2, 1.5, 2.0, None)
QUICK_OBJECTIVES = (1.0, 1.1, 1.5, 2.0, None)
THINK_S = (0.0, 0.3, 1.0, 3.0)
GOALS = {"ttft_ratio": 0.35, "tpot_ratio": 1.10, "fixed_chunk_cost_ms": 2.0, "tpot_ratio_fixed": 1.30,
         "barrier_wait_s_think_ge_1s": 0.0, "fused_over_serial": 0.90, "join_rel_err": 1e-5}
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
ROOT = Path(__file__).resolve().parent.parent


def _cfg(args: argparse.Namespace, arm: str, **kw) -> DeferralConfig:
    """`raincheck_fixed` is raincheck without an objective (`tpot_slo=None`, fixed c)."""
    policy = "raincheck" if arm == "raincheck_fixed" else arm
    base = dict(selector=args.selector, retention=args.retention, chunk_size=31, guard=16, fused=True,
                tpot_slo=None if arm == "raincheck_fixed" else args.objective)
    return DeferralConfig(policy, **{**base, **kw})


def _compare(engine, prompt, arms: list[Arm], args, desc: str) -> dict[str, dict]:
    """Run the arms side by side; summaries with ratios to the arm named `full`."""
    turns = run_rounds(engine, prompt, arms, args.repeats, args.max_new, desc)
    out = {name: summarise(ts) for name, ts in turns.items()}
    for name, summary in out.items():
        add_ratios(summary, turns[name], out["full"], turns["full"])
        summary["tpot_floor"] = tpot_floor(summary, out["full"], args.max_new)
    out["_turns"] = turns   # dropped before the JSON is written
    return out


def tpot_floor(s: dict, full: dict, max_new: int) -> float:
    """The mean TPOT ratio raincheck would have if each deferred row fused into the answer cost only
    its share of `full`'s one-pass prefill (per-row TTFT) and fusing added nothing else: a compute floor."""
    fused = s["deferred_tokens"] - s["deferred_pending"] if s["restoring_steps"] else 0
    return 1 + fused * full["ttft_s"] / full["prompt_tokens"] / ((max_new - 1) * full["tpot_s"])


def policies(engine: Engine, prompt: Prompt, args: argparse.Namespace, family: str) -> dict[str, dict]:
    arms = [Arm(a, _cfg(args, a)) for a in ARMS]
    res = _compare(engine, prompt, arms, args, f"{family} policies")
    res.pop("_turns")
    return res


def _objective_arm(slo: float | None, args: argparse.Namespace) -> str:
    if slo is None:
        return "raincheck_fixed"
    return "raincheck" if slo == args.objective else f"slo_{slo:g}"


def _fused_arm(c: int) -> str:
    return "raincheck_fixed" if c == 31 else f"fused_c{c}"


def sweeps(engine: Engine, prompt: Prompt, args: argparse.Namespace, family: str) -> tuple[dict[str, dict], dict, dict]:
    """The policies, the objective sweep and the chunk sweep as one side-by-side comparison (one `full`,
    and each setting that belongs to several, such as raincheck at the default objective, run once):
    the policy table, the objective sweep ({full, rows}), the chunk sweep ({full, rows, fixed + per-row
    cost})."""
    arms = [Arm(a, _cfg(args, a)) for a in ARMS]
    arms += [Arm(_objective_arm(slo, args), _cfg(args, "raincheck", tpot_slo=slo)) for slo in args.objectives
             if _objective_arm(slo, args) not in ARMS]
    arms += [Arm(_fused_arm(c), _cfg(args, "raincheck_fixed", chunk_size=c)) for c in args.chunks if c != 31]
    arms += [Arm(f"serial_c{c}", _cfg(args, "raincheck_fixed", chunk_size=c, fused=False)) for c in args.serial]
    res = _compare(engine, prompt, arms, args, f"{family} policies and sweeps")
    turns = res.pop("_turns")
    objective = dict(full=res["full"],
                     rows=[dict(objective=slo, **res[_objective_arm(slo, args)]) for slo in args.objectives])
    return {a: res[a] for a in ARMS}, objective, chunk_sweep(res, turns, args)


def _median_step(turns: list[TurnStats], rows: int | None) -> float | None:
    steps = [g for t in turns for g in (t.plain_gaps() if rows is None else t.restoring_gaps(rows))]
    return statistics.median(steps) if steps else None


def chunk_sweep(res: dict[str, dict], turns: dict[str, list[TurnStats]], args: argparse.Namespace) -> dict:
    """Fixed c (`tpot_slo=None`): per c, the median plain and c-row step (the engine's clock), the extra
    cost of the chunk, fused vs serial; then the extra cost fitted as fixed + per-row over c."""
    rows = []
    for c in args.chunks:
        fused = turns[_fused_arm(c)]
        plain, chunk = _median_step(fused, None), _median_step(fused, c)
        row = dict(chunk=c, fused=res[_fused_arm(c)], plain_median_s=plain, chunk_median_s=chunk,
                   extra_s=chunk - plain)
        if c in args.serial:
            serial = turns[f"serial_c{c}"]
            row.update(serial=res[f"serial_c{c}"], serial_chunk_median_s=_median_step(serial, c),
                       fused_over_serial=ratio(chunk, _median_step(serial, c)),
                       fused_over_serial_steps=ratio(res[_fused_arm(c)]["restoring_step_s"],
                                                     res[f"serial_c{c}"]["restoring_step_s"]))
        rows.append(row)
    fixed, per_row = least_squares([r["chunk"] for r in rows], [r["extra_s"] for r in rows])
    return dict(full=res["full"], rows=rows, fixed_chunk_cost_s=fixed, per_row_cost_s=per_row)


def least_squares(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Intercept and slope of the least-squares line through (xs, ys)."""
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def retention_sweep(engine: Engine, prompt: Prompt, args: argparse.Namespace) -> dict:
    arms = [Arm("full", _cfg(args, "full"))]
    arms += [Arm(f"r{r}", _cfg(args, "raincheck", retention=r)) for r in args.retentions]
    res = _compare(engine, prompt, arms, args, "retention sweep")
    res.pop("_turns")
    return dict(full=res["full"], rows=[dict(retention=r, **res[f"r{r}"]) for r in args.retentions])


@dataclass
class GapRow:
    arm: str
    think_s: float
    ttft_s: float                  # turn 1
    tpot_s: float                  # turn 1's mean TPOT
    restored_before_end: float     # turn 1: share of D prefilled before its answer ended
    barrier_wait_s: list[float]    # turns 2 and 3


def think_time(engine: Engine, prompt: Prompt, args: argparse.Namespace) -> list[GapRow]:
    """Three turns per (arm, think time), wall clock, the engine stepping in the background; the
    median over repeats of each number."""
    use_clock(engine, time.perf_counter, calibrate=True)
    prompts = [prompt, text_prompt(seed=1), text_prompt(seed=2)]
    for arm in GAP_ARMS:   # one untimed dialogue per arm (allocations at its shapes) before anything is timed
        run_dialogue(engine, prompts[:1], _cfg(args, arm), args.max_new, 0.0)
    runs: dict[tuple[str, float], list[list[TurnMetrics]]] = {}
    engine.start_background()
    try:
        total = args.gap_repeats * len(GAP_ARMS) * len(args.think)
        with tqdm(total=total, desc="think time", leave=False) as bar:
            for r in range(args.gap_repeats):
                order = [(a, t) for a in GAP_ARMS for t in args.think]
                for arm, t in order if r % 2 == 0 else order[::-1]:
                    runs.setdefault((arm, t), []).append(
                        run_dialogue(engine, prompts, _cfg(args, arm), args.max_new, t))
                    bar.update()
    finally:
        engine.stop_background()
    rows = [_gap_row(arm, t, dialogues) for (arm, t), dialogues in runs.items()]
    return sorted(rows, key=lambda r: (GAP_ARMS.index(r.arm), r.think_s))


def _gap_row(arm: str, think_s: float, dialogues: list[list[TurnMetrics]]) -> GapRow:
    def med(get: Callable[[list[TurnMetrics]], float]) -> float:
        return statistics.median(get(d) for d in dialogues)

    return GapRow(arm, think_s, med(lambda d: d[0].ttft_s), med(lambda d: d[0].tpot_s),
                  med(lambda d: (d[0].deferred_tokens - d[0].deferred_pending) / d[0].deferred_tokens),
                  [med(lambda d: d[1].barrier_wait_s), med(lambda d: d[2].barrier_wait_s)])


# ---------------------------------------------------------------------------- driver
def headline(results: dict, objective: dict | None, chunk: dict | None, gaps: list[GapRow] | None,
             gdn: list[dict], family: str) -> dict:
    res = results[family]
    rc, fixed = res["raincheck"], res["raincheck_fixed"]
    head = dict(ttft_ratio=rc["ttft_ratio"], tpot_ratio=rc["tpot_ratio"],
                ttft_ratio_paired=rc["ttft_ratio_paired"], tpot_ratio_paired=rc["tpot_ratio_paired"],
                tpot_steps_ratio=rc["tpot_steps_ratio"], restored_before_end=rc["restored_before_end"],
                tpot_ratio_fixed=fixed["tpot_ratio"], tpot_ratio_fixed_paired=fixed["tpot_ratio_paired"],
                join_rel_err=max(r["join_rel_err"] for r in gdn) if gdn else None,
                fused_over_serial=None, fixed_chunk_cost_ms=None, per_row_cost_ms=None)  # set below when run
    if objective:
        head["objective_sweep"] = [dict(tpot_slo=r["objective"], tpot_ratio=r["tpot_ratio"],
                                        tpot_ratio_paired=r["tpot_ratio_paired"],
                                        restored_before_end=r["restored_before_end"]) for r in objective["rows"]]
    if chunk:
        default = next(r for r in chunk["rows"] if r["chunk"] == 31)
        head.update(fused_over_serial=default["fused_over_serial"],
                    fused_over_serial_steps=default["fused_over_serial_steps"],
                    fixed_chunk_cost_ms=1e3 * chunk["fixed_chunk_cost_s"],
                    per_row_cost_ms=1e3 * chunk["per_row_cost_s"],
                    plain_step_ms=1e3 * default["plain_median_s"])
    if gaps:
        head["barrier_wait_s"] = {f"{t:g}": {r.arm: max(r.barrier_wait_s) for r in gaps if r.think_s == t}
                                  for t in dict.fromkeys(r.think_s for r in gaps)}
        long = [max(r.barrier_wait_s) for r in gaps if r.think_s >= 1.0]
        head["barrier_wait_s_think_ge_1s"] = max(long) if long else None
    return head


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="one family, 2 repeats, 48-token answers, 5 objectives, serial c = 31 only, no retention "
                         "sweep, 1 think-time round (~2 min of CPU)")
    ap.add_argument("--repeats", type=int, help="rounds per comparison (default 7; --quick 2)")
    ap.add_argument("--think-repeats", type=int, help="rounds of the think-time scenario (default 3; --quick 1)")
    ap.add_argument("--max-new", type=int, help="answer tokens (default 128; --quick 48)")
    ap.add_argument("--families", help=f"policy comparison families (default {','.join(FAMILIES)}; "
                                       "--quick: the sweep family)")
    ap.add_argument("--sweep-family", default="qwen3_5", help="family for the sweeps and think time")
    ap.add_argument("--side", type=int, default=32, help="image side in merged tokens (32 → 1,024 tokens)")
    ap.add_argument("--retention", type=float, default=0.3)
    ap.add_argument("--selector", default="uniform")
    ap.add_argument("--objective", type=float, default=DEFAULT_SLO, help="tpot_slo of the raincheck arm")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="cpu",
                    help="engine clock for all but think time: thread CPU time (needs --threads 1) or wall")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-sweeps", action="store_true", help="policies and the GDN micro-benchmark only")
    ap.add_argument("--no-think", action="store_true", help="skip the think-time scenario")
    ap.add_argument("--img-dir", type=Path, help="where PNG plots go (default docs/img; none with --quick)")
    ap.add_argument("--json", type=Path, help="write every number here")
    moe.add_args(ap)
    args = ap.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu measures the calling thread only: use it with --threads 1")
    args.families = args.families or (args.sweep_family if args.quick else ",".join(FAMILIES))
    args.repeats = args.repeats or (2 if args.quick else 7)
    args.max_new = args.max_new or (48 if args.quick else 128)
    args.chunks = CHUNK_SIZES
    args.serial = (31,) if args.quick else CHUNK_SIZES
    sweep = QUICK_OBJECTIVES if args.quick else OBJECTIVES
    args.objectives = (*sorted({*(o for o in sweep if o is not None), args.objective}), None)
    args.retentions = () if args.quick else (0.3, 0.5, 0.7)
    args.think = THINK_S
    args.gap_repeats = args.think_repeats or (1 if args.quick else 3)
    args.gdn_lengths = (16, 64, 128)
    if args.img_dir is None and not args.quick:
        args.img_dir = ROOT / "docs" / "img"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_torch(args.threads)
    t0 = time.perf_counter()
    families = args.families.split(",")
    results, objective, chunk, retention, gaps, follow = {}, None, None, None, None, None
    with tempfile.TemporaryDirectory() as tmp:
        for family in dict.fromkeys([*families, args.sweep_family]):
            engine = build_engine(family, Path(tmp))
            use_clock(engine, CLOCKS[args.clock], calibrate=True)
            prompt = image_prompt(engine, args.side)
            if family == args.sweep_family and not args.no_sweeps:
                results[family], objective, chunk = sweeps(engine, prompt, args, family)
                retention = retention_sweep(engine, prompt, args) if args.retentions else None
            elif family in families:
                results[family] = policies(engine, prompt, args, family)
            if family == args.sweep_family and not args.no_think:
                gaps = think_time(engine, prompt, args)
                follow = bounded.follow_up(engine, prompt, args.gap_repeats, args.max_new, args.selector,
                                           args.retention)
            del engine
        moe_res = None if args.no_moe else moe.latency_section(
            args, Path(tmp), [Arm(a, _cfg(args, a)) for a in moe.MOE_ARMS], CLOCKS[args.clock])
    gdn = gdn_join_bench(args.gdn_lengths, 3 if args.quick else 7)
    main_family = args.sweep_family if args.sweep_family in results else families[0]
    head = headline(results, objective, chunk, gaps, gdn, main_family)
    wall = time.perf_counter() - t0
    cmd = " ".join(["python -m bench.latency", *(argv if argv is not None else sys.argv[1:])])
    print(f"\n`{cmd}`: {args.side ** 2} visual tokens, retention {args.retention}, {args.max_new}-token answers, "
          f"guard 16, objective {args.objective:g}, clock {args.clock}, threads {args.threads}, "
          f"best of {args.repeats}; wall {wall:.0f} s\n")
    print(policy_table(results) + "\n")
    if objective:
        print(f"Objective sweep ({args.sweep_family}, raincheck, r = {args.retention}):\n\n"
              f"{objective_table(objective)}\n")
        print(f"Chunk size sweep ({args.sweep_family}, raincheck, tpot_slo=None):\n\n{chunk_table(chunk)}\n")
        print(f"Extra cost of a chunk-carrying step over a plain decode step (least squares over c): "
              f"{1e3 * chunk['fixed_chunk_cost_s']:.2f} ms fixed + {1e3 * chunk['per_row_cost_s']:.3f} ms/row\n")
    if retention:
        print(f"Retention sweep ({args.sweep_family}, raincheck, objective {args.objective:g}):\n\n"
              f"{retention_table(retention)}\n")
    if gaps:
        print(f"Think time ({args.sweep_family}, wall clock, background stepping, median of {args.gap_repeats}):"
              f"\n\n{think_table(gaps)}\n")
    if follow:
        print(f"Follow-up at think time 0, waiting vs bounded barrier:\n\n{bounded.table(follow)}\n")
    print(f"GDN state join micro-benchmark (fp32, best of batches):\n\n{gdn_table(gdn)}\n")
    if moe_res:
        print(moe.latency_table(moe_res) + "\n")
    print(goal_table(head, GOALS))
    if args.img_dir:
        for path in plots.save_all(args.img_dir, results, chunk, retention, args.max_new, objective):
            print(f"wrote {path}")
    if args.json:
        payload = {**head, "goals": GOALS, "wall_s": wall, "torch": torch.__version__,
                   "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   "policies": results, "objective": objective, "chunk_sweep": chunk,
                   "retention_sweep": retention, "think_time": [vars(r) for r in gaps or []], "gdn_join": gdn,
                   "moe": moe_res, "bounded_follow_up": follow}
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
