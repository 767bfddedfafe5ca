"""A follow-up that arrives with no think time, with and without a bounded barrier (docs/mechanism.md §10).

    python -m bench.bounded [--repeats N] [--max-new T] [--side S] [--family F] [--json PATH]

Two turns on the random `bench` checkpoint (`bench.latency`'s image turn, then a text question sent the
moment the answer ends), wall clock, no background stepping: whatever of D is left when the answer
ends is pending at the follow-up. `waiting` (`barrier_timeout_s=None`, the paper's policy) restores it at
the barrier first; `bounded` (`barrier_timeout_s=0`) admits the follow-up at once and restores the rest
during and after its answer. Per arm, the median over rounds (arms alternate within a round) of the
follow-up's barrier wait, TTFT after admission, and their sum (what the user waits for the first token),
its mean TPOT, and the previous turn's rows still pending at its admission. `bench.latency` runs this as
part of its think-time scenario.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from raincheck_core import Engine, Prompt, TurnMetrics
from raincheck_core.deferral.policy import DeferralConfig

from .common import build_engine, image_prompt, run_dialogue, setup_torch, text_prompt, use_clock

ARMS = {"waiting": None, "bounded": 0.0}


def follow_up(engine: Engine, prompt: Prompt, repeats: int, max_new: int, selector: str = "uniform",
              retention: float = 0.3) -> dict[str, dict]:
    """Arm -> medians of the follow-up's numbers (keys as in the module docstring)."""
    use_clock(engine, time.perf_counter)
    prompts = [prompt, text_prompt(seed=1)]

    def cfg(timeout: float | None) -> DeferralConfig:
        return DeferralConfig("raincheck", selector=selector, retention=retention, barrier_timeout_s=timeout)

    run_dialogue(engine, prompts, cfg(None), max_new, 0.0)      # warm-up: the cost model learns wall steps
    runs: dict[str, list[TurnMetrics]] = {arm: [] for arm in ARMS}
    for r in range(repeats):
        for arm in ARMS if r % 2 == 0 else reversed(ARMS):
            runs[arm].append(run_dialogue(engine, prompts, cfg(ARMS[arm]), max_new, 0.0)[1])
    return {arm: _medians(ms) for arm, ms in runs.items()}


def _medians(ms: list[TurnMetrics]) -> dict:
    def med(get: Callable[[TurnMetrics], float]) -> float:
        return statistics.median(get(m) for m in ms)

    return {"barrier_wait_s": med(lambda m: m.barrier_wait_s), "ttft_s": med(lambda m: m.ttft_s),
            "wait_plus_ttft_s": med(lambda m: m.barrier_wait_s + m.ttft_s), "tpot_s": med(lambda m: m.tpot_s),
            "previous_pending": med(lambda m: m.previous_pending), "rounds": len(ms)}


def table(rows: dict[str, dict]) -> str:
    lines = ["| arm | barrier wait ms | TTFT after admission ms | wait + TTFT ms | mean TPOT ms | "
             "previous turn's D pending |", "|---|---|---|---|---|---|"]
    for arm, r in rows.items():
        lines.append(f"| {arm} | {1e3 * r['barrier_wait_s']:.1f} | {1e3 * r['ttft_s']:.1f} | "
                     f"{1e3 * r['wait_plus_ttft_s']:.1f} | {1e3 * r['tpot_s']:.2f} | {r['previous_pending']:g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--side", type=int, default=32, help="image side in merged tokens")
    ap.add_argument("--family", default="qwen3_5")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    setup_torch(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(args.family, Path(tmp))
        rows = follow_up(engine, image_prompt(engine, args.side), args.repeats, args.max_new)
    print(f"Follow-up with no think time ({args.family}, {args.side ** 2} visual tokens, {args.max_new}-token "
          f"answers, median of {args.repeats}):\n\n{table(rows)}")
    if args.json:
        args.json.write_text(json.dumps({"bounded_follow_up": rows, "args": vars(args) | {"json": str(args.json)}},
                                        indent=2))


if __name__ == "__main__":
    main()
