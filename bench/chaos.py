"""Fault injection on a distributed deployment: what a fault costs the conversations running through it.

    python -m bench.chaos [--sessions 8] [--policies post_answer,raincheck] [--scenarios ...] [--json PATH]

Real processes on loopback, as `docs/deploy.md` lays them out: Redis (REDIS_URL, a key prefix of the
run's own, removed at the end), a Ray head (`ray start --head`) with `raincheck deferred-worker` keeping
2 named deferred workers in it, 2 decode workers (`--recovery-modes colocated,disaggregated`, attached to
that Ray) and 2 frontends, all on the demo model. The client is this process: `--sessions` sessions at
once, each one of the demo model's 3-turn dialogues (an image with the first question; recovery
`disaggregated`), sent through the frontends in turn, with `--think-s` between a session's turns. A
turn that fails (the stream breaks, an error event, UNAVAILABLE) is sent again through the other
frontend, up to 5 times, unless GetSession says the session's turn count already includes it: the
service committed (logged) it and only the stream carrying its answer broke (counted as `unseen`:
sending it again would ask the question twice).

Per policy, a no-fault run first gives each session's answers. Then, per scenario, the same sessions
run again and one fault is injected when half of the first answers are in (`actor_kill`: as soon as
a residual has been shipped, if one is first); whatever the fault took down is started again before the next
scenario. Scenarios: `repeat` (no fault: the no-fault run again), `actor_kill` (the deferred workers
killed; Ray restarts them), `decode_worker_kill` (SIGKILL), `frontend_kill` (SIGKILL), `sigterm_drain` (a
decode worker drains and exits), `ray_head_kill` (SIGKILL of the Ray head's process group and the
deferred-worker process). Reported per scenario: turns completed, lost (never answered after the
retries), unseen, wrong (answered, but not as in the no-fault run; in brackets, how many of those are
the dialogue's own answer), retries, and from the decode workers' logs the recoveries the deferred
workers finished (remote) and the decode workers finished themselves (local: the deferred worker
failed, or the next turn came before its result and the barrier finished it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis

from raincheck_client import Client, RaincheckError
from raincheck_demo.world import Dialogue, make_dialogue

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("repeat", "actor_kill", "decode_worker_kill", "frontend_kill", "sigterm_drain", "ray_head_kill")
SEED = 20261201
TURNS = 3
ATTEMPTS = 5
MAX_NEW_TOKENS = 48
MODEL = "demo-v1"     # v1, which docs/BENCHMARKS.md measured (its dialogues: one image with the first question)
# Under `raincheck`, which answer tokens see which deferred rows depends on the step schedule. With the TPOT
# objective (measured step times) and a deferred budget shared by the sessions in a step (8 x 31 > 63), that
# schedule differs from run to run, and so may an answer. Fixed chunks of 7 (8 x 7 <= 63) make it the same
# in every run, so `wrong` counts what the faults did and nothing else.
REPRODUCIBLE = {"chunk_size": 7, "tpot_slo": 0}
UNSEEN = "<committed; the answer never reached the client>"
ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
       "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until(condition: Callable[[], object], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


class Deployment:
    """The processes, each with a fixed port and a log file, started and stopped by name."""

    def __init__(self, workdir: Path, redis_url: str):
        self.workdir = workdir
        self.redis_url = redis_url
        self.prefix = f"raincheck-chaos-{uuid.uuid4().hex[:8]}:"
        self.namespace = f"raincheck-chaos-{uuid.uuid4().hex[:8]}"
        self.ray_port = _free_port()
        self.ray_address = f"127.0.0.1:{self.ray_port}"
        self.ports = {name: _free_port() for name in ("frontend-a", "frontend-b", "worker-1", "worker-2")}
        self.processes: dict[str, subprocess.Popen] = {}
        self.redis = redis.Redis.from_url(redis_url)

    @property
    def frontends(self) -> list[str]:
        return [f"127.0.0.1:{self.ports[name]}" for name in ("frontend-a", "frontend-b")]

    def start_all(self) -> None:
        self.start("ray-head")
        self.start("deferred")
        for name in ("worker-1", "worker-2", "frontend-a", "frontend-b"):
            self.start(name)
        self.wait_ready()

    def command(self, name: str) -> list[str]:
        raincheck = [sys.executable, "-m", "services.cli", "--plain-logs"]
        store = ["--redis-url", self.redis_url, "--store-prefix", self.prefix]
        if name == "ray-head":
            return [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={self.ray_port}",
                    "--node-ip-address=127.0.0.1", "--num-cpus=2", '--resources={"raincheck_deferred": 4}',
                    "--include-dashboard=false"]
        if name == "deferred":
            return [*raincheck, "deferred-worker", "--ray-address", self.ray_address, "--ray-namespace",
                    self.namespace, "--deferred-workers", "2", "--deferred-num-cpus", "0", "--model", MODEL]
        if name.startswith("worker"):
            return [*raincheck, "decode-worker", *store, "--model", MODEL, "--port", str(self.ports[name]),
                    "--worker-id", name, "--metrics-port", "-1", "--recovery-modes", "colocated,disaggregated",
                    "--ray-address", self.ray_address, "--ray-namespace", self.namespace, "--deferred-num-cpus", "0"]
        return [*raincheck, "frontend", *store, "--port", str(self.ports[name]), "--metrics-port", "-1",
                "--recovery-mode", "disaggregated"]

    def start(self, name: str) -> None:
        with (self.workdir / f"{name}.log").open("a") as log:
            self.processes[name] = subprocess.Popen(self.command(name), cwd=ROOT, env={**os.environ, **ENV},
                                                    stdout=log, stderr=subprocess.STDOUT,
                                                    start_new_session=name == "ray-head")
        if name == "ray-head":
            _until(lambda: _listening(self.ray_port), "the Ray head")

    def wait_ready(self) -> None:
        """Every process up: workers registered and attached to Ray, frontends listening, 2 deferred workers."""
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}: see {self.workdir / name}.log")
        _until(lambda: all(self.redis.exists(f"{self.prefix}worker:{w}") for w in ("worker-1", "worker-2")),
               "the decode workers to register")
        _until(lambda: all(self.log(w).count("attached to Ray") > self.log(w).count("lost the Ray driver")
                           for w in ("worker-1", "worker-2")), "the decode workers to attach to Ray")
        _until(lambda: all(_listening(self.ports[f]) for f in ("frontend-a", "frontend-b")), "the frontends")

    def log(self, name: str, since: int = 0) -> str:
        return (self.workdir / f"{name}.log").read_text()[since:]

    def log_sizes(self) -> dict[str, int]:
        return {w: len(self.log(w)) for w in ("worker-1", "worker-2")}

    def recoveries(self, since: dict[str, int]) -> tuple[int, int]:
        """(Recoveries joined from a deferred worker, recoveries taken back) in the decode workers' logs
        since `since` (their lengths then)."""
        logs = [self.log(w, n) for w, n in since.items()]
        return (sum(t.count("recovered on a deferred worker") for t in logs),
                sum(t.count("deferred worker failed (") + t.count("recovered locally first") for t in logs))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        process = self.processes.pop(name)
        t0 = time.monotonic()
        if name == "ray-head":
            os.killpg(process.pid, sig)
        else:
            process.send_signal(sig)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if time.monotonic() - t0 > 15:
            print(f"{name} took {time.monotonic() - t0:.0f}s to exit after signal {sig}", file=sys.stderr)

    def restore(self) -> None:
        """Start whatever is not running (a killed Ray head with its deferred-worker process)."""
        if "ray-head" not in self.processes:
            if "deferred" in self.processes:
                self.kill("deferred")
            self.start("ray-head")
        for name in ("deferred", "worker-1", "worker-2", "frontend-a", "frontend-b"):
            if name not in self.processes or self.processes[name].poll() is not None:
                self.processes.pop(name, None)
                self.start(name)
        self.wait_ready()

    def kill_actors(self) -> None:
        """Kill the deferred-worker process's actors (Ray restarts them)."""
        code = ("import ray, sys; ray.init(address=sys.argv[1], namespace=sys.argv[2], log_to_driver=False); "
                "[ray.kill(ray.get_actor(n, namespace=sys.argv[2]), no_restart=False) for n in sys.argv[3:]]")
        names = [f"deferred:{MODEL}:{i}" for i in range(2)]
        subprocess.run([sys.executable, "-c", code, self.ray_address, self.namespace, *names],
                       cwd=ROOT, env={**os.environ, **ENV}, check=True, timeout=120, capture_output=True)

    def stop(self) -> None:
        for name in ("frontend-a", "frontend-b", "worker-1", "worker-2", "deferred", "ray-head"):
            if name in self.processes and self.processes[name].poll() is None:
                self.kill(name, signal.SIGTERM if name != "ray-head" else signal.SIGKILL)
        keys = list(self.redis.scan_iter(match=self.prefix + "*"))
        if keys:
            self.redis.delete(*keys)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@dataclass
