"""Decode throughput of N concurrent sessions in one engine: one process, one thread.

    python -m bench.batch [--quick] [--ns 1,4,16,32] [--repeats R] [--json PATH] [--plot PATH] [--profile]

N sessions on the random `bench` checkpoint each start a turn at once, then the engine is stepped until
every turn has ended (it batches all running turns into each step). Two workloads, 64 new tokens per
turn, EOS ignored: `text`, 256 random token ids per session; `image`, the same 256 ids around one
32×32 = 1,024-token image (precomputed embeddings: no vision tower runs) under `raincheck`: 30%
retention (uniform selector), the rest deferred and fused into decode steps after a 16-token guard in
fixed 31-row chunks (no TPOT objective), within the engine's deferred budget of 63 rows per step.

Throughput counts the steady-state steps only: those in which all N turns decode (not the prefill
steps, nor the tail once some turns have ended). Every step is timed in thread CPU time (with one torch
thread the forward computes in the calling thread) and in wall time. On this shared VM even CPU time is
stretched 1.5-2x in a neighbour's burst (stolen time is counted as the thread's), so, as in
bench.latency, the step time is the 20th percentile of the steps pooled over rounds, taken separately
for steps with and without fused deferred rows and weighted by their counts; tokens/s = N / that, and
`×N=1` is the ratio to N = 1. Cross-check: the median over rounds of each run's mean (`run means`).

`fused_step_over_plain_16`: 16 concurrent image turns, `raincheck` vs `hard` on the same prompts
(`hard` keeps the same 30% and drops the rest, so its steps are the plain decode steps of the same
16 sessions): raincheck's steps that carry fused deferred rows over hard's steps, both by the 20th
percentile. Cross-checks: the median over rounds of the same-round ratio of means, and the ratio over
raincheck's own plain steps (the guard's), which see exactly the same caches.

Every (workload, N) runs once per round, the order reversed every other round so drift hits all
alike, after one short untimed warm-up turn per workload. `--profile` adds a per-layer-kind breakdown
(forward hooks; thread CPU ms per step, exclusive of child modules) of the text step at N = 1 and at
the largest N, and of the plain and the fused steps of 16 image turns.

`chunk_cost_by_bucket` (bench/moe.py; `--no-moe` skips it): one image turn per chunk size (7/15/31/63
rows), dense Qwen3.5 vs its MoE shape: what carrying a chunk adds to a decode step, and how many
distinct experts the plain and the fused steps route to.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig

from . import moe, plots
from .common import FAMILIES, STEP_QUANTILE, build_engine, image_prompt, quantile, setup_torch

GOALS = {"scaling_32": 10.0, "fused_step_over_plain_16": 1.5}
FUSED_N = 16
MOE_VS_DENSE = ("qwen3_5", "qwen3_5_moe")
ROOT = Path(__file__).resolve().parent.parent


def deferral(policy: str) -> DeferralConfig:
    """30% retention, uniform selector, fixed 31-row chunks after a 16-token guard. A TPOT objective,
    where the engine has one, is turned off: it would pick the chunk sizes that this bench measures."""
    options = dict(selector="uniform", retention=0.3, chunk_size=31, guard=16)
    if "tpot_slo" in {f.name for f in dataclasses.fields(DeferralConfig)}:
        options["tpot_slo"] = None
    return DeferralConfig(policy, **options)


@dataclass(frozen=True)
class Workload:
    """What each of the N sessions sends: `image_side`² visual tokens (0: text only) between text ids."""

    name: str
    policy: str
    text: int
    image_side: int = 0

    def prompts(self, engine: Engine, n: int) -> list[Prompt]:
        """One prompt per session, each with its own random ids (and image)."""
        if self.image_side:
            return [image_prompt(engine, self.image_side, self.text // 2, seed=i) for i in range(n)]
        return [Prompt(torch.randint(16, 2000, (self.text,), generator=torch.Generator().manual_seed(i)).tolist())
                for i in range(n)]


@dataclass
class Run:
    """The steady-state steps of one batch of N turns: CPU and wall seconds, deferred rows carried."""

    n: int
    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    deferred: list[int] = field(default_factory=list)

    def tokens_per_s(self) -> float:
        """From the mean CPU time of the run's steps (the cross-check of `step_estimate`)."""
        return self.n * len(self.cpu) / sum(self.cpu)

    def times(self, fused: bool, wall: bool = False) -> list[float]:
        """Seconds of the steps with (`fused`) or without deferred rows."""
        return [t for t, d in zip(self.wall if wall else self.cpu, self.deferred, strict=True) if (d > 0) == fused]


