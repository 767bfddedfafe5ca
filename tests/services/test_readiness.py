"""Readiness: health means "can serve a turn" (issue 28). Liveness is the open port (k8s manifests)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.store import MemoryStore
from tests.multimodal.mm_helpers import png

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=5).status


def test_frontend_is_ready_only_while_a_worker_is_registered(cluster):
    store = MemoryStore()
    frontend = cluster.frontend(store)
    names = ("", "raincheck.v1.ChatService")
    assert [_health(frontend.address, n) for n in names] == [NOT_SERVING] * 2   # up, but nothing to route to
    worker = cluster.worker(store)
    assert _health(worker.address) == SERVING     # after its model loaded and its warm-up turn ran
    assert [_health(frontend.address, n) for n in names] == [SERVING] * 2
    # what a client that waited for SERVING does next succeeds
    session = cluster.client(frontend).create_session(policy="raincheck", retention=0.3)
    assert session.send("what is this ?", images=[png()], max_new_tokens=2).text() is not None
    session.close()
    cluster.stop(worker)                          # the last worker leaves
    assert [_health(frontend.address, n) for n in names] == [NOT_SERVING] * 2


def test_watch_hears_the_change(cluster):
    store = MemoryStore()
    frontend = cluster.frontend(store)
    with grpc.insecure_channel(frontend.address) as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
        assert next(stream).status == NOT_SERVING
        cluster.worker(store)
        assert next(stream).status == SERVING     # the refresher thread saw the registration
        stream.cancel()
