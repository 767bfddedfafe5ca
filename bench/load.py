"""Load test: concurrent chat sessions against an in-process `raincheck serve`, over loopback only.

    python -m bench.load [--sessions 16] [--turns 3] [--max-new-tokens 32] [--size bench] [--model PATH] [--http]

A frontend and one decode worker (colocated recovery, in-process store) start on 127.0.0.1 ephemeral
ports; each session sends an image with its first turn and text after, through the client SDK, or with
`--http` through the official openai client against the HTTP frontend (each request resends the whole
conversation, streamed; the server matches it to the session). Prints client-side TTFT / inter-token
latency / E2E per turn index and the engine's deferral numbers (with `--http` also the share of prompt
tokens served from sessions), what the prefix and encoder caches hold against their budgets
(`--prefix-cache-pages`, `--encoder-cache-mib`: small ones make them evict), and exits non-zero on any
error or a cache over its budget. Bounded: at most 64 sessions x 10 turns, and a deadline for the whole run.
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from PIL import Image, ImageDraw

from raincheck_client import Client, RaincheckError, Token
from raincheck_core import Engine
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
    generated_tokens: int
    deferred_tokens: int
    deferred_pending: int
    barrier_wait_s: float
    prompt_tokens: int = 0                 # the whole conversation's (HTTP: usage.prompt_tokens)
    cached_tokens: int = 0                 # of those, served from the session (usage...cached_tokens)
    match: str = ""                        # HTTP: how the request matched a session


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
                m = turn.metrics
                result.turns.append(TurnResult(t, stamps[0] - t0, gaps, end - t0, m.generated_tokens,
                                               m.deferred_tokens, m.deferred_pending, m.barrier_wait_s))
            session.close()
    except RaincheckError as e:
        result.error = str(e)
    return result


def run_http_session(url: str, model: str, seed: int, turns: int, max_new_tokens: int, image_size: int,
                     policy: str) -> SessionResult:
    """One conversation through the openai client, as a chat app sends it: the whole history each turn."""
    import openai

    result = SessionResult()
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    image = "data:image/png;base64," + base64.b64encode(scene(seed, image_size)).decode()
    messages: list[dict] = []
    try:
        for t in range(turns):
            question = QUESTIONS[t % len(QUESTIONS)]
            messages.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                         {"type": "text", "text": question}] if t == 0 else question})
            t0 = time.perf_counter()
            stamps, text, usage, details = [], [], None, None
            for chunk in client.chat.completions.create(
                    model=model, messages=messages, max_tokens=max_new_tokens, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "policy": policy}):
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(time.perf_counter())
                    text.append(chunk.choices[0].delta.content)
                if chunk.choices and chunk.choices[0].finish_reason:
                    details = chunk.model_extra["raincheck"]
                if chunk.usage is not None:
                    usage = chunk.usage
            end = time.perf_counter()
            messages.append({"role": "assistant", "content": "".join(text)})
            result.turns.append(TurnResult(
                t, stamps[0] - t0, [b - a for a, b in itertools.pairwise(stamps)], end - t0, usage.completion_tokens,
                details["deferred_tokens"], details["deferred_pending"], details["barrier_wait_s"],
                usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, details["match"]))
    except (openai.OpenAIError, IndexError, TypeError) as e:   # an error event, or a stream without an answer
        result.error = f"{type(e).__name__}: {e}"
    finally:
        client.close()
    return result


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def report(results: list[SessionResult], turns: int, wall_s: float) -> None:
    done = [t for r in results for t in r.turns]
    errors = [r.error for r in results if r.error]
    tokens = sum(t.generated_tokens for t in done)
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
              f"| {statistics.mean(t.deferred_tokens for t in ts):.0f} "
              f"| {statistics.mean(t.deferred_pending for t in ts):.0f} "
              f"| {1e3 * max(t.barrier_wait_s for t in ts):.0f} |")
    prompt = sum(t.prompt_tokens for t in done)
    if prompt:
        cached = sum(t.cached_tokens for t in done)
        matches = {m: sum(t.match == m for t in done) for m in ("new", "continued", "forked")}
        print(f"\nprompt tokens served from sessions: {cached} of {prompt} ({100 * cached / prompt:.1f}%); "
              f"requests: {', '.join(f'{n} {m}' for m, n in matches.items())}")
        for i in range(1, turns):
            ts = [t for t in done if t.index == i]
            if ts:
                share = sum(t.cached_tokens for t in ts) / max(1, sum(t.prompt_tokens for t in ts))
                print(f"  turn {i + 1}: {100 * share:.1f}% of its prompt tokens from the session")
    for error in errors[:5]:
        print(f"error: {error}")


def cache_budgets(engine: Engine) -> list[str]:
    """Print what the caches hold against their budgets; one line per cache over its budget."""
    cfg, over = engine.config, []
    prefix, pool, encoder = engine.prefix_stats(), engine.pool_stats(), engine.encoder_cache_stats()
    if prefix is not None:
        pages = cfg.prefix_cache_pages or cfg.num_pages // 2
        print(f"prefix cache: {prefix.hits} hits of {prefix.lookups} lookups, {prefix.hit_tokens} prompt tokens "
              f"served; holds {pool.cached_pages} pages (budget {pages}), {prefix.checkpoints} GDN checkpoints "
              f"of {prefix.checkpoint_bytes / 2**20:.1f} MiB (slab {prefix.checkpoint_slab_bytes / 2**20:.1f})")
        over += [f"prefix cache holds {pool.cached_pages} pages > {pages}"] if pool.cached_pages > pages else []
        budget = cfg.gdn_checkpoint_bytes
        if budget is not None and prefix.checkpoint_slab_bytes > budget:
            over.append(f"the GDN checkpoints' slab takes {prefix.checkpoint_slab_bytes} bytes > {budget}")
    if encoder is not None:
        print(f"encoder cache: {encoder.hits} hits, {encoder.misses} tower runs; holds {encoder.entries} entries "
              f"of {encoder.bytes / 2**20:.2f} MiB (budget {cfg.encoder_cache_bytes / 2**20:.2f})")
        if encoder.bytes > cfg.encoder_cache_bytes:
            over.append(f"encoder cache holds {encoder.bytes} bytes > {cfg.encoder_cache_bytes}")
    for line in over:
        print(f"over budget: {line}")
    return over


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
    p.add_argument("--prefix-cache-pages", type=int, default=None, help="the worker's prefix cache budget")
    p.add_argument("--encoder-cache-mib", type=float, default=None, help="the worker's encoder cache budget")
    p.add_argument("--http", action="store_true",
                   help="through the openai client and the HTTP frontend (OpenAI chat completions, streamed)")
    args = p.parse_args(argv)
    if not (1 <= args.sessions <= 64 and 1 <= args.turns <= 10):
        p.error("bounded: 1-64 sessions, 1-10 turns")

    store = MemoryStore()
    worker = DecodeWorkerServer(WorkerSettings(model=args.model, random_size=args.size, port=0, metrics_port=None,
                                               threads=args.sessions + 8, prefix_cache_pages=args.prefix_cache_pages,
                                               encoder_cache_mib=args.encoder_cache_mib), store).start()
    front_settings = FrontendSettings(port=0, metrics_port=None, threads=args.sessions + 8)
    frontend = FrontendServer(front_settings, store).start()
    http = None
    if args.http:
        from services.http.server import HttpServer
        from services.http.settings import HttpSettings

        http = HttpServer(HttpSettings(port=0, threads=args.sessions + 8), front_settings, store,
                          frontend.router).start()
    print(f"serving {worker.model} at {http.url if http else frontend.address}; {args.sessions} sessions x "
          f"{args.turns} turns, {args.max_new_tokens} tokens per answer, policy {args.policy}"
          + (", openai client over HTTP" if http else ", client SDK over gRPC"), flush=True)
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.sessions) as pool:
            if http:
                futures = [pool.submit(run_http_session, http.url, worker.model, s, args.turns, args.max_new_tokens,
                                       args.image_size, args.policy) for s in range(args.sessions)]
            else:
                futures = [pool.submit(run_session, frontend.address, s, args.turns, args.max_new_tokens,
                                       args.image_size, args.policy) for s in range(args.sessions)]
            finished, late = wait(futures, timeout=args.deadline_s)
            if late:         # end the stragglers' streams
                (http or frontend).stop(0)
        results = [f.result() for f in finished] + [SessionResult(error="deadline passed") for _ in late]
        report(results, args.turns, time.perf_counter() - t0)
        over = cache_budgets(worker.runtime.engine)
    finally:
        if http:
            http.stop(0)
        frontend.stop(0)
        worker.stop(0)
    return 1 if any(r.error for r in results) or over else 0


if __name__ == "__main__":
    sys.exit(main())