def step_estimate(runs: Sequence[Run], fused: bool | None = None, wall: bool = False) -> float:
    """Mean step seconds rebuilt from the 20th percentile of the plain and of the fused steps pooled over
    the rounds, weighted by their counts (the same in every round: scheduling is deterministic); or of
    one class only (`fused`). A neighbour's burst stretches whole runs 2-3x on this machine, CPU time
    included (a VM counts stolen time as the thread's); a low percentile of ~100 steps is not moved."""
    classes = (False, True) if fused is None else (fused,)
    counts = {c: len(runs[-1].times(c)) for c in classes}
    total = sum(k * quantile([t for r in runs for t in r.times(c, wall)], STEP_QUANTILE)
                for c, k in counts.items() if k)
    return total / sum(counts.values())


def run_batch(engine: Engine, workload: Workload, prompts: Sequence[Prompt], max_new: int,
              on_step: Callable[[bool, int], None] | None = None) -> Run:
    """Admit one turn per prompt, each in its own session, then step the engine until all have ended.
    `on_step(steady, deferred rows)` runs after each step (the profiler's hook)."""
    cfg = deferral(workload.policy)
    sessions = [engine.open_session(deferral=cfg) for _ in prompts]
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    run = Run(len(prompts))
    gc.collect()
    gc.disable()                  # no collector pauses inside timed steps
    try:
        turns = [s.turn(p, params).request for s, p in zip(sessions, prompts, strict=True)]
        while not all(t.finished for t in turns):
            steady = all(t.decoding and not t.finished for t in turns)
            pending = sum(s.pending_deferred for s in sessions)
            cpu, wall = time.thread_time(), time.perf_counter()
            engine.step()
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            deferred = pending - sum(s.pending_deferred for s in sessions)
            if steady:
                run.cpu.append(cpu)
                run.wall.append(wall)
                run.deferred.append(deferred)
            if on_step is not None:
                on_step(steady, deferred)
    finally:
        gc.enable()
        for s in sessions:
            s.close()
    return run


# ---------------------------------------------------------------------------- rounds and summaries
Arm = tuple[str, int]          # (workload name, N)


def measure(engine: Engine, workloads: dict[str, Workload], arms: Sequence[Arm], repeats: int, max_new: int,
            desc: str) -> dict[Arm, list[Run]]:
    prompts = {name: w.prompts(engine, max(n for a, n in arms if a == name)) for name, w in workloads.items()}
    for name, w in workloads.items():          # warm-up: allocations, the fused path
        run_batch(engine, w, prompts[name][:4], min(max_new, 20))
    out: dict[Arm, list[Run]] = {arm: [] for arm in arms}
    with tqdm(total=repeats * len(arms), desc=desc, leave=False) as bar:
        for r in range(repeats):
            for name, n in arms if r % 2 == 0 else arms[::-1]:
                out[name, n].append(run_batch(engine, workloads[name], prompts[name][:n], max_new))
                bar.update()
    return out


def summarise(runs: dict[Arm, list[Run]], workloads: Sequence[str], ns: Sequence[int]) -> dict:
    """Per workload and N: tokens/s from the step estimate (CPU, wall) and, as a cross-check, the median
    over rounds of each run's mean; ratios to the smallest N."""
    out: dict = {}
    for name in workloads:
        rows = {}
        for n in ns:
            rs = runs[name, n]
            step = step_estimate(rs)
            rows[n] = dict(n=n, steps=len(rs[-1].cpu), step_ms=1e3 * step, tokens_per_s=n / step,
                           tokens_per_s_wall=n / step_estimate(rs, wall=True),
                           tokens_per_s_means=statistics.median(r.tokens_per_s() for r in rs),
                           deferred_rows_per_step=statistics.fmean(rs[-1].deferred))
        for row in rows.values():
            for key in ("", "_wall", "_means"):
                row["ratio" + key] = row["tokens_per_s" + key] / rows[ns[0]]["tokens_per_s" + key]
        out[name] = list(rows.values())
    return out


