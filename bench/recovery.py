"""Disaggregated recovery by mode: bytes shipped, recovery latency, barrier wait, decode TPOT, fallbacks.

    python -m bench.recovery [--quick] [--sessions 6] [--json PATH] [--img-dir DIR] [--model demo|bench|PATH]

One process on loopback: a local Ray of its own with 2 named deferred workers (`raincheck
deferred-worker`'s keeper) and, per mode, a decode worker and a frontend (in-process; the SDK over
loopback), all on the demo model (or `--model`: `bench` is the random bench-size checkpoint, heavier
per token), policy `post_answer` (no fused chunks, so every mode
restores the same rows the same way and must give the same answers):

- `colocated`: the decode worker recovers in its own gaps;
- `disaggregated`: each recovery ships the whole visible context at the answer's end (today's mode;
  `--deferred-resident-mib 0`);
- `resident`: the session's deferred worker keeps its context; a recovery ships what it lacks;
- `in_flight`: resident, and shipped as soon as the turn's input is prefilled (`--deferred-ship input_done`).

Two workloads, 6 turns per session, 24-token answers (greedy, no stop):
- *chat*: `--sessions` sessions at once, an image on turns 1 and 4 (the demo model's scenes and
  questions), at think times 0, 0.3 and 1 s between a session's turns: the barrier wait of turns 2 and
  5, the recovery latency (answer end to joined, from the next turn's metrics), the decode TPOT of turns
  that ran while other sessions' recoveries were pending (the reason to disaggregate: the decode worker
  stops paying for them), fallbacks, lost recoveries, and the answers;
- *growth*: 2 sessions (one per deferred worker), an image on every turn, 1 s think time: bytes shipped
  out and back by each turn's recovery, where the context grows by a turn at a time
  (`bytes_out_turn6_ratio`: resident over whole-context shipment at turn 6).

`--json PATH` writes everything, with the keys `bytes_out_turn6_ratio`, `answers_identical` (every mode
gave the same answers), `lost` (recoveries never joined) and `fallbacks` (recoveries a deferred worker
did not finish plus resident-context misses). `--quick`: 3 chat sessions (a few minutes).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import REGISTRY

from raincheck_client import Client, Metrics
from raincheck_demo.world import make_dialogue
from services.common.settings import DeferredSettings, FrontendSettings, ModelSpec, WorkerSettings
from services.common.store import MemoryStore
from services.decode_worker.disaggregated_recovery import RecoveryReport
from services.decode_worker.server import DecodeWorkerServer
from services.frontend.server import FrontendServer

ROOT = Path(__file__).resolve().parents[1]
MODES = {"colocated": None, "disaggregated": dict(resident_mib=0), "resident": {},
         "in_flight": dict(ship="input_done")}
THINK_S = (0.0, 0.3, 1.0)
TURNS = 6
ANSWER = dict(max_new_tokens=24, ignore_eos=True)
POLICY = dict(policy="post_answer", retention=0.3)
FALLBACK_REASONS = ("timeout", "worker_died", "ray_lost", "error")
MISS_REASONS = ("none", "stale", "gone", "busy")
SEED = 1234
GROWTH_SESSIONS = 2                     # as many as deferred workers
# Every engine (the decode workers' here, each deferred worker's) on one torch thread: they share the
# machine's cores, and more threads than cores slow everyone down.
ONE_THREAD = {"num_threads": 1}


@dataclass
class Turn:
    session: int
    index: int                          # 1-based
    think_s: float
    tokens: list[int]
    tpot_s: float
    barrier_wait_s: float
    previous_recovery_s: float | None
    during_recoveries: bool             # other sessions' recoveries were pending while it decoded


@dataclass
class Run:
    mode: str
    workload: str
    think_s: float
    turns: list[Turn] = field(default_factory=list)
    reports: list[RecoveryReport] = field(default_factory=list)
    lost: int = 0
    failed: int = 0                     # recoveries a deferred worker did not finish (finished locally)
    misses: int = 0                     # resident-context misses (shipped in full after all)
    local_first: int = 0                # recovered locally before the result came (a barrier, its race)
    seconds: float = 0.0


class _Counter(logging.Handler):
    """Counts the decode workers' "recovered locally first" lines."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "recovered locally first" in record.getMessage()