class SessionRun:
    answers: list[str | None] = field(default_factory=list)
    retries: int = 0
    errors: list[str] = field(default_factory=list)


class Conversations:
    """Runs the dialogues at once through the frontends; counts finished turns for the fault trigger."""

    def __init__(self, frontends: list[str], dialogues: list[Dialogue], policy: str, think_s: float):
        self.frontends = frontends
        self.dialogues = dialogues
        self.policy = policy
        self.think_s = think_s
        self.done = 0
        self._lock = threading.Lock()

    def run(self) -> list[SessionRun]:
        clients = [Client(address) for address in self.frontends]
        try:
            with ThreadPoolExecutor(len(self.dialogues)) as pool:
                return list(pool.map(lambda i: self._session(clients, i), range(len(self.dialogues))))
        finally:
            for c in clients:
                c.close()

    def _session(self, clients: list[Client], i: int) -> SessionRun:
        run, d, pick = SessionRun(), self.dialogues[i], i
        session_id = None
        for attempt in range(ATTEMPTS):
            try:
                session_id = clients[pick % 2].create_session(policy=self.policy, recovery="disaggregated",
                                                              **REPRODUCIBLE).id
                break
            except RaincheckError as e:
                run.errors.append(f"create: {e}")
                pick += 1
                time.sleep(0.5 * (attempt + 1))
        for t in range(TURNS):
            if t:
                time.sleep(self.think_s)
            answer = None
            for attempt in range(ATTEMPTS if session_id else 0):
                try:
                    session = clients[pick % 2].session(session_id)
                    if attempt and session.info.turns > t:    # the failed attempt was committed (logged):
                        answer = UNSEEN                        # sending it again would ask the question twice
                        break
                    answer = session.send(d.questions[t].text, images=[d.scene.png()] if t == 0 else [],
                                          max_new_tokens=MAX_NEW_TOKENS).text()
                    break
                except (RaincheckError, RuntimeError) as e:
                    run.errors.append(f"turn {t + 1}: {e}")
                    run.retries += 1
                    pick += 1
                    time.sleep(0.5 * (attempt + 1))
            run.answers.append(answer)
            with self._lock:
                self.done += 1
        return run


