"""Two builds of one native kernel side by side in one engine: this tree's and another revision's.

    python -m bench.kernel_ab KERNEL [--against REV] [--family F] [--workload text|image] [--ns 1,16]
                              [--rounds 4] [--bits] [--json PATH]

KERNEL is a file of raincheck_core/ops/csrc/ (row_linear, paged_attention, gated_deltanet); REV's copy of it
(default HEAD, the last commit; or a .c file) is built beside this tree's (csrc/'s headers are this tree's).
N sessions on the `bench` checkpoint each start a turn (bench.batch's workloads: `text`, 256 ids; `image`, a
32×32 image under `raincheck` with fused 31-row chunks), then the engine steps until they end, the build
swapped before every step, the first build alternating by round. So both builds see the same caches, contexts
and neighbours' bursts, step for step: on a shared host whole benchmark runs drift by 10-20% from one minute
to the next, more than a kernel change moves a step. Builds that pack the weights differently (row_linear's
tile width) cannot share an engine: each gets its own, which packs its weights under it, and the builds take
whole rounds in turn instead. Each build's steady steps (all N turns decoding) are timed in thread CPU time
(one torch thread); reported: their 20th percentile and median, and this tree's over REV's.

`--bits`: both builds also answer the same six greedy turns (text, and images with fused chunks and
their joins) with logprobs, which must be equal bit for bit where a change was meant to keep the arithmetic.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from raincheck_core import Engine, SamplingParams
from raincheck_core.ops import native

from .batch import Workload, deferral, run_batch
from .common import FAMILIES, STEP_QUANTILE, build_engine, quantile, setup_torch

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("this", "against")


def source_at(kernel: str, rev: str) -> str:
    """The kernel's C source at revision `rev` of this repository, or the file `rev` where one is named so
    (a variant not committed)."""
    if rev.endswith(".c"):
        return Path(rev).read_text()
    path = f"raincheck_core/ops/csrc/{kernel}.c"
    done = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"kernel_ab: cannot read {path} at {rev!r}: {done.stderr.strip()}")
    return done.stdout


def row_linear_tile(build: ctypes.CDLL) -> int:
    """The output columns a row_linear build packs a tile with."""
    return build.row_linear_tile()


def exported(kernel: str, text: str) -> str:
    """`text` with what this tree's Python side calls and an earlier revision's row_linear.c did not yet
    export: `row_linear_tile` (its TILE, by which ops/row_linear.py sizes the packed copy)."""
    if kernel == "row_linear" and "row_linear_tile" not in text:
        text += "\nint64_t row_linear_tile(void) { return TILE; }\n"
    return text


class Alternation:
    """`run_batch`'s step hook: puts the other build in place after every step, and notes which build each
    steady step ran on."""

    def __init__(self, kernel: str, builds: dict[str, ctypes.CDLL], first: int):
        self.kernel, self.builds, self.at = kernel, builds, first
        self.sides: list[str] = []
        native.use(kernel, builds[SIDES[first]])

    def __call__(self, steady: bool, _deferred: int) -> None:
        if steady:
            self.sides.append(SIDES[self.at])
        self.at = 1 - self.at
        native.use(self.kernel, self.builds[SIDES[self.at]])


def steps_side_by_side(engines: dict[str, Engine], kernel: str, builds: dict[str, ctypes.CDLL],
                       workload: Workload, n: int, rounds: int, max_new: int) -> dict[str, list[float]]:
    """Thread CPU seconds of each build's steady steps (bench.batch's `run_batch`). One engine for both: the
    builds take steps in turn, the first alternating by round. An engine each (builds that pack weights
    differently): the builds take whole rounds in turn, the first alternating."""
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    if engines["this"] is engines["against"]:
        prompts = workload.prompts(engines["this"], n)
        for r in range(rounds):
            alternation = Alternation(kernel, builds, r % 2)
            run = run_batch(engines["this"], workload, prompts, max_new, on_step=alternation)
            for side, cpu in zip(alternation.sides, run.cpu, strict=True):
                times[side].append(cpu)
        return times
    prompts = {side: workload.prompts(engines[side], n) for side in SIDES}
    for r in range(rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            native.use(kernel, builds[side])
            times[side] += run_batch(engines[side], workload, prompts[side], max_new).cpu
    return times


def engines_for(builds: dict[str, ctypes.CDLL], kernel: str, family: str, workdir: Path) -> dict[str, Engine]:
    """One engine for both builds, or one each where they pack weights differently (row_linear's tile width):
    each engine packs its weights, at its first decode step, under its own build."""
    if kernel != "row_linear" or len({row_linear_tile(b) for b in builds.values()}) == 1:
        engine = build_engine(family, workdir / "this")
        return {side: engine for side in SIDES}
    engines = {}
    for side in SIDES:
        native.use(kernel, builds[side])
        engines[side] = engine = build_engine(family, workdir / side)
        text = Workload("text", "full", 8)
        run_batch(engine, text, text.prompts(engine, 2), 2)
    return engines


def answers(engine: Engine, side_build: ctypes.CDLL, kernel: str) -> list[list[tuple[int, float | None]]]:
    """Six greedy turns at once (three text, three image with fused chunks), their tokens and logprobs."""
    native.use(kernel, side_build)
    text, image = Workload("text", "full", 96), Workload("image", "raincheck", 32, 8)
    prompts = [(w, p) for w in (text, image) for p in w.prompts(engine, 3)]
    sessions = [engine.open_session(deferral=deferral(w.policy)) for w, _ in prompts]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=True, temperature=0.0)
    turns = [s.turn(p, params).request for s, (_, p) in zip(sessions, prompts, strict=True)]
    while not all(t.finished for t in turns):
        engine.step()
    for s in sessions:
        s.close()
    return [[(e.token_id, e.logprob) for e in t.events if hasattr(e, "logprob")] for t in turns]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", choices=sorted(p.stem for p in native.SOURCE_DIR.glob("*.c")))
    ap.add_argument("--against", default="HEAD", help="the revision (or .c file) whose build runs beside this tree's")
    ap.add_argument("--family", default="qwen3_5", choices=FAMILIES)
    ap.add_argument("--workload", default="text", choices=("text", "image"))
    ap.add_argument("--ns", default="1,16", help="concurrent sessions, comma-separated")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--bits", action="store_true", help="also compare greedy answers' logprobs bit for bit")
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    setup_torch(1)
    with tempfile.TemporaryDirectory() as tmp:
        against = exported(args.kernel, source_at(args.kernel, args.against))
        builds = {"this": native.library(args.kernel), "against": native.build_variant(args.kernel, against)}
        if any(b is None for b in builds.values()):
            raise SystemExit("kernel_ab: the native kernels are off or cannot be built here (see ops/native.py)")
        try:
            engines = engines_for(builds, args.kernel, args.family, Path(tmp))
            workload = (Workload("text", "full", 256) if args.workload == "text"
                        else Workload("image", "raincheck", 256, 32))
            out: dict = dict(kernel=args.kernel, against=args.against, family=args.family, workload=args.workload,
                             engines=len({id(e) for e in engines.values()}), ns={})
            alone = "" if engines["this"] is engines["against"] else ", an engine each (they pack weights differently)"
            print(f"`python -m bench.kernel_ab {' '.join(sys.argv[1:] if argv is None else argv)}`: {args.kernel}, "
                  f"this tree against {args.against}, {args.family}, {args.workload}, 1 thread, {args.rounds} rounds"
                  f"{alone}\n")
            print("| N | this p20 ms | against p20 ms | this / against (p20) | this / against (medians) | steps each |")
            print("|---|---|---|---|---|---|")
            for n in (int(x) for x in args.ns.split(",")):
                t = steps_side_by_side(engines, args.kernel, builds, workload, n, args.rounds, args.max_new)
                p20 = {s: quantile(t[s], STEP_QUANTILE) for s in SIDES}
                med = {s: statistics.median(t[s]) for s in SIDES}
                row = dict(p20_ms={s: 1e3 * p20[s] for s in SIDES}, median_ms={s: 1e3 * med[s] for s in SIDES},
                           ratio=p20["this"] / p20["against"], ratio_medians=med["this"] / med["against"],
                           steps=len(t["this"]))
                out["ns"][n] = row
                print(f"| {n} | {row['p20_ms']['this']:.2f} | {row['p20_ms']['against']:.2f} | {row['ratio']:.3f} | "
                      f"{row['ratio_medians']:.3f} | {row['steps']} |")
            if args.bits:
                this, against = (answers(engines[side], builds[side], args.kernel) for side in SIDES)
                same = this == against
                out["bits_equal"] = same
                print(f"\ngreedy answers' tokens and logprobs: {'equal bit for bit' if same else 'DIFFERENT'}")
        finally:
            native.use(args.kernel, builds["this"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
