"""Memory soak: does the embedded server's RSS level off while sessions come and go?

    python -m bench.soak --quick --json bench/out/soak.json     # 200 sessions
    python -m bench.soak --sessions 1000                          # the full run (docs/BENCHMARKS.md)

One process holds what `raincheck serve` holds (a frontend and a decode worker on the in-process store,
gRPC over loopback) and a client. N sessions, `--concurrency` at a time, each two image turns (the
raincheck policy, so post-answer recovery runs too) and then closed, in `--rounds` rounds; every
`--long-every`-th session asks with a long text prompt as well. Images vary in size among a few shapes.
The RSS after each round is a table row and a point of the PNG; `rss_growth_after_warmup` =
(RSS at the end - RSS after the first fifth of the rounds) / RSS after the first fifth, and
`rss_growth_after_warmup_less_encoder_cache` the same less what the encoder cache took meanwhile (images
by content, up to its budget: every session here sends new ones). The first fifth is
the warm-up: it meets every image size and prompt kind the later rounds use, so per-shape state (allocator
pools, kernel buffers) is built there.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image, ImageDraw

from raincheck_client import Client
from services.common import native_heap
from services.common.settings import FrontendSettings, WorkerSettings
from services.common.store import MemoryStore
from services.decode_worker.server import DecodeWorkerServer
from services.frontend.server import FrontendServer

SIZES = ((96, 64), (128, 128), (160, 96), (64, 192))
COLORS = ("red", "green", "blue", "yellow", "purple")
LONG_WORDS = (1100, 1300, 1500, 1700)     # the long prompts' lengths in words, cycled


def rss_mib() -> float:
    """RSS after handing freed heap tops back (what the worker's heartbeat does every few seconds), so a
    reading does not depend on where the heartbeat was."""
    native_heap.trim()
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def scene(rng: random.Random, width: int, height: int) -> bytes:
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    for _ in range(3):
        x, y = rng.randrange(width - 16), rng.randrange(height - 16)
        draw.rectangle([x, y, x + 16, y + 16], fill=rng.choice(COLORS))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def long_question(variant: int) -> str:
    rng = random.Random(variant)
    return " ".join(rng.choice(("the", "box", "is", "red", "blue", "left")) for _ in range(LONG_WORDS[variant]))


def one_session(client: Client, index: int, long_every: int, max_new: int) -> int:
    """Two image turns, then close; returns the characters answered."""
    rng = random.Random(index)
    session = client.create_session(policy="raincheck", retention=0.3)
    try:
        size = SIZES[index % len(SIZES)]
        question = "what color is the box ?"
        if long_every and index % long_every == 0:
            question = long_question(index // long_every % len(LONG_WORDS))
        first = session.send(question, images=[scene(rng, *size)], max_new_tokens=max_new,
                             follow_recovery=True).text()
        second = session.send("and the other one ?", images=[scene(rng, *SIZES[(index + 1) % len(SIZES)])],
                              max_new_tokens=max_new).text()
        return len(first) + len(second)
    finally:
        session.close()


def run(sessions: int, rounds: int, concurrency: int, long_every: int, max_new: int, model: str) -> dict:
    native_heap.bound()       # what `raincheck serve` does first
    store = MemoryStore()
    worker = DecodeWorkerServer(WorkerSettings(model=model, port=0, metrics_port=None), store).start()
    frontend = FrontendServer(FrontendSettings(port=0, metrics_port=None), store).start()
    per_round = max(1, sessions // rounds)
    table = []
    try:
        with Client(frontend.address) as client, ThreadPoolExecutor(concurrency) as pool:
            start = rss_mib()
            for r in range(rounds):
                t0 = time.perf_counter()
                ids = range(r * per_round, (r + 1) * per_round)
                list(pool.map(lambda i: one_session(client, i, long_every, max_new), ids))
                encoder = worker.runtime.engine.encoder_cache_stats()
                table.append({"round": r + 1, "sessions": (r + 1) * per_round, "rss_mib": round(rss_mib(), 1),
                              "seconds": round(time.perf_counter() - t0, 1),
                              "store_blob_mib": round(store.blob_bytes / 2**20, 1),
                              "encoder_cache_mib": round(encoder.bytes / 2**20, 2) if encoder else 0.0})
                print(f"round {r + 1:3d}  sessions {(r + 1) * per_round:5d}  RSS {table[-1]['rss_mib']:7.1f} MiB  "
                      f"encoder cache {table[-1]['encoder_cache_mib']:6.2f} MiB  ({table[-1]['seconds']:.1f}s)",
                      flush=True)
    finally:
        frontend.stop(0)
        worker.stop(0)
    warm_row, end_row = table[max(0, rounds // 5 - 1)], table[-1]
    warm, end = warm_row["rss_mib"], end_row["rss_mib"]
    cached = end_row["encoder_cache_mib"] - warm_row["encoder_cache_mib"]
    return {"sessions": per_round * rounds, "rounds": table, "rss_start_mib": round(start, 1),
            "rss_after_warmup_mib": warm, "rss_end_mib": end,
            "rss_growth_after_warmup": round((end - warm) / warm, 4),
            # the same without what the encoder cache took meanwhile (bounded by --encoder-cache-mib)
            "rss_growth_after_warmup_less_encoder_cache": round((end - cached - warm) / warm, 4)}


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rounds"]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot([r["sessions"] for r in rows], [r["rss_mib"] for r in rows], "o-", ms=3, label="RSS")
    ax.plot([r["sessions"] for r in rows], [r["rss_mib"] - r["encoder_cache_mib"] for r in rows], ".-", ms=3,
            lw=0.8, label="RSS less the encoder cache's bytes")
    ax.axhline(result["rss_after_warmup_mib"], color="gray", ls="--", lw=0.8, label="after the first fifth")
    ax.set_xlabel("sessions closed (2 image turns each)")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(f"bench.soak: growth after warm-up {result['rss_growth_after_warmup']:+.1%}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="200 sessions in 10 rounds")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--long-every", type=int, default=10, help="every Nth session asks with a long prompt")
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, default=Path("bench/out/soak.png"))
    args = ap.parse_args(argv)
    sessions, rounds = (200, 10) if args.quick else (args.sessions, args.rounds)
    result = run(sessions, rounds, args.concurrency, args.long_every, args.max_new, args.model)
    result["plot"] = str(plot(result, args.plot))
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