@dataclass
class Outcome:
    scenario: str
    completed: int
    lost: int
    unseen: int                   # committed by the service, but the stream carrying the answer broke
    wrong: int
    wrong_but_right: int          # of the wrong ones: the dialogue's own answer (the no-fault one missed it)
    retries: int
    remote: int                   # recoveries joined from a deferred worker
    local: int                    # recoveries the decode worker finished itself (the deferred worker failed, or
                                  # the next turn came first)
    seconds: float
    errors: list[str]
    diffs: list[tuple[int, int, str | None, str]]     # (session, turn, no-fault answer, this answer)


def _score(name: str, runs: list[SessionRun], expected: list[list[str | None]], dialogues: list[Dialogue],
           seconds: float, recoveries: tuple[int, int]) -> Outcome:
    completed = lost = unseen = wrong = right = 0
    diffs = []
    for i, (run, want, d) in enumerate(zip(runs, expected, dialogues, strict=True)):
        for t, (got, exp) in enumerate(zip(run.answers, want, strict=True)):
            if got is None:
                lost += 1
                continue
            if got == UNSEEN:
                unseen += 1
                continue
            completed += 1
            if got != exp:
                wrong += 1
                diffs.append((i, t, exp, got))
                right += got == d.questions[t].answer
    return Outcome(name, completed, lost, unseen, wrong, right, sum(r.retries for r in runs), *recoveries,
                   round(seconds, 1), [e for r in runs for e in r.errors][:20], diffs)


