"""Load test: concurrent chat sessions against an in-process `raincheck serve`, over loopback only.

    python -m bench.load [--sessions 16] [--turns 3] [--max-new-tokens 32] [--size bench] [--model PATH]

A frontend and one decode worker (colocated recovery, in-process store) start on 127.0.0.1 ephemeral
ports; each session sends an image with its first turn and text after, through the client SDK. Prints
client-side TTFT / inter-token latency / E2E per turn index and the engine's deferral numbers, and
exits non-zero on any error. Bounded: at most 64 sessions x 10 turns, and a deadline for the whole run.
"""

from __future__ import annotations

import argparse
import io
import itertools
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from PIL import Image, ImageDraw

from raincheck_client import Client, Metrics, RaincheckError, Token
from services.common.settings import FrontendSettings, WorkerSettings
from services.common.store import MemoryStore
from services.decode_worker.server import DecodeWorkerServer
from services.frontend.server import FrontendServer

QUESTIONS = ["what is in this picture ?", "which one is on the left ?", "how many circles are there ?",
             "what color is the top one ?", "and the bottom one ?"]


@dataclass
class TurnResult:
    index: int
    ttft_s: float
    gaps_s: list[float]
    e2e_s: float
    metrics: Metrics


@dataclass
class SessionResult:
    turns: list[TurnResult] = field(default_factory=list)
    error: str | None = None


def scene(seed: int, size: int) -> bytes:
    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    colours = ["red", "green", "blue", "orange", "purple"]
    for i in range(3 + seed % 3):
        x, y = (37 * (seed + i)) % (size - 60), (53 * (seed + 2 * i)) % (size - 60)
        draw.ellipse([x, y, x + 50, y + 50], fill=colours[(seed + i) % len(colours)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def run_session(address: str, seed: int, turns: int, max_new_tokens: int, image_size: int, policy: str
                ) -> SessionResult:
    result = SessionResult()
    try:
        with Client(address) as client:
            session = client.create_session(policy=policy)
            for t in range(turns):
                images = [scene(seed, image_size)] if t == 0 else []
                t0 = time.perf_counter()
                stamps = []
                turn = session.send(QUESTIONS[t % len(QUESTIONS)], images=images, max_new_tokens=max_new_tokens,
                                    ignore_eos=True)
                for event in turn:
                    if isinstance(event, Token):
                        stamps.append(time.perf_counter())
                end = time.perf_counter()
                gaps = [b - a for a, b in itertools.pairwise(stamps)]
                result.turns.append(TurnResult(t, stamps[0] - t0, gaps, end - t0, turn.metrics))
            session.close()
    except RaincheckError as e:
        result.error = str(e)
    return result


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def report(results: list[SessionResult], turns: int, wall_s: float) -> None:
    done = [t for r in results for t in r.turns]
    errors = [r.error for r in results if r.error]
    tokens = sum(t.metrics.generated_tokens for t in done)
    print(f"\n{len(results)} sessions x {turns} turns: {len(done)} turns completed, {len(errors)} errors, "
          f"{wall_s:.1f} s wall, {tokens / wall_s:.1f} generated tokens/s")
    print("\n| turn | TTFT p50 / p95 (ms) | ITL p50 / p95 (ms) | E2E p50 / p95 (ms) | deferred tokens (mean) "
          "| pending at answer end (mean) | barrier wait max (ms) |")
    print("|---|---|---|---|---|---|---|")
    for i in range(turns):
        ts = [t for t in done if t.index == i]
        if not ts:
            continue
        ttft, e2e = [t.ttft_s for t in ts], [t.e2e_s for t in ts]
        gaps = [g for t in ts for g in t.gaps_s]
        print(f"| {i + 1} | {1e3 * _pct(ttft, 50):.0f} / {1e3 * _pct(ttft, 95):.0f} "
              f"| {1e3 * _pct(gaps, 50):.1f} / {1e3 * _pct(gaps, 95):.1f} "
              f"| {1e3 * _pct(e2e, 50):.0f} / {1e3 * _pct(e2e, 95):.0f} "
              f"| {statistics.mean(t.metrics.deferred_tokens for t in ts):.0f} "
              f"| {statistics.mean(t.metrics.deferred_pending for t in ts):.0f} "
              f"| {1e3 * max(t.metrics.barrier_wait_s for t in ts):.0f} |")
    for error in errors[:5]:
        print(f"error: {error}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--policy", default="raincheck")
    p.add_argument("--model", default=None, help="checkpoint folder (default: a random model of --size)")
    p.add_argument("--size", choices=["tiny", "bench"], default="bench")
    p.add_argument("--deadline-s", type=float, default=600.0)
    args = p.parse_args(argv)
    if not (1 <= args.sessions <= 64 and 1 <= args.turns <= 10):
        p.error("bounded: 1-64 sessions, 1-10 turns")

    store = MemoryStore()
    worker = DecodeWorkerServer(WorkerSettings(model=args.model, random_size=args.size, port=0, metrics_port=None,
                                               threads=args.sessions + 8), store).start()
    frontend = FrontendServer(FrontendSettings(port=0, metrics_port=None, threads=args.sessions + 8), store).start()
    print(f"serving {worker.model} at {frontend.address}; {args.sessions} sessions x {args.turns} turns, "
          f"{args.max_new_tokens} tokens per answer, policy {args.policy}", flush=True)
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.sessions) as pool:
            futures = [pool.submit(run_session, frontend.address, s, args.turns, args.max_new_tokens,
                                   args.image_size, args.policy) for s in range(args.sessions)]
            finished, late = wait(futures, timeout=args.deadline_s)
            if late:
                frontend.stop(0)     # ends the stragglers' streams
        results = [f.result() for f in finished] + [SessionResult(error="deadline passed") for _ in late]
        report(results, args.turns, time.perf_counter() - t0)
    finally:
        frontend.stop(0)
        worker.stop(0)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
