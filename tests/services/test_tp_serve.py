"""`raincheck serve --tensor-parallel-size 2` on the demo model: the same greedy answers as at 1 through
the SDK and the HTTP API; a worker rank killed fails the turn in flight with a typed error and makes the
server NOT_SERVING (gRPC health and HTTP /health), not a hang; the decode worker then loads its engine
again and serves the same answers."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import OpenAI

from raincheck_client import Client, Unavailable
from raincheck_demo.world import make_dialogue
from tests.http.helpers import user

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo-v2"
# fixed deferred chunks (no TPOT objective) and no calibration: answers independent of timing, a fast start
ENV = {"RAINCHECK_LOG_LEVEL": "WARNING", "RAINCHECK_TPOT_SLO": "0", "RAINCHECK_CALIBRATE": "false",
       "RAINCHECK_NUM_PAGES": "256"}

pytestmark = pytest.mark.skipif(not (DEMO / "model.safetensors").is_file(), reason="no demo-v2 checkpoint")


class Serve:
    """`raincheck serve` in a process of its own, on ephemeral ports."""

    def __init__(self, *flags: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "--plain-logs", "serve", "--model", str(DEMO), "--port", "0",
             "--http-port", "0", "--metrics-port", "-1", "--api-keys", "k1", *flags],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, **ENV})
        self.address = self.url = None
        for line in self.proc.stdout:
            if m := re.search(r"raincheck serving (\S+) on (\S+)", line):
                self.model, self.address = m.groups()
            if m := re.search(r"HTTP API on (http://\S+)", line):
                self.url = m.group(1)
                break
        assert self.address is not None and self.url is not None, "serve did not announce its addresses"

    def answers(self) -> dict[str, object]:
        """An image question under raincheck and its follow-up through the SDK (their token ids), and a
        chat completion through the HTTP API (its text); all greedy."""
        dialogue = make_dialogue(random.Random(11))
        image = dialogue.scene.png()
        out: dict[str, object] = {}
        with Client(self.address, api_key="k1", timeout_s=300) as client:
            session = client.create_session(policy="raincheck", retention=0.3)
            for i, (text, images) in enumerate([(dialogue.questions[0].text, [image]),
                                                (dialogue.questions[1].text, [])]):
                out[f"sdk{i}"] = session.send(text, images=images, max_new_tokens=12).result().token_ids
            session.close()
        openai = OpenAI(base_url=self.url + "/v1", api_key="k1", max_retries=0, timeout=300)
        r = openai.chat.completions.create(model=self.model, max_tokens=12, temperature=0,
                                           messages=[user(dialogue.questions[0].text, image)])
        out["http"] = r.choices[0].message.content
        return out

    def health(self) -> tuple[int, int]:
        """(gRPC health status, HTTP /health status code)."""
        with grpc.insecure_channel(self.address) as channel:
            grpc_status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status
        return grpc_status, httpx.get(self.url + "/health", timeout=30).status_code

    def rank_pids(self) -> list[int]:
        return rank_pids(self.proc.pid)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=120) == 0


def rank_pids(parent: int) -> list[int]:
    """The worker ranks an engine in process `parent` started: its children made by multiprocessing's spawn
    (not its resource tracker)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def test_serve_at_tp2_answers_as_tp1_and_a_killed_rank_gives_not_serving():
    single = Serve()
    try:
        want = single.answers()
    finally:
        single.stop()
    serve = Serve("--tensor-parallel-size", "2")
    try:
        (rank,) = serve.rank_pids()
        assert serve.answers() == want
        assert serve.health() == (health_pb2.HealthCheckResponse.SERVING, 200)

        with Client(serve.address, api_key="k1", timeout_s=120) as client:
            turn = client.create_session().send("what is this ?", max_new_tokens=400, ignore_eos=True)
            next(iter(turn))                    # the answer streams: the rank dies in the middle of it
            os.kill(rank, signal.SIGKILL)
            with pytest.raises(Unavailable, match="rank"):
                turn.result()
        deadline = time.monotonic() + 60
        while serve.health() != (health_pb2.HealthCheckResponse.NOT_SERVING, 503):
            assert time.monotonic() < deadline, f"still {serve.health()} after the rank was killed"
            time.sleep(0.2)
        # the decode worker loads its engine again, with a new worker rank, and serves the same answers
        deadline = time.monotonic() + 300
        while serve.health() != (health_pb2.HealthCheckResponse.SERVING, 200):
            assert time.monotonic() < deadline, "the decode worker did not restart its engine"
            time.sleep(0.5)
        assert len(serve.rank_pids()) == 1 and serve.rank_pids() != [rank]
        assert serve.answers() == want
    finally:
        serve.stop()