class Recovering:
    """Samples which sessions of a worker are recovering after their answer, every 10 ms."""

    def __init__(self, worker: DecodeWorkerServer):
        self.worker = worker
        self.samples: list[tuple[float, frozenset[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            sessions = list(self.worker.runtime.sessions.values())
            busy = frozenset(ws.id for ws in sessions if ws.session.status().recovering)
            self.samples.append((time.perf_counter(), busy))

    def others(self, session: str, t0: float, t1: float) -> bool:
        return any(t0 <= t <= t1 and busy - {session} for t, busy in self.samples)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _plan(rng: random.Random, workload: str) -> list[tuple[str, bytes | None]]:
    """(question, image or None) per turn: demo scenes and their questions."""
    if workload == "chat":
        a, b = make_dialogue(rng, turns=3), make_dialogue(rng, turns=3)
        return [(d.questions[t].text, d.scene.png() if t == 0 else None) for d in (a, b) for t in range(3)]
    return [(d.questions[0].text, d.scene.png()) for d in (make_dialogue(rng, turns=1) for _ in range(TURNS))]


class Deployment:
    """Per mode, a decode worker and a frontend on stores of their own; a local Ray with the keeper's actors."""

    def __init__(self, model: str | None):
        import ray

        from services.common.model_loading import model_name
        from services.common.random_model import save_random_model
        from services.deferred_worker.actor import registered
        from services.deferred_worker.keeper import Keeper

        os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0",
                          PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        ray.init(address="local", num_cpus=2, include_dashboard=False, resources={"raincheck_deferred": 4},
                 log_to_driver=False)
        address = ray.get_runtime_context().gcs_address
        namespace = f"raincheck-bench-{uuid.uuid4().hex[:8]}"
        self.folder = None
        if model == "bench":        # the random bench-size checkpoint, written once for every process to load
            self.folder = tempfile.TemporaryDirectory(prefix="raincheck-bench-")
            model = str(save_random_model(self.folder.name, "bench"))
        settings = DeferredSettings(namespace=namespace, workers=2, num_cpus=0)
        self.keeper = Keeper(settings, ModelSpec(model, engine=ONE_THREAD)).start()
        ray.get([actor.ready.remote() for actor in registered(settings, model_name(ModelSpec(model))).values()])
        self.servers, self.clients = {}, {}
        for mode, deferred in MODES.items():
            store = MemoryStore()
            modes = ("colocated",) if deferred is None else ("colocated", "disaggregated")
            extra = {} if deferred is None else {
                "deferred": DeferredSettings(ray_address=address, namespace=namespace, num_cpus=0, **deferred)}
            settings = WorkerSettings(model=model, port=0, metrics_port=None, recovery_modes=modes, engine=ONE_THREAD,
                                      **extra)
            worker = DecodeWorkerServer(settings, store).start()
            frontend = FrontendServer(FrontendSettings(port=0, metrics_port=None), store).start()
            self.servers[mode] = (worker, frontend)
            self.clients[mode] = Client(frontend.address)

    def stop(self) -> None:
        import ray

        for client in self.clients.values():
            client.close()
        for worker, frontend in self.servers.values():
            frontend.stop(0)
            worker.stop(0)
        self.keeper.stop()
        ray.shutdown()
        if self.folder is not None:
            self.folder.cleanup()


def run(deployment: Deployment, mode: str, workload: str, think_s: float, sessions: int, counter: _Counter) -> Run:
    worker, _ = deployment.servers[mode]
    client = deployment.clients[mode]
    result = Run(mode, workload, think_s)
    backend = worker.runtime.backends.get("disaggregated")
    if backend is not None:
        backend.on_report = result.reports.append
    failed = sum(_metric("raincheck:deferred_fallbacks_total", reason=r) for r in FALLBACK_REASONS)
    misses = sum(_metric("raincheck:deferred_resident_misses_total", reason=r) for r in MISS_REASONS)
    local_first = counter.count
    sampler = Recovering(worker)
    recovery = "colocated" if mode == "colocated" else "disaggregated"
    t0 = time.perf_counter()

    def converse(i: int) -> list[Turn]:
        plan = _plan(random.Random(SEED + i), workload)
        session = client.create_session(recovery=recovery, **POLICY)
        turns = []
        for t, (text, image) in enumerate(plan):
            if t:
                time.sleep(think_s)
            stream = session.send(text, images=[image] if image else [], follow_recovery=t == len(plan) - 1,
                                  **ANSWER)
            first = metrics = None
            for event in stream:
                first = first or time.perf_counter()
                if isinstance(event, Metrics):
                    metrics, end = event, time.perf_counter()
            turns.append(Turn(i, t + 1, think_s, list(stream.final.token_ids), metrics.tpot_s,
                              metrics.barrier_wait_s, metrics.previous_recovery_s,
                              sampler.others(session.id, first, end)))
        deadline = time.monotonic() + 60
        while session.status().pending_deferred_tokens and time.monotonic() < deadline:
            time.sleep(0.05)
        result.lost += session.status().pending_deferred_tokens > 0
        session.close()
        return turns

    threads, outputs = [], [None] * sessions

    def work(i: int) -> None:
        outputs[i] = converse(i)

    for i in range(sessions):
        threads.append(threading.Thread(target=work, args=(i,)))
        threads[-1].start()
    for thread in threads:
        thread.join()
    sampler.stop()
    result.turns = [t for out in outputs for t in out]
    result.seconds = time.perf_counter() - t0
    result.failed = int(sum(_metric("raincheck:deferred_fallbacks_total", reason=r) for r in FALLBACK_REASONS)
                        - failed)
    result.misses = int(sum(_metric("raincheck:deferred_resident_misses_total", reason=r) for r in MISS_REASONS)
                        - misses)
    result.local_first = counter.count - local_first
    return result


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(runs: list[Run], sessions: int) -> dict:
    """The numbers of the report, by mode."""
    out: dict = {"chat": defaultdict(dict), "growth": defaultdict(dict)}
    for r in runs:
        if r.workload == "chat":
            entry = out["chat"][r.mode].setdefault(str(r.think_s), {})
            entry["barrier_wait_s"] = {t: _mean([x.barrier_wait_s for x in r.turns if x.index == t])
                                       for t in (2, 5)}
            entry["recovery_s"] = {t - 1: _mean([x.previous_recovery_s for x in r.turns
                                                 if x.index == t and x.previous_recovery_s is not None])
                                   for t in (2, 5)}
            during = [x.tpot_s for x in r.turns if x.during_recoveries and x.index > 1]
            entry["tpot_during_recoveries_s"] = _mean(during)
            entry["turns_during_recoveries"] = len(during)
            entry["tpot_s"] = _mean([x.tpot_s for x in r.turns if x.index > 1])
            entry.update(lost=r.lost, failed=r.failed, misses=r.misses, local_first=r.local_first,
                         remote=len(r.reports), compute_s=_mean([x.compute_s for x in r.reports]),
                         queue_s=_mean([x.wait_s for x in r.reports]), seconds=round(r.seconds, 1))
        per_turn = defaultdict(list)
        for rep in r.reports:
            per_turn[rep.ticket + 1].append(rep)
        out[r.workload][r.mode].setdefault("bytes", {})[str(r.think_s)] = {
            t: {"out": _mean([x.bytes_out for x in reps]), "back": _mean([x.bytes_back for x in reps]),
                "resident": sum(x.resident for x in reps), "n": len(reps),
                "context_rows": _mean([x.context for x in reps]),
                "shipped_rows": _mean([x.context_shipped for x in reps])}
            for t, reps in sorted(per_turn.items())}
    answers = defaultdict(dict)
    for r in runs:
        for t in r.turns:
            answers[(r.workload, r.think_s, t.session, t.index)][r.mode] = t.tokens
    identical = all(len({tuple(v) for v in modes.values()}) == 1 for modes in answers.values())
    growth = out["growth"]
    turn6 = {m: growth[m]["bytes"]["1.0"].get(6, {}).get("out") for m in ("disaggregated", "resident")}
    ratio = turn6["resident"] / turn6["disaggregated"] if all(turn6.values()) else None
    out.update(bytes_out_turn6_ratio=ratio, answers_identical=identical, sessions=sessions,
               lost=sum(r.lost for r in runs), fallbacks=sum(r.failed + r.misses for r in runs),
               local_first=sum(r.local_first for r in runs))
    return json.loads(json.dumps(out))


def print_report(s: dict) -> None:
    print(f"\n{s['sessions']} sessions x {TURNS} turns, policy post_answer; answers identical in every mode: "
          f"{s['answers_identical']}; recoveries lost: {s['lost']}; fallbacks: {s['fallbacks']} "
          f"(recovered locally first: {s['local_first']})")
    print("\ngrowth (an image every turn): bytes shipped out / back by each turn's recovery")
    modes = [m for m in MODES if m != "colocated"]
    print(f"{'turn':>4} " + " ".join(f"{m:>24}" for m in modes))
    for t in range(1, TURNS + 1):
        cells = []
        for m in modes:
            b = s["growth"][m]["bytes"]["1.0"].get(str(t))
            cells.append(f"{b['out'] / 1024:9.1f} / {b['back'] / 1024:6.1f} KiB" if b else f"{'-':>24}")
        print(f"{t:>4} " + " ".join(f"{c:>24}" for c in cells))
    print(f"turn 6, resident / whole context: {s['bytes_out_turn6_ratio']:.3f}" if s["bytes_out_turn6_ratio"]
          else "turn 6: no ratio")
    print("\nchat (images on turns 1 and 4): barrier wait of turns 2 / 5 (ms), recovery latency of turns 1 / 4 "
          "(ms), decode TPOT of turns during other sessions' recoveries (ms, turns)")
    for think in THINK_S:
        print(f"think {think:g} s")
        for m in MODES:
            e = s["chat"][m].get(str(think))
            if not e:
                continue
            bw, rl = e["barrier_wait_s"], e["recovery_s"]
            tpot = e["tpot_during_recoveries_s"]
            print(f"  {m:<14} barrier {_ms(bw['2'])} / {_ms(bw['5'])}   recovery {_ms(rl['1'])} / {_ms(rl['4'])}   "
                  f"TPOT {_ms(tpot)} ({e['turns_during_recoveries']}), all {_ms(e['tpot_s'])}   "
                  f"remote {e['remote']} (prefill {_ms(e['compute_s'])}, queued {_ms(e['queue_s'])})   "
                  f"failed {e['failed']} misses {e['misses']} local-first {e['local_first']} lost {e['lost']}")


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1000:7.1f}" if seconds is not None else "      -"


COLORS = {"colocated": "#7f7f7f", "disaggregated": "#d62728", "resident": "#1f77b4", "in_flight": "#2ca02c"}


def plot(s: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 3.8))
    for m, style in (("disaggregated", "o-"), ("resident", "s-"), ("in_flight", "x--")):
        b = s["growth"][m]["bytes"]["1.0"]
        turns = sorted(int(t) for t in b)
        left.plot(turns, [b[str(t)]["out"] / 1024 for t in turns], style, color=COLORS[m], label=m)
    left.set(xlabel="turn", ylabel="KiB shipped out", title="bytes out per recovery (an image every turn)")
    left.legend(fontsize=8)
    width = 0.2
    for i, m in enumerate(MODES):
        waits = [_mean([w for w in s["chat"][m][str(t)]["barrier_wait_s"].values() if w is not None]) or 0.0
                 for t in THINK_S]
        middle.bar([j + (i - 1.5) * width for j in range(len(THINK_S))], [w * 1000 for w in waits], width,
                   color=COLORS[m], label=m)
        tpot = [s["chat"][m][str(t)]["tpot_during_recoveries_s"] or 0.0 for t in THINK_S]
        right.bar([j + (i - 1.5) * width for j in range(len(THINK_S))], [x * 1000 for x in tpot], width,
                  color=COLORS[m], label=m)
    for ax, title in ((middle, "barrier wait of turns 2 and 5"),
                      (right, "decode TPOT during other sessions' recoveries")):
        ax.set_xticks(range(len(THINK_S)), [f"think {t:g} s" for t in THINK_S])
        ax.set(ylabel="ms", title=title)
    middle.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 sessions (a few minutes)")
    ap.add_argument("--sessions", type=int, default=None, help="sessions at once (default 6; --quick 3)")
    ap.add_argument("--model", default=None, help="checkpoint folder, 'demo' (the default) or 'bench' (the random "
                    "bench-size model: hidden 384, 8 layers; its answers are noise)")
    ap.add_argument("--json", type=Path, help="write the summary here")
    ap.add_argument("--img-dir", type=Path, help="where the PNG plot goes (default docs/img; none with --quick)")
    args = ap.parse_args(argv)
    sessions = args.sessions or (3 if args.quick else 6)
    if args.img_dir is None and not args.quick:
        args.img_dir = ROOT / "docs" / "img"
    counter = _Counter()
    logging.getLogger("services.decode_worker.disaggregated_recovery").addHandler(counter)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("services.decode_worker.disaggregated_recovery").setLevel(logging.INFO)
    t0 = time.perf_counter()
    deployment = Deployment(args.model)
    runs = []
    try:
        for mode in MODES:        # one session per deferred worker: bytes, not contention
            if mode != "colocated":
                runs.append(run(deployment, mode, "growth", 1.0, GROWTH_SESSIONS, counter))
                print(f"growth {mode}: done", file=sys.stderr, flush=True)
        for think in THINK_S:
            for mode in MODES:
                runs.append(run(deployment, mode, "chat", think, sessions, counter))
                print(f"chat think {think:g} {mode}: done", file=sys.stderr, flush=True)
    finally:
        deployment.stop()
    summary = summarize(runs, sessions)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    print_report(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    if args.img_dir:
        print(f"plot: {plot(summary, args.img_dir / 'recovery.png')}")


if __name__ == "__main__":
    main()
