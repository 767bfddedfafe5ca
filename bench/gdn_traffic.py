"""GDN state traffic of a decode step: bytes of state moved against the bytes that must move (each
sequence's state read once and written once), on the CPU.

    python -m bench.gdn_traffic [--sessions 1,16] [--context 256] [--steps 8] [--backends native,torch]
                                [--json PATH]

B sessions of the `bench` qwen3_5 checkpoint (random weights) each decode over its own context, by each
backend: `native` (the CPU kernels: states read and written in the pool by row, the update flips),
`torch` (states gathered out of the pool and the new ones placed back, as fla 0.6's kernels need them)
and, where triton imports (a GPU, or `TRITON_INTERPRET=1` with the accel extra), `fla` (its decode rows
through ops/gdn_triton.py on the pool's rows; the conv histories still copied). Per decode step:
required and moved bytes by construction (ops/gdn_traffic.py, from the step's layouts), and, measured at
torch's dispatcher while the step runs (`StateCopies`), the bytes torch ops copy into or out of the pool
and the bytes of state-shaped tensors they allocate; then the median time of as many steps run without
the measurement. Native's and torch's ratios do not depend on the model's shape (at Qwen3.5-9B's a
sequence's state is ~48 MiB instead of this model's); fla's does, through the conv histories' share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.engine.hooks import StepStats
from raincheck_core.models.random_init import save_random_checkpoint
from raincheck_core.ops.gdn_traffic import StateCopies

from .common import setup_torch

MIB = 1 << 20


def run(folder: Path, backend: str, sessions: int, context: int, steps: int) -> dict:
    engine = Engine.from_pretrained(folder, backend=backend, max_rows_per_step=max(4096, sessions * context),
                                    prefix_cache=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(sessions):
        ids = torch.randint(16, 2000, (context,), generator=gen).tolist()
        engine.open_session().turn(Prompt(ids), SamplingParams(max_new_tokens=2 * steps + 8, ignore_eos=True))
    stats: list[StepStats] = []
    remove = engine.on_step(stats.append)
    while not stats or stats[-1].decode_rows < sessions or stats[-1].prefill_rows:
        engine.step()
    measured, times = [], []
    for _ in range(steps):
        if backend == "fla":    # FlexAttention compiles its kernel, which no dispatcher mode may watch
            engine.step()
            measured.append((stats[-1].gdn_traffic, None, None))
            continue
        with StateCopies(engine.gdn) as copies:
            engine.step()
        measured.append((stats[-1].gdn_traffic, copies.copied, copies.allocated))
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    remove()
    traffic, copied, allocated = measured[-1]
    return {
        "backend": backend, "sessions": sessions, "context": context,
        "state_mib_per_session": engine.gdn.slot_bytes / MIB,
        "required_mib": traffic.required / MIB, "moved_mib": traffic.moved / MIB, "ratio": traffic.ratio,
        "copied_mib_constructed": traffic.copied / MIB,
        "copied_mib_measured": None if copied is None else copied / MIB,
        "allocated_mib_measured": None if allocated is None else allocated / MIB,
        "agree": all(m[1] in (None, m[0].copied) for m in measured), "step_ms": 1e3 * statistics.median(times),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default="1,16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backends", default="native,torch")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    setup_torch(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_random_checkpoint(Path(tmp) / "qwen3_5", "qwen3_5", "bench")
        rows = [run(folder, backend, int(b), args.context, args.steps)
                for b in args.sessions.split(",") for backend in args.backends.split(",")]
    print(f"\nGDN state per decode step, `bench` qwen3_5, {args.context}-token contexts, {args.threads} thread(s)")
    print("| backend | B | must move (MiB) | moved (MiB) | moved / must | copied into/out of the pool: "
          "constructed / measured (MiB) | state allocated (MiB) | step (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    def mib(x: float | None) -> str:
        return "–" if x is None else f"{x:.2f}"

    for r in rows:
        print(f"| {r['backend']} | {r['sessions']} | {r['required_mib']:.2f} | {r['moved_mib']:.2f} | "
              f"{r['ratio']:.2f} | {mib(r['copied_mib_constructed'])} / {mib(r['copied_mib_measured'])}"
              f"{'' if r['agree'] else ' (differ)'} | {mib(r['allocated_mib_measured'])} | {r['step_ms']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