def fused_ratio(raincheck: list[Run], hard: list[Run]) -> dict:
    """Raincheck's steps carrying fused deferred rows over hard's steps (same prompts, same N) and over
    raincheck's own plain steps, by step estimate; cross-check: median over rounds of the same-round
    ratio of mean step times."""
    fused, plain_hard, plain_own = step_estimate(raincheck, True), step_estimate(hard), step_estimate(raincheck, False)
    means = [statistics.fmean(r.times(True)) / statistics.fmean(h.cpu) for r, h in zip(raincheck, hard, strict=True)]
    return dict(over_hard=fused / plain_hard, over_own_plain=fused / plain_own,
                over_hard_means=statistics.median(means),
                fused_step_ms=1e3 * fused, plain_step_ms_hard=1e3 * plain_hard, plain_step_ms_own=1e3 * plain_own,
                fused_steps=len(raincheck[-1].times(True)), plain_steps_own=len(raincheck[-1].times(False)),
                deferred_rows_per_fused_step=statistics.fmean([d for d in raincheck[-1].deferred if d]))


# ---------------------------------------------------------------------------- profile
KINDS = {"Linear": "linear layers", "MergedLinear": "linear layers", "Embedding": "linear layers",
         "Attention": "attention (no projections)",
         "GatedDeltaNet": "GDN (no projections)", "Conv1d": "GDN (no projections)",
         "SwiGLU": "MLP activation", "OffsetRMSNorm": "norms", "RMSNorm": "norms", "GatedRMSNorm": "norms"}
OUTSIDE = "outside the forward (plan, tensors, update, sampling)"


@contextmanager
def layer_timer(model: torch.nn.Module) -> Iterator[dict[str, float]]:
    """Thread CPU seconds per layer kind, exclusive of child modules; `totals['forward']` is inclusive."""
    totals: dict[str, float] = defaultdict(float)
    stack: list[list[float]] = []             # per open module: [start, time spent in children]

    def pre(_module: torch.nn.Module, _args: tuple[Any, ...]) -> None:
        stack.append([time.thread_time(), 0.0])

    def post(module: torch.nn.Module, _args: tuple[Any, ...], _out: Any) -> None:
        start, children = stack.pop()
        spent = time.thread_time() - start
        if module is model:
            totals["forward"] += spent
        totals[KINDS.get(type(module).__name__, "other model code")] += spent - children
        if stack:
            stack[-1][1] += spent

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        yield totals
    finally:
        for h in handles:
            h.remove()


def profile(engine: Engine, workload: Workload, n: int, max_new: int, fused: bool) -> dict[str, float]:
    """CPU ms per step of each layer kind in the steady steps of one batch (only those carrying deferred
    rows when `fused`, else those without), and of the whole step (`step`). The hooks add their own
    overhead (mostly to 'other model code')."""
    kinds: dict[str, float] = defaultdict(float)
    with layer_timer(engine.model) as totals:
        last = {}

        def on_step(steady: bool, deferred: int) -> None:
            if steady and (deferred > 0) == fused:
                for k, v in totals.items():
                    kinds[k] += v - last.get(k, 0.0)
            last.update(totals)

        run = run_batch(engine, workload, workload.prompts(engine, n), max_new, on_step)
    picked = [t for t, d in zip(run.cpu, run.deferred, strict=True) if (d > 0) == fused]
    kinds[OUTSIDE] = sum(picked) - kinds.pop("forward", 0.0)
    kinds["step"] = sum(picked)
    return {k: 1e3 * v / len(picked) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}


