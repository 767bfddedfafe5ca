"""Disaggregated recovery: a turn's post-answer remainder is prefilled by a Ray deferred-worker actor and
joined by the decode worker, through the SDK -> frontend -> decode worker; a deferred worker that dies
or hangs costs nothing but time (the decode worker finishes the recovery itself)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from prometheus_client import REGISTRY

from raincheck_client import Client, RecoveryProgress
from services.common.settings import DeferredSettings, ModelSpec
from services.common.store import MemoryStore
from services.deferred_worker.actor import registered
from services.deferred_worker.keeper import Keeper
from tests.multimodal.mm_helpers import png
from tests.services.conftest import MODEL, NUM_PAGES
from tests.services.slow_worker import SlowDeferredWorker

# guard 16 > the answer's 8 tokens: nothing is fused, every deferred token is pending at the answer's end
POLICY = dict(policy="raincheck", retention=0.3, guard=16)
ANSWER = dict(max_new_tokens=8, ignore_eos=True)
TURNS = [("what is this ?", [png(128, 96)]), ("and the blue one ?", [])]
ROOT = Path(__file__).resolve().parents[2]


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _fallbacks(reason: str | None = None) -> float:
    reasons = [reason] if reason else ["timeout", "worker_died", "ray_lost", "error"]
    return sum(_metric("raincheck:deferred_fallbacks_total", reason=r) for r in reasons)


def _worker(cluster, store, address: str, namespace: str, **deferred):
    return cluster.worker(store, recovery_modes=("colocated", "disaggregated"),
                          deferred=DeferredSettings(ray_address=address, namespace=namespace, num_cpus=0, **deferred))


def chat(client, mode: str, follow: bool = True):
    """Two turns; returns the session and both answers' token ids."""
    session = client.create_session(recovery=mode, **POLICY)
    text, images = TURNS[0]
    first = session.send(text, images=images, follow_recovery=follow, **ANSWER)
    events = list(first)
    assert first.metrics.deferred_pending == first.metrics.deferred_tokens > 0
    if follow:
        assert isinstance(events[-1], RecoveryProgress) and events[-1].complete
    return session, first.final.token_ids, lambda: session.send(TURNS[1][0], **ANSWER).result().token_ids


def _wait(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_two_turn_image_chat_recovers_on_a_deferred_worker(cluster, ray_address, ray_namespace):
    store = MemoryStore()
    worker = _worker(cluster, store, ray_address, ray_namespace)
    client = cluster.client(cluster.frontend(store))
    assert client.list_models()[0].recovery_modes == ["colocated", "disaggregated"]
    shipped = _metric("raincheck:recovery_bytes_shipped_sum", mode="disaggregated")
    fallbacks = _fallbacks()

    session, first, second = chat(client, "disaggregated")
    assert session.status().pending_deferred_tokens == 0
    tokens = [first, second()]

    stats = worker.runtime.backends["disaggregated"].bridge.stats()
    (actor,) = stats["actors"]                                            # the worker's own: none registered
    assert actor["own"] and not stats["registered"]
    assert actor["calls"] == 1 and actor["pid"] != os.getpid()           # it ran in the actor's process
    assert _metric("raincheck:recovery_bytes_shipped_sum", mode="disaggregated") > shipped
    assert _fallbacks() == fallbacks

    _, first, second = chat(client, "colocated")
    assert tokens == [first, second()]                                    # greedy: the same answers


@pytest.mark.parametrize("failure", ["killed", "hangs"])
def test_a_failing_deferred_worker_loses_nothing(cluster, checkpoint, ray_address, ray_namespace, failure):
    """The only registered deferred worker is killed while it holds the payload, or never answers (a
    short timeout): the decode worker takes the recovery back and finishes it; the next turn matches
    colocated recovery."""
    spec = ModelSpec(str(checkpoint), MODEL, engine={"num_pages": NUM_PAGES})
    slow = ray.remote(SlowDeferredWorker).options(name=f"deferred:{MODEL}:0", namespace=ray_namespace, num_cpus=0,
                                                  max_concurrency=2).remote(spec, 60.0)
    store = MemoryStore()
    worker = _worker(cluster, store, ray_address, ray_namespace, timeout_s=60.0 if failure == "killed" else 1.0)
    stats = worker.runtime.backends["disaggregated"].bridge.stats()
    assert stats["registered"] and [a["key"] for a in stats["actors"]] == [f"deferred:{MODEL}:0"]
    client = cluster.client(cluster.frontend(store))
    reason = {"killed": "worker_died", "hangs": "timeout"}[failure]
    fallbacks = _fallbacks(reason)

    session, first, second = chat(client, "disaggregated", follow=False)
    _wait(lambda: ray.get(slow.started.remote()) == 1, 60.0)              # the payload is in the actor
    if failure == "killed":
        ray.kill(slow)
    _wait(lambda: session.status().pending_deferred_tokens == 0)
    assert _fallbacks(reason) == fallbacks + 1
    tokens = [first, second()]
    if failure == "hangs":
        ray.kill(slow)

    _, first, second = chat(client, "colocated")
    assert tokens == [first, second()]


def test_keeper_keeps_named_actors_alive(checkpoint, ray_namespace):
    """`raincheck deferred-worker`: N named actors in the namespace, found by decode workers, started
    again when one is gone, killed on stop."""
    settings = DeferredSettings(namespace=ray_namespace, workers=2, num_cpus=0)
    keeper = Keeper(settings, ModelSpec(str(checkpoint), MODEL, engine={"num_pages": NUM_PAGES}), check_s=0.1).start()
    try:
        assert keeper.names == [f"deferred:{MODEL}:0", f"deferred:{MODEL}:1"]
        first = registered(settings, MODEL)
        assert list(first) == keeper.names and registered(settings, "other-model") == {}
        ray.kill(first[keeper.names[0]])
        _wait(lambda: (now := registered(settings, MODEL)) and len(now) == 2
              and now[keeper.names[0]] != first[keeper.names[0]])
    finally:
        keeper.stop()
    assert registered(settings, MODEL) == {}


def test_serve_with_deferred_workers(checkpoint, tmp_path):
    """`raincheck serve --deferred-workers 1`: a local Ray of its own (its processes must outlive the
    thread that started them), disaggregated recovery offered and done there, everything gone after
    SIGTERM."""
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "services.cli", "--plain-logs", "serve", "--port", "0", "--metrics-port", "-1",
               "--model", str(checkpoint), "--model-name", MODEL, "--num-pages", str(NUM_PAGES),
               "--deferred-workers", "1", "--deferred-num-cpus", "0"]
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: "raincheck serving" in log.read_text(), timeout_s=60)
        address = re.search(r"raincheck serving \S+ on (\S+)", log.read_text()).group(1)
        with Client(address) as client:
            assert client.list_models()[0].recovery_modes == ["colocated", "disaggregated"]
            chat(client, "disaggregated")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert "49 deferred tokens recovered on a deferred worker" in log.read_text()
