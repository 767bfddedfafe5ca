"""Losing Ray: a decode worker process attached to a Ray head keeps serving when the head is killed
(SIGKILL of its process group, with a residual in flight on its deferred worker), finishes that
residual and the next turns' locally, reports disaggregated recovery degraded (health service
`raincheck.recovery.disaggregated` NOT_SERVING, `raincheck:recovery_mode_up` 0), and ships to a
deferred worker again once a head is back at the same address. Answers equal a colocated session's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.multimodal.mm_helpers import png
from tests.services.conftest import MODEL, NUM_PAGES, REDIS_URL, redis_store
from tests.services.ray_head import ENV, ROOT, RayHead, free_port, register_slow_worker

POLICY = dict(policy="raincheck", retention=0.3, guard=16)     # nothing fused in an 8-token answer
ANSWER = dict(max_new_tokens=8, ignore_eos=True)
WORKER = "ray-loss"


def _worker_process(checkpoint: Path, prefix: str, address: str, namespace: str, metrics_port: int,
                    log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "services.cli", "--plain-logs", "decode-worker", "--redis-url", REDIS_URL,
               "--store-prefix", prefix, "--model", str(checkpoint), "--model-name", MODEL, "--port", "0",
               "--worker-id", WORKER, "--metrics-port", str(metrics_port), "--num-pages", str(NUM_PAGES),
               "--recovery-modes", "colocated,disaggregated", "--ray-address", address, "--ray-namespace",
               namespace, "--deferred-num-cpus", "0"]
    with log.open("w") as out:
        return subprocess.Popen(command, cwd=ROOT, env={**os.environ, **ENV}, stdout=out, stderr=subprocess.STDOUT)


def _until(condition, what: str, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def _disaggregated_health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="raincheck.recovery.disaggregated"), timeout=5).status


def _metrics(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _up(port: int) -> float:
    return _metrics(port).get(("raincheck:recovery_mode_up", (("mode", "disaggregated"), ("worker", WORKER))), -1)


def _fallbacks(port: int) -> float:
    return _metrics(port).get(("raincheck:deferred_fallbacks_total", (("reason", "ray_lost"),)), 0.0)


def test_a_decode_worker_survives_losing_ray(cluster, checkpoint, redis_prefix, tmp_path):
    serving = health_pb2.HealthCheckResponse.SERVING
    head = RayHead(free_port(), tmp_path / "ray.log").start()
    namespace = f"raincheck-test-{uuid.uuid4().hex[:12]}"
    metrics_port, log = free_port(), tmp_path / "worker.log"
    process = None
    try:
        registering = register_slow_worker(head.address, namespace, checkpoint, MODEL, delay_s=60.0)
        process = _worker_process(checkpoint, redis_prefix, head.address, namespace, metrics_port, log)
        assert registering.wait(timeout=120) == 0
        store = redis_store(redis_prefix)
        address = _until(lambda: (w := store.worker(WORKER)) and w.address, "the worker to register")
        _until(lambda: _disaggregated_health(address) == serving, "the worker to attach to Ray")
        assert _up(metrics_port) == 1
        client = cluster.client(cluster.frontend(redis_store(redis_prefix)))
        session = client.create_session(recovery="disaggregated", **POLICY)
        reference = client.create_session(recovery="colocated", **POLICY)

        def both(text: str, images: list[bytes]) -> list[int]:
            tokens = [s.send(text, images=images, **ANSWER).result().token_ids for s in (session, reference)]
            assert tokens[0] == tokens[1]
            return tokens[0]

        both("what is this ?", [png(128, 96)])
        _until(lambda: "shipping 49 deferred tokens" in log.read_text(), "the residual to be shipped")
        time.sleep(0.5)                                  # in the slow deferred worker, which holds it 60 s
        assert session.status().pending_deferred_tokens == 49

        head.kill()
        _until(lambda: session.status().pending_deferred_tokens == 0, "the residual to be recovered locally", 30)
        _until(lambda: _disaggregated_health(address) != serving, "disaggregated recovery to be reported degraded")
        assert _up(metrics_port) == 0 and _fallbacks(metrics_port) == 1
        both("and the blue one ?", [png(96, 128, color="blue")])    # its remainder is recovered locally
        _until(lambda: session.status().pending_deferred_tokens == 0, "turn 2's remainder", 30)
        assert process.poll() is None

        head.start()                                     # back at the same address, no deferred worker registered:
        _until(lambda: _disaggregated_health(address) == serving, "the worker to reattach", 120)   # one of its own
        assert _up(metrics_port) == 1
        both("and the red one ?", [png(64, 64, color="red")])
        _until(lambda: log.read_text().count("recovered on a deferred worker") == 1, "a recovery on Ray again", 60)
        assert _fallbacks(metrics_port) == 1 and process.poll() is None
    finally:
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
        head.kill()