def linear_rates(engine: Engine, profiles: dict[str, dict[str, float]], ns: dict[str, int]) -> dict[str, float]:
    """The linear layers' arithmetic rate (GFLOP/s) in each profiled text step (`ns`: its rows), beside this
    core's rate on a large GEMM, and the most the last step's scaling could be were all but its linear layers
    as cheap as in the first (`scaling_bound`: hooked times, as the profile's)."""
    per_row = 2.0 * sum(m.weight.numel() for m in engine.model.modules()
                        if type(m).__name__ in ("Linear", "MergedLinear"))
    out = {name: per_row * ns[name] / (profiles[name][KINDS["Linear"]] * 1e-3) / 1e9 for name in ns}
    out["large GEMM"] = gemm_gflops()
    (one, n1), (top, n) = sorted(ns.items(), key=lambda kv: kv[1])[0], sorted(ns.items(), key=lambda kv: kv[1])[-1]
    first, last = profiles[one], profiles[top]
    out["scaling_bound"] = n / n1 * first["step"] / (last[KINDS["Linear"]] + first["step"] - first[KINDS["Linear"]])
    return out


def gemm_gflops(m: int = 512, k: int = 1024, n: int = 1024) -> float:
    """This core's rate on a large fp32 GEMM (best of 10, thread CPU time): what arithmetic-bound layers reach."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    best = math.inf
    for _ in range(12):
        t = time.thread_time()
        a @ b
        best = min(best, time.thread_time() - t)
    return 2 * m * k * n / best / 1e9


# ---------------------------------------------------------------------------- output
def scaling_table(results: dict[str, dict]) -> str:
    lines = ["| model | workload | N | tokens/s (CPU) | ×N=1 | ×N=1 (run means) | tokens/s (wall) | ×N=1 (wall) | "
             "step ms (CPU) | deferred rows/step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for family, res in results.items():
        for name, rows in res["scaling"].items():
            for r in rows:
                lines.append(f"| {family} | {name} | {r['n']} | {r['tokens_per_s']:.0f} | {r['ratio']:.2f} | "
                             f"{r['ratio_means']:.2f} | {r['tokens_per_s_wall']:.0f} | {r['ratio_wall']:.2f} | "
                             f"{r['step_ms']:.1f} | {r['deferred_rows_per_step']:.1f} |")
    return "\n".join(lines)


def fused_table(results: dict[str, dict]) -> str:
    lines = ["| model | fused step ms | plain step ms (hard) | fused / plain (hard) | … (run means) | "
             "plain step ms (own guard) | fused / own plain | fused steps | deferred rows per fused step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for family, res in results.items():
        f = res["fused"]
        if f:
            cells = [f"{f['fused_step_ms']:.1f}", f"{f['plain_step_ms_hard']:.1f}", f"{f['over_hard']:.2f}",
                     f"{f['over_hard_means']:.2f}", f"{f['plain_step_ms_own']:.1f}", f"{f['over_own_plain']:.2f}",
                     str(f["fused_steps"]), f"{f['deferred_rows_per_fused_step']:.1f}"]
            lines.append(f"| {family} | {' | '.join(cells)} |")
    return "\n".join(lines)


def profile_table(profiles: dict[str, dict[str, float]]) -> str:
    """One row per layer kind, one column per profiled step: ms per step (share of the step)."""
    lines = ["| CPU ms per step (share) | " + " | ".join(profiles) + " |", "|---|" + "---|" * len(profiles)]
    for kind in dict.fromkeys(k for p in profiles.values() for k in p):
        cells = " | ".join(f"{p.get(kind, 0):.1f} ({100 * p.get(kind, 0) / p['step']:.0f}%)" for p in profiles.values())
        lines.append(f"| {kind} | {cells} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="<= 3 min: N = 1, 4, 16; 64-token text, 16×16 image, 32 new tokens, 2 rounds")
    ap.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--max-new", type=int, default=None)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="add a per-layer-kind breakdown of the largest steps")
    ap.add_argument("--no-moe", action="store_true", help="skip the chunk-step cost by bucket, MoE vs dense")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, default=None,
                    help="PNG of tokens/s vs N (default docs/img/batch_scaling.png; not written with --quick)")
    args = ap.parse_args(argv)
    quick = args.quick
    args.ns = args.ns or ([1, 4, 16] if quick else [1, 4, 16, 32])
    args.repeats = args.repeats or (2 if quick else 3)
    args.max_new = args.max_new or (32 if quick else 64)
    args.text, args.side = (64, 16) if quick else (256, 32)
    if args.plot is None and not quick:
        args.plot = ROOT / "docs" / "img" / "batch_scaling.png"
    return args


def bench_family(family: str, args: argparse.Namespace, workdir: Path) -> dict:
    engine = build_engine(family, workdir)
    workloads = {"text": Workload("text", "full", args.text),
                 "image": Workload("image", "raincheck", args.text, args.side)}
    arms: list[Arm] = [(name, n) for name in workloads for n in args.ns]
    if FUSED_N in args.ns:
        workloads["image_hard"] = Workload("image_hard", "hard", args.text, args.side)
        arms.append(("image_hard", FUSED_N))
    runs = measure(engine, workloads, arms, args.repeats, args.max_new, family)
    out = dict(scaling=summarise(runs, ("text", "image"), args.ns),
               fused=fused_ratio(runs["image", FUSED_N], runs["image_hard", FUSED_N]) if FUSED_N in args.ns else None)
    if args.profile:
        top, text, image = args.ns[-1], workloads["text"], workloads["image"]
        out["profile"] = {
            "text N=1": profile(engine, text, 1, args.max_new, fused=False),
            f"text N={top}": profile(engine, text, top, args.max_new, fused=False),
            f"image N={FUSED_N}, plain (guard) steps": profile(engine, image, FUSED_N, args.max_new, fused=False),
            f"image N={FUSED_N}, fused steps": profile(engine, image, FUSED_N, args.max_new, fused=True)}
        out["linear_gflops"] = linear_rates(engine, out["profile"], {"text N=1": 1, f"text N={top}": top})
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_torch(args.threads)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results = {family: bench_family(family, args, Path(tmp)) for family in args.families.split(",")}
        buckets = None if args.no_moe else moe.bucket_costs(MOE_VS_DENSE, args.side, args.text, args.max_new,
                                                            args.repeats, Path(tmp))
    wall = time.perf_counter() - t0
    top = args.ns[-1]
    head = {
        "scaling_32": {f: r["scaling"]["text"][-1]["ratio"] for f, r in results.items()},
        "scaling_32_image": {f: r["scaling"]["image"][-1]["ratio"] for f, r in results.items()},
        "scaling_n": top,
        "fused_step_over_plain_16": {f: r["fused"]["over_hard"] for f, r in results.items() if r["fused"]},
    }
    if top != 32:
        head["note"] = f"scaling_32 is tokens/s at N = {top} (the largest N run) over N = 1, not N = 32"
    cmd = " ".join(["python -m bench.batch", *(argv if argv is not None else sys.argv[1:])])
    print(f"\n`{cmd}`: N = {args.ns}, {args.text}-token text, image {args.side}×{args.side} "
          f"(raincheck r = 0.3, c = 31), {args.max_new} new tokens, {args.threads} thread, "
          f"{args.repeats} rounds; wall {wall:.0f} s\n")
    print(scaling_table(results) + "\n")
    if any(r["fused"] for r in results.values()):
        print(f"Fused-chunk steps of {FUSED_N} concurrent image turns (CPU time, 20th-percentile step estimates):\n\n"
              f"{fused_table(results)}\n")
    for family, r in results.items():
        if "profile" in r:
            print(f"Where a step's CPU time goes, {family} (forward hooks):\n\n{profile_table(r['profile'])}\n")
            rates = r["linear_gflops"]
            steps = [k for k in rates if k.startswith("text")]
            print(f"Linear layers' arithmetic, {family}: " + ", ".join(f"{rates[k]:.0f} GFLOP/s ({k})" for k in steps)
                  + f"; this core's large GEMM: {rates['large GEMM']:.0f}. Were all but the linear layers of "
                  f"the {steps[-1]} step as cheap as in the {steps[0]} one, its scaling would be at most "
                  f"{rates['scaling_bound']:.2f} (hooked times).\n")
    if buckets:
        print(f"Extra cost of a chunk-carrying decode step over the plain step, by chunk bucket (one session, "
              f"CPU time, 20th percentiles; bench/moe.py):\n\n{moe.bucket_table(buckets)}\n")
    print(json.dumps(head, indent=2))
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        print(f"wrote {plots.batch_plot(results, args.plot)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {**head, "goals": GOALS, "quick": args.quick, "wall_s": wall, "command": cmd,
                   "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   "results": results, "chunk_cost_by_bucket": buckets}
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