def run_scenario(deployment: Deployment, name: str, dialogues: list[Dialogue], expected: list[list[str | None]],
                 policy: str, think_s: float) -> Outcome:
    conversations = Conversations(deployment.frontends, dialogues, policy, think_s)
    faults: dict[str, Callable[[], None]] = {
        "repeat": lambda: None,
        "actor_kill": deployment.kill_actors,
        "decode_worker_kill": lambda: deployment.kill("worker-1"),
        "frontend_kill": lambda: deployment.kill("frontend-a"),
        "sigterm_drain": lambda: deployment.kill("worker-1", signal.SIGTERM),
        "ray_head_kill": lambda: (deployment.kill("ray-head"), deployment.kill("deferred")),
    }
    t0, logs = time.perf_counter(), deployment.log_sizes()
    half = max(1, len(dialogues) // 2)         # half the first answers are in: their recoveries are in flight
    shipped = lambda: any("shipping" in deployment.log(w, n) for w, n in logs.items())    # noqa: E731

    def inject() -> None:
        # `raincheck` answers often restore every deferred token themselves: then nothing is shipped
        _until(lambda: (name == "actor_kill" and shipped()) or conversations.done >= half, "the fault's moment",
               600)
        faults[name]()

    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    runs = conversations.run()
    injector.join()
    time.sleep(2.0)      # the last turns' recoveries end
    outcome = _score(name, runs, expected, dialogues, time.perf_counter() - t0, deployment.recoveries(logs))
    deployment.restore()
    return outcome


def run_policy(deployment: Deployment, policy: str, scenarios: list[str], dialogues: list[Dialogue],
               think_s: float) -> tuple[list[Outcome], int]:
    """The no-fault run, then each scenario; and how many of the no-fault answers are the dialogues' own."""
    t0, logs = time.perf_counter(), deployment.log_sizes()
    baseline = Conversations(deployment.frontends, dialogues, policy, think_s).run()
    expected = [r.answers for r in baseline]
    time.sleep(2.0)
    outcomes = [_score("no_fault", baseline, expected, dialogues, time.perf_counter() - t0,
                       deployment.recoveries(logs))]
    for name in scenarios:
        outcomes.append(run_scenario(deployment, name, dialogues, expected, policy, think_s))
        print(f"{policy} {name}: done", file=sys.stderr, flush=True)
    right = sum(a == d.questions[t].answer for r, d in zip(baseline, dialogues, strict=True)
                for t, a in enumerate(r.answers))
    return outcomes, right


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--policies", default="post_answer,raincheck", help="comma-separated: full, raincheck, post_answer")
    ap.add_argument("--think-s", type=float, default=1.0, help="a client's pause between its turns")
    ap.add_argument("--json", type=Path, help="write the outcomes here")
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (their folder is printed)")
    args = ap.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    policies = [p for p in args.policies.split(",") if p]
    if unknown := set(scenarios) - set(SCENARIOS):
        ap.error(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    if unknown := set(policies) - {"full", "raincheck", "post_answer"}:
        ap.error(f"unknown policies {sorted(unknown)}")
    rng = random.Random(SEED)
    dialogues = [make_dialogue(rng, turns=TURNS) for _ in range(args.sessions)]
    workdir = Path(tempfile.mkdtemp(prefix="raincheck-chaos-"))
    deployment = Deployment(workdir, args.redis_url)
    results = {}
    try:
        deployment.start_all()
        for policy in policies:
            results[policy] = run_policy(deployment, policy, scenarios, dialogues, args.think_s)
    finally:
        deployment.stop()
        if not args.keep_logs:
            for log in workdir.glob("*.log"):
                log.unlink()
            workdir.rmdir()
        else:
            print(f"logs in {workdir}", file=sys.stderr)
    for policy, (outcomes, right) in results.items():
        print(f"\npolicy {policy}: {args.sessions} sessions x {TURNS} turns per scenario, {args.think_s:g} s between "
              f"turns; the no-fault run answered "
              f"{right} of {args.sessions * TURNS} right")
        print(f"{'scenario':<20} {'completed':>9} {'lost':>5} {'unseen':>6} {'wrong':>6} {'(right)':>8} {'retries':>8} "
              f"{'remote':>7} {'local':>6} {'s':>6}")
        for o in outcomes:
            print(f"{o.scenario:<20} {o.completed:>9} {o.lost:>5} {o.unseen:>6} {o.wrong:>6} {o.wrong_but_right:>8} "
                  f"{o.retries:>8} {o.remote:>7} {o.local:>6} {o.seconds:>6}")
    if args.json:
        args.json.write_text(json.dumps({p: {"right": r, "outcomes": [asdict(o) for o in os_]}
                                         for p, (os_, r) in results.items()}, indent=2))


if __name__ == "__main__":
    main()
