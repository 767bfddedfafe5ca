"""Graceful drain: a decode worker process sent SIGTERM stops taking sessions (health NOT_SERVING, out
of the registry), finishes its streaming turn and that turn's recovery, marks its sessions for
takeover, and exits; another worker serves those sessions' next turns (rebuilt from the turn log)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from raincheck_client import RecoveryProgress, Token
from tests.multimodal.mm_helpers import png
from tests.services.conftest import MODEL, NUM_PAGES, REDIS_URL, redis_store

ROOT = Path(__file__).resolve().parents[2]
ANSWER = 256


def _worker_process(checkpoint: Path, prefix: str, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "services.cli", "--plain-logs", "decode-worker", "--redis-url", REDIS_URL,
               "--store-prefix", prefix, "--model", str(checkpoint), "--model-name", MODEL, "--port", "0",
               "--worker-id", "draining", "--metrics-port", "-1", "--num-pages", str(NUM_PAGES),
               "--drain-timeout-s", "60"]
    with log.open("w") as out:
        return subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def _until(condition, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_sigterm_drains_a_worker_and_another_takes_its_sessions(cluster, checkpoint, redis_prefix, tmp_path):
    store = redis_store(redis_prefix)
    log = tmp_path / "worker.log"
    process = _worker_process(checkpoint, redis_prefix, log)
    try:
        a = _until(lambda: store.worker("draining"), "the worker to register")
        client = cluster.client(cluster.frontend(redis_store(redis_prefix)))
        session = client.create_session(policy="post_answer", retention=0.3)   # all of D after the answer
        b = cluster.worker(redis_store(redis_prefix))

        # a long answer, so that the drain is seen in progress; its noise holds no image or video
        # placeholder id, which a rebuild cannot replay
        turn = session.send("what color is the box ?", images=[png()], max_new_tokens=ANSWER, ignore_eos=True,
                            follow_recovery=True)
        events = iter(turn)
        first = next(e for e in events if isinstance(e, Token))
        process.send_signal(signal.SIGTERM)                      # mid-answer
        _until(lambda: store.worker("draining") is None, "the worker to leave the registry")
        with grpc.insecure_channel(a.address) as channel:       # still up, but not ready
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert client.create_session().info.worker_id == b.worker_id

        rest = list(events)                                      # the turn and its recovery finish
        tokens = [first, *(e for e in rest if isinstance(e, Token))]
        assert [t.index for t in tokens] == list(range(ANSWER)) and turn.final.finish_reason == "length"
        assert turn.metrics.deferred_pending > 0
        assert isinstance(rest[-1], RecoveryProgress) and rest[-1].complete and rest[-1].pending_tokens == 0
        assert process.wait(timeout=60) == 0, log.read_text()
        assert "1 sessions marked for takeover" in log.read_text()
    finally:
        if process.poll() is None:
            process.kill()

    assert store.session(session.id).worker_id == "" and session.status().status == "detached"
    second = session.send("and the blue one ?", max_new_tokens=6, ignore_eos=True).result()
    assert len(second.token_ids) == 6
    status = session.status()
    assert (status.worker_id, status.turns) == (b.worker_id, 2)
    assert b.runtime.sessions[session.id].session.turns == 1     # the log replayed, then the new turn
