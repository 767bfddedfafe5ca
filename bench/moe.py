"""The MoE shape of the benchmarks: what a fused chunk costs when its rows route to other experts.

In a small-batch decode step of an MoE model the weights read are the active experts'; the rows of a
fused deferred chunk route to experts the decode rows do not use, and each one is another weight read.
`ExpertCounter` counts, per step, the distinct experts its MoE layers route rows to (forward hooks on
the routers; mean over layers), next to the step's rows by kind (the engine's `on_step` hook).

- `latency_section` (bench.latency): full / hard / raincheck at the default TPOT objective on the
  random `bench` MoE checkpoint, TTFT and TPOT ratios to full, and `experts_per_decode_step` /
  `experts_per_fused_step`;
- `bucket_costs` (bench.batch): the extra cost of a decode step carrying a chunk of 7/15/31/63 deferred
  rows over the plain step (one session, fixed chunk, no objective), per chunk bucket, MoE vs dense;
- `python -m bench.moe`: the two expert ops of ops/moe.py, the torch loop (one matmul pair per active
  expert) and torch's `_grouped_mm` over the same sorted rows, where this torch build has it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch

from raincheck_core import Engine
from raincheck_core.deferral.policy import CHUNK_SIZES, DeferralConfig
from raincheck_core.engine.hooks import StepStats
from raincheck_core.layers.moe import SparseMoE
from raincheck_core.models.random_init import MOE_FAMILIES, MOE_SHAPES, SIZES
from raincheck_core.ops.moe import grouped_experts, grouped_mm_available, grouped_mm_experts, route

from .common import (
    STEP_QUANTILE,
    Arm,
    add_ratios,
    build_engine,
    image_prompt,
    quantile,
    run_rounds,
    summarise,
    time_call,
    use_clock,
)

MOE_ARMS = ("full", "hard", "raincheck")


class ExpertCounter:
    """Per step: (decode rows, deferred rows, distinct experts routed to, mean over the MoE layers)."""

    def __init__(self, engine: Engine):
        self.steps: list[tuple[int, int, float]] = []
        self._layers: list[int] = []
        self._hooks = [block.gate.register_forward_hook(
            lambda _m, _i, logits, k=block.top_k: self._layers.append(int(route(logits, k)[0].unique().numel())))
            for block in engine.model.modules() if isinstance(block, SparseMoE)]
        self._remove = engine.on_step(self._stepped)

    def _stepped(self, stats: StepStats) -> None:
        if self._layers and not stats.failed:
            self.steps.append((stats.decode_rows, stats.deferred_rows + stats.recovery_rows,
                               statistics.fmean(self._layers)))
        self._layers = []

    def per_step(self, fused: bool, rows: int | None = None) -> float | None:
        """Mean distinct experts of the decode steps with (`fused`; `rows` of them, when given) or without
        deferred rows."""
        counts = [e for decode, deferred, e in self.steps
                  if decode and (deferred > 0) == fused and (rows is None or deferred == rows)]
        return statistics.fmean(counts) if counts else None

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._remove()


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--moe-family", default="qwen3_5_moe", choices=sorted(MOE_FAMILIES),
                    help="family of the MoE shape")
    ap.add_argument("--no-moe", action="store_true", help="skip the MoE shape")


def _shape(family: str) -> str:
    s = MOE_SHAPES["bench"]
    return f"{family} bench, {s['num_experts']} experts, top-{s['num_experts_per_tok']}"


def latency_section(args: argparse.Namespace, workdir: Path, arms: Sequence[Arm], clock: Callable[[], float]) -> dict:
    """`arms`: full, hard and raincheck as bench.latency configures them."""
    engine = build_engine(args.moe_family, workdir)
    use_clock(engine, clock, calibrate=True)
    prompt = image_prompt(engine, args.side)
    counter = ExpertCounter(engine)
    turns = run_rounds(engine, prompt, arms, args.repeats, args.max_new, f"{args.moe_family} MoE")
    counter.close()
    out = {name: summarise(ts) for name, ts in turns.items()}
    for name, summary in out.items():
        add_ratios(summary, turns[name], out["full"], turns["full"])
    return dict(shape=_shape(args.moe_family), num_experts=engine.model_config.num_experts,
                experts_per_decode_step=counter.per_step(False), experts_per_fused_step=counter.per_step(True),
                arms={name: {k: v for k, v in s.items() if k != "raw"} for name, s in out.items()})


def latency_table(res: dict) -> str:
    rows = ["| arm | TTFT ms | TPOT ms | TTFT / full | TPOT / full (paired) | chunk steps | D restored before end |",
            "|---|---|---|---|---|---|---|"]
    for name, s in res["arms"].items():
        restored = "-" if s["restored_before_end"] is None else f"{s['restored_before_end']:.0%}"
        rows.append(f"| {name} | {1e3 * s['ttft_s']:.1f} | {1e3 * s['tpot_s']:.2f} | {s['ttft_ratio']:.2f}x | "
                    f"{s['tpot_ratio']:.2f}x ({s['tpot_ratio_paired']:.2f}x) | {s['restoring_steps']} | {restored} |")
    fused = res["experts_per_fused_step"]
    return (f"MoE shape ({res['shape']}):\n\n" + "\n".join(rows) +
            f"\n\nexperts_per_decode_step {res['experts_per_decode_step']:.1f}, experts_per_fused_step "
            f"{'-' if fused is None else f'{fused:.1f}'} (of {res['num_experts']}; mean over MoE layers)")


def bucket_costs(families: Sequence[str], side: int, text: int, max_new: int, repeats: int, workdir: Path) -> dict:
    """family -> chunk size -> extra ms of a chunk-carrying decode step over the plain (guard) step
    (20th percentiles of each, one session, thread CPU time) and the distinct experts of its steps."""
    out: dict = {}
    for family in families:
        engine = build_engine(family, workdir)
        prompt = image_prompt(engine, side, text // 2)
        counter = ExpertCounter(engine)
        arms = [Arm(f"c{c}", DeferralConfig("raincheck", selector="uniform", retention=0.3, chunk_size=c, guard=16,
                                            tpot_slo=None)) for c in CHUNK_SIZES]
        turns = run_rounds(engine, prompt, arms, repeats, max_new, f"{family} chunk buckets")
        counter.close()
        rows = {}
        for c in CHUNK_SIZES:
            plain = quantile([g for t in turns[f"c{c}"] for g in t.plain_gaps()], STEP_QUANTILE)
            fused = quantile([g for t in turns[f"c{c}"] for g in t.restoring_gaps(c)], STEP_QUANTILE)
            rows[c] = dict(plain_ms=1e3 * plain, extra_ms=None if fused is None else 1e3 * (fused - plain),
                           experts=counter.per_step(True, c))
        out[family] = dict(buckets=rows, experts_per_decode_step=counter.per_step(False),
                           experts_per_fused_step=counter.per_step(True))
    return out


def bucket_table(res: dict) -> str:
    """Extra ms per bucket, with the distinct experts of those steps (MoE) in parentheses."""
    head = "| family | plain step ms (experts) | " + " | ".join(f"+{c} rows" for c in CHUNK_SIZES) + " |"
    rows = [head, "|---" * (len(CHUNK_SIZES) + 2) + "|"]

    def experts(n: float | None) -> str:
        return "" if n is None else f" ({n:.1f})"

    for family, r in res.items():
        b = r["buckets"]
        extra = " | ".join("-" if b[c]["extra_ms"] is None else f"+{b[c]['extra_ms']:.2f} ms{experts(b[c]['experts'])}"
                           for c in CHUNK_SIZES)
        rows.append(f"| {family} | {b[CHUNK_SIZES[0]]['plain_ms']:.2f}{experts(r['experts_per_decode_step'])} | "
                    f"{extra} |")
    return "\n".join(rows)


def op_bench(row_counts: Sequence[int], repeats: int = 7) -> list[dict]:
    """The loop expert op vs the `_grouped_mm` one (same routing, same sorted rows) at the bench MoE
    shape; per row count, seconds per call (best of `repeats`) and grouped_mm / loop speed."""
    s = MOE_SHAPES["bench"]
    e, k, inter = s["num_experts"], s["num_experts_per_tok"], s["moe_intermediate_size"]
    hidden = SIZES["bench"]["hidden"]
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(e, 2 * inter, hidden, generator=g) / 20, torch.randn(e, hidden, inter, generator=g) / 12
    out = []
    for rows in row_counts:
        x = torch.randn(rows, hidden, generator=g)
        experts, weights = route(torch.randn(rows, e, generator=g), k)
        ops = {"loop": grouped_experts}
        if grouped_mm_available("cpu"):
            ops["grouped_mm"] = grouped_mm_experts
        best = dict.fromkeys(ops, float("inf"))
        for _ in range(repeats):     # interleaved, thread CPU time: a busy neighbour moves both alike
            for name, op in ops.items():
                call = partial(op, x, experts, weights, gate_up, down)
                best[name] = min(best[name], time_call(call, 20, 1, clock=time.thread_time))
        row = dict(rows=rows, active=int(experts.unique().numel()), loop_ms=1e3 * best["loop"], grouped_mm_ms=None)
        if "grouped_mm" in best:
            row.update(grouped_mm_ms=1e3 * best["grouped_mm"], speed_vs_loop=best["loop"] / best["grouped_mm"])
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="the grouped expert op vs torch._grouped_mm (one thread)")
    ap.add_argument("--rows", default="1,8,16,32,64")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cmd = " ".join(["python -m bench.moe", *(argv if argv is not None else sys.argv[1:])])
    s = MOE_SHAPES["bench"]
    print(f"`{cmd}`: hidden {SIZES['bench']['hidden']}, {s['num_experts']} experts, top-{s['num_experts_per_tok']}, "
          f"expert width {s['moe_intermediate_size']}; one thread, thread CPU time, best of 7\n")
    print("| rows | active experts | loop ms | _grouped_mm ms | _grouped_mm speed |\n|---|---|---|---|---|")
    for r in op_bench([int(x) for x in args.rows.split(",")]):
        gm = "n/a" if r["grouped_mm_ms"] is None else f"{r['grouped_mm_ms']:.3f} | {r['speed_vs_loop']:.2f}x"
        print(f"| {r['rows']} | {r['active']} | {r['loop_ms']:.3f} | {gm} |")


if __name__ == "__main__":
    main()
