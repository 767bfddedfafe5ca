"""Deferred multimodal prefill latency: full / hard / raincheck / post_answer side by side.

    python -m bench.latency [--quick] [--threads N] [--repeats N] [--max-new T] [--json PATH]

One image turn (32×32 = 1,024 merged visual tokens between 64 text tokens) on the random `bench`
checkpoints, 30% retention (uniform selector), 128-token answers. Per policy: TTFT, mean TPOT, TPOT
during restoration, E2E, deferred tokens pending at answer end and post-response completion time,
with ratios to `full`. Then, on one family: a chunk-size sweep (fused and serial), a retention
sweep, and the GDN state-join micro-benchmark (online P update, join, error vs token-by-token
re-application of the recorded suffix factors).

Settings compared with each other run side by side in one process, order reversed every other
round. Tables give the best of the repeats (the least disturbed run on a shared machine) and, as a
cross-check, a step estimate: mean TPOT rebuilt from the 20th percentile of plain and of
chunk-carrying step times pooled over all repeats. The JSON adds medians and `paired` ratios
(median over rounds of same-round ratios). With 2 threads on a 2-core machine where another process
holds a core, OpenMP's barriers make every step 10-50x slower: use `--threads 1` there.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from raincheck_core.deferral.policy import CHUNK_SIZES, DeferralConfig

from . import plots
from .common import (
    FAMILIES,
    POLICIES,
    Arm,
    add_ratios,
    build_engine,
    gdn_join_bench,
    image_prompt,
    paired_median_ratio,
    ratio,
    run_rounds,
    setup_torch,
    summarise,
)

GOALS = {"ttft_ratio": 0.45, "tpot_ratio_best_c": 1.10, "fused_over_serial": 0.90, "join_rel_err": 1e-5}
ROOT = Path(__file__).resolve().parent.parent


def _cfg(args: argparse.Namespace, policy: str, **kw) -> DeferralConfig:
    base = dict(selector=args.selector, retention=args.retention, chunk_size=31, guard=16, fused=True)
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


def policies(engine, prompt, args, family: str) -> dict[str, dict]:
    arms = [Arm(p, _cfg(args, p)) for p in POLICIES]
    return _compare(engine, prompt, arms, args, f"{family} policies")


def chunk_sweep(engine, prompt, args) -> dict:
    arms = [Arm("full", _cfg(args, "full"))]
    for c in args.chunks:
        arms += [Arm(f"fused_c{c}", _cfg(args, "raincheck", chunk_size=c)),
                 Arm(f"serial_c{c}", _cfg(args, "raincheck", chunk_size=c, fused=False))]
    res = _compare(engine, prompt, arms, args, "chunk sweep")
    turns = res.pop("_turns")
    rows = []
    for c in args.chunks:
        f, s = res[f"fused_c{c}"], res[f"serial_c{c}"]
        rows.append(dict(chunk=c, fused=f, serial=s,
                         fused_over_serial=ratio(f["tpot_restoring_s"], s["tpot_restoring_s"]),
                         fused_over_serial_steps=ratio(f["restoring_step_s"], s["restoring_step_s"]),
                         fused_over_serial_paired=paired_median_ratio(
                             turns[f"fused_c{c}"], turns[f"serial_c{c}"], lambda t: t.tpot_restoring_s)))
    return dict(full=res["full"], rows=rows)


def retention_sweep(engine, prompt, args) -> dict:
    arms = [Arm("full", _cfg(args, "full"))]
    arms += [Arm(f"r{r}", _cfg(args, "raincheck", retention=r)) for r in args.retentions]
    res = _compare(engine, prompt, arms, args, "retention sweep")
    res.pop("_turns")
    return dict(full=res["full"], rows=[dict(retention=r, **res[f"r{r}"]) for r in args.retentions])


# ---------------------------------------------------------------------------- markdown
def _ms(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{1e3 * x:.{digits}f}"


def _x(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def policy_table(results: dict[str, dict]) -> str:
    lines = ["| model | policy | prefill rows | TTFT ms (×full) | mean TPOT ms (×full; step est.) | "
             "TPOT restoring ms | E2E ms (×full) | pending at end | completion ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for family, res in results.items():
        for p in POLICIES:
            s = res[p]
            lines.append(
                f"| {family} | {p} | {s['prompt_tokens']} | {_ms(s['ttft_s'])} ({_x(s['ttft_ratio'])}) | "
                f"{_ms(s['tpot_s'], 2)} ({_x(s['tpot_ratio'])}; {_x(s['tpot_steps_ratio'])}) | "
                f"{_ms(s['tpot_restoring_s'], 2)} | "
                f"{_ms(s['e2e_s'], 0)} ({_x(s['e2e_ratio'])}) | {s['deferred_pending']} / {s['deferred_tokens']} | "
                f"{_ms(s['completion_s'])} |")
    return "\n".join(lines)


def chunk_table(sweep: dict) -> str:
    lines = ["| c (rows/step) | mean TPOT ×full (step est.), fused / serial | compute floor | "
             "TPOT restoring ms, fused / serial | restoring step p20 ms, fused / serial | fused/serial (p20) | "
             "plain step p20 ms | chunk steps | pending at end |", "|---|---|---|---|---|---|---|---|---|"]
    for row in sweep["rows"]:
        f, s = row["fused"], row["serial"]
        lines.append(
            f"| {row['chunk']} ({row['chunk'] + 1}) | {_x(f['tpot_ratio'])} ({_x(f['tpot_steps_ratio'])}) / "
            f"{_x(s['tpot_ratio'])} ({_x(s['tpot_steps_ratio'])}) | {_x(f['tpot_floor'])} | "
            f"{_ms(f['tpot_restoring_s'], 2)} / {_ms(s['tpot_restoring_s'], 2)} | "
            f"{_ms(f['restoring_step_s'], 2)} / {_ms(s['restoring_step_s'], 2)} | "
            f"{_x(row['fused_over_serial'])} ({_x(row['fused_over_serial_steps'])}) | "
            f"{_ms(f['plain_step_s'], 2)} | {f['restoring_steps']} | {f['deferred_pending']} |")
    return "\n".join(lines)


def retention_table(sweep: dict) -> str:
    lines = ["| retention | prefill rows / deferred | TTFT ×full | mean TPOT ×full (step est.) | chunk steps | "
             "E2E ×full | completion ms |", "|---|---|---|---|---|---|---|"]
    for row in sweep["rows"]:
        lines.append(f"| {row['retention']} | {row['prompt_tokens']} / {row['deferred_tokens']} | "
                     f"{_x(row['ttft_ratio'])} | {_x(row['tpot_ratio'])} ({_x(row['tpot_steps_ratio'])}) | "
                     f"{row['restoring_steps']} | "
                     f"{_x(row['e2e_ratio'])} | {_ms(row['completion_s'])} |")
    return "\n".join(lines)


def gdn_table(rows: list[dict]) -> str:
    lines = ["| layer (value heads × Dk × Dv) | suffix n | online P update µs/token (1-token call) | "
             "GDN state step µs | join µs | join rel. error | error without join |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} ({r['heads']}×{r['dk']}×{r['dv']}) | {r['suffix']} | "
                     f"{r['extend_us_per_token']:.0f} ({r['extend_call_us']:.0f}) | {r['state_step_us']:.0f} | "
                     f"{r['join_us']:.0f} | {r['join_rel_err']:.1e} | {r['stale_rel_err']:.2f} |")
    return "\n".join(lines)


CROSS_CHECKS = {"ttft_ratio": ("ttft_ratio_paired", "median of same-round ratios"),
                "tpot_ratio_best_c": ("tpot_steps_ratio_best_c", "step-percentile estimate"),
                "fused_over_serial": ("fused_over_serial_steps", "restoring step p20 ratio"),
                "join_rel_err": (None, "")}


def goal_table(head: dict) -> str:
    lines = ["| goal | target | best of N | cross-check | met |", "|---|---|---|---|---|"]
    for key, target in GOALS.items():
        other, what = CROSS_CHECKS[key]
        values = [head[key]] + ([head[other]] if other else [])
        fmt = "{:.1e}" if key == "join_rel_err" else "{:.2f}"
        met = sum(v <= target for v in values)
        verdict = "yes" if met == len(values) else "no" if met == 0 else "on one of the two"
        check = f"{fmt.format(values[1])} ({what})" if other else "–"
        lines.append(f"| {key} | ≤ {target:g} | {fmt.format(values[0])} | {check} | {verdict} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- driver
def headline(results: dict, chunk: dict | None, gdn: list[dict], family: str) -> dict:
    rc = results[family]["raincheck"]
    head = dict(ttft_ratio=rc["ttft_ratio"], tpot_ratio=rc["tpot_ratio"],
                ttft_ratio_paired=rc["ttft_ratio_paired"], tpot_ratio_paired=rc["tpot_ratio_paired"],
                tpot_steps_ratio=rc["tpot_steps_ratio"],
                join_rel_err=max(r["join_rel_err"] for r in gdn) if gdn else None,
                fused_over_serial=None, tpot_ratio_best_c=None)     # set below when the sweeps ran
    if chunk:
        best = min(chunk["rows"], key=lambda r: r["fused"]["tpot_ratio"])
        steps = min(chunk["rows"], key=lambda r: r["fused"]["tpot_steps_ratio"])
        default = next((r for r in chunk["rows"] if r["chunk"] == 31), best)
        head.update(fused_over_serial=default["fused_over_serial"],
                    fused_over_serial_paired=default["fused_over_serial_paired"],
                    fused_over_serial_steps=default["fused_over_serial_steps"],
                    tpot_ratio_best_c=best["fused"]["tpot_ratio"], best_c=best["chunk"],
                    tpot_steps_ratio_best_c=steps["fused"]["tpot_steps_ratio"], best_c_steps=steps["chunk"])
    return head


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 repeats, 48-token answers, c ∈ {7, 31} (< 3 min)")
    ap.add_argument("--repeats", type=int, help="rounds per comparison (default 7; --quick 2)")
    ap.add_argument("--max-new", type=int, help="answer tokens (default 128; --quick 48)")
    ap.add_argument("--families", default=",".join(FAMILIES), help="policy comparison families")
    ap.add_argument("--sweep-family", default="qwen3_5", help="family for the sweeps")
    ap.add_argument("--side", type=int, default=32, help="image side in merged tokens (32 → 1,024 tokens)")
    ap.add_argument("--retention", type=float, default=0.3)
    ap.add_argument("--selector", default="uniform")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-sweeps", action="store_true", help="policies and the GDN micro-benchmark only")
    ap.add_argument("--img-dir", type=Path, help="where PNG plots go (default docs/img; none with --quick)")
    ap.add_argument("--json", type=Path, help="write every number here")
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 7)
    args.max_new = args.max_new or (48 if args.quick else 128)
    args.chunks = (7, 31) if args.quick else CHUNK_SIZES
    args.retentions = (0.3, 0.5, 0.7)
    args.gdn_lengths = (16, 64, 128)
    if args.img_dir is None and not args.quick:
        args.img_dir = ROOT / "docs" / "img"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_torch(args.threads)
    t0 = time.perf_counter()
    families = args.families.split(",")
    results, chunk, retention = {}, None, None
    with tempfile.TemporaryDirectory() as tmp:
        for family in dict.fromkeys([*families, args.sweep_family]):
            engine = build_engine(family, Path(tmp))
            prompt = image_prompt(engine, args.side)
            if family in families:
                results[family] = policies(engine, prompt, args, family)
                results[family].pop("_turns")
            if family == args.sweep_family and not args.no_sweeps:
                chunk = chunk_sweep(engine, prompt, args)
                retention = retention_sweep(engine, prompt, args)
            del engine
    gdn = gdn_join_bench(args.gdn_lengths, 3 if args.quick else 7)
    head = headline(results, chunk, gdn, args.sweep_family if args.sweep_family in results else families[0])
    wall = time.perf_counter() - t0
    cmd = " ".join(["python -m bench.latency", *(argv if argv is not None else sys.argv[1:])])
    print(f"\n`{cmd}`: {args.side ** 2} visual tokens, retention {args.retention}, {args.max_new}-token answers, "
          f"guard 16, threads {args.threads}, best of {args.repeats}; wall {wall:.0f} s\n")
    print(policy_table(results) + "\n")
    if chunk:
        print(f"Chunk size sweep ({args.sweep_family}, raincheck, r = {args.retention}):\n\n{chunk_table(chunk)}\n")
        print(f"Retention sweep ({args.sweep_family}, raincheck, c = 31):\n\n{retention_table(retention)}\n")
    print(f"GDN state join micro-benchmark (fp32, best of batches):\n\n{gdn_table(gdn)}\n")
    if chunk:
        print(goal_table(head))
    if args.img_dir:
        for path in plots.save_all(args.img_dir, results, chunk, retention, args.max_new):
            print(f"wrote {path}")
    if args.json:
        payload = {**head, "goals": GOALS, "wall_s": wall, "args": {k: v if not isinstance(v, Path) else str(v)
                                                                      for k, v in vars(args).items()},
                   "policies": results, "chunk_sweep": chunk, "retention_sweep": retention, "gdn_join": gdn}
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
