"""Real services on loopback: decode workers and frontends on ephemeral ports, the in-process store or
the Redis at $REDIS_URL (default 127.0.0.1:6379) under a unique key prefix removed afterwards, and one
local Ray (on loopback) shared by the tests of disaggregated recovery."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import redis

from raincheck_client import Client
from services.common.random_model import save_random_model
from services.common.redis_store import RedisStore
from services.common.settings import FrontendSettings, WorkerSettings
from services.common.store import MemoryStore, Store
from services.decode_worker.server import DecodeWorkerServer
from services.frontend.server import FrontendServer

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
MODEL = "tiny"
NUM_PAGES = 512
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen3.5-architecture VLM with a tokenizer and chat template."""
    return save_random_model(tmp_path_factory.mktemp("tiny-vlm"), "tiny")


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray for the whole test session: loopback only, 2 CPU slots (deferred workers in tests ask
    for none), and the custom resource deferred workers ask for. Shut down at the end."""
    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, resources={"raincheck_deferred": 8},
             log_to_driver=False)
    yield ray
    ray.shutdown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def ray_address(ray_session) -> str:
    """Where decode workers' Ray drivers attach to the shared Ray (by GCS address: they run in processes of
    their own, with the token auth the local Ray turned on in this process's environment)."""
    return ray_session.get_runtime_context().gcs_address


@pytest.fixture
def ray_namespace(ray_session) -> str:
    """A Ray namespace of the test's own, so that no other test's deferred workers are found."""
    return f"raincheck-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def redis_prefix() -> str:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError as e:
        pytest.fail(f"these tests need Redis at {REDIS_URL} (set REDIS_URL; .ci/run starts one): {e}")
    prefix = f"raincheck-test-{uuid.uuid4().hex[:12]}:"
    yield prefix
    keys = list(client.scan_iter(match=prefix + "*"))
    if keys:
        client.delete(*keys)
    client.close()


def redis_store(prefix: str) -> RedisStore:
    return RedisStore(REDIS_URL, prefix)


class Cluster:
    """Starts services for one test and stops them all at its end."""

    def __init__(self, checkpoint: Path):
        self.checkpoint = checkpoint
        self.running: list[DecodeWorkerServer | FrontendServer] = []
        self.clients: list[Client] = []

    def worker(self, store: Store, **overrides) -> DecodeWorkerServer:
        engine = {"num_pages": NUM_PAGES, **overrides.pop("engine", {})}
        # tpot_slo 0: fixed deferred chunks, so a raincheck answer does not depend on measured step times
        # and tests can compare it across paths (the objective: tests/engine/test_tpot_objective.py)
        # no calibration: the tests' workers start fast (tests/engine/test_warmup.py covers it)
        overrides = {"tpot_slo": 0.0, "calibrate": False, **overrides}
        settings = WorkerSettings(model=str(self.checkpoint), model_name=MODEL, port=0, metrics_port=None,
                                  engine=engine, heartbeat_s=0.5, registration_ttl_s=5.0, threads=16, **overrides)
        return self._start(DecodeWorkerServer(settings, store))

    def frontend(self, store: Store, **overrides) -> FrontendServer:
        settings = FrontendSettings(port=0, metrics_port=None, threads=16, **overrides)
        return self._start(FrontendServer(settings, store))

    def client(self, frontend: FrontendServer, api_key: str | None = None) -> Client:
        client = Client(frontend.address, api_key=api_key)
        self.clients.append(client)
        return client

    def _start(self, server):
        self.running.append(server.start())
        return server

    def stop(self, server) -> None:
        server.stop(grace_s=0)
        self.running.remove(server)

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for server in reversed(self.running):
            server.stop(grace_s=0)


@pytest.fixture
def cluster(checkpoint) -> Cluster:
    c = Cluster(checkpoint)
    yield c
    c.close()


@pytest.fixture
def embedded(cluster) -> tuple[Cluster, FrontendServer, DecodeWorkerServer]:
    """The embedded default: one worker and one frontend on the in-process store."""
    store = MemoryStore()
    worker = cluster.worker(store)
    return cluster, cluster.frontend(store), worker
