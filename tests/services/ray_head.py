"""A Ray head of a test's own, in a process group of its own, so that the test can kill it (and start it
again at the same address) without touching the shared Ray of the other tests; and a one-shot driver
that registers a slow deferred worker in it (`python -m tests.services.ray_head ADDRESS NAMESPACE
CHECKPOINT MODEL DELAY_S`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Token auth, as a Ray cluster of this version runs by default; every process that attaches by address
# needs RAY_AUTH_MODE=token and the token (here: ~/.ray/auth_token, which the first local Ray created).
ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
       "PYTHONPATH": str(ROOT)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayHead:
    def __init__(self, port: int, log: Path, slots: int = 4):
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.log = log
        self.slots = slots
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> RayHead:
        ray = Path(sys.executable).with_name("ray")
        command = [str(ray), "start", "--head", "--block", f"--port={self.port}", "--node-ip-address=127.0.0.1",
                   "--num-cpus=2", f'--resources={{"raincheck_deferred": {self.slots}}}', "--include-dashboard=false"]
        with self.log.open("a") as out:
            self.process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **ENV}, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the Ray head did not come up"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the head's process group (GCS, raylet, and so the actors on it)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None


def register_slow_worker(address: str, namespace: str, checkpoint: Path, model: str, delay_s: float
                         ) -> subprocess.Popen:
    """A detached deferred worker `deferred:<model>:0` that sleeps `delay_s` before each prefill. Returns once
    its name is registered; the process ends (exit code 0) when it has loaded its checkpoint."""
    process = subprocess.Popen([sys.executable, "-m", "tests.services.ray_head", address, namespace, str(checkpoint),
                                model, str(delay_s)], cwd=ROOT, env={**os.environ, **ENV}, stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "registered", "the slow deferred worker was not registered"
    return process


def _register(address: str, namespace: str, checkpoint: str, model: str, delay_s: str) -> None:
    import ray

    from services.common.settings import ModelSpec
    from tests.services.conftest import NUM_PAGES
    from tests.services.slow_worker import SlowDeferredWorker

    ray.init(address=address, namespace=namespace, log_to_driver=False)
    spec = ModelSpec(checkpoint, model, engine={"num_pages": NUM_PAGES})
    actor = ray.remote(SlowDeferredWorker).options(name=f"deferred:{model}:0", lifetime="detached", num_cpus=0,
                                                   max_concurrency=2).remote(spec, float(delay_s))
    while not any(a["name"] == f"deferred:{model}:0" for a in ray.util.list_named_actors(all_namespaces=True)):
        time.sleep(0.1)
    print("registered", flush=True)
    ray.get(actor.ready.remote())


if __name__ == "__main__":
    _register(*sys.argv[1:])
