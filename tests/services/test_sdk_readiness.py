"""The SDK against a server that is starting (raincheck_client/_ready.py): a script that starts `raincheck
serve` and uses the SDK at once gets its chat, without sleeping or retrying itself, through `wait_ready` or
through the retry of calls refused with UNAVAILABLE before they were accepted; sync and asyncio alike.
What never comes ready is an `Unavailable` that says why, in bounded time."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from raincheck_client import AsyncClient, Client, Unavailable
from raincheck_client._ready import ReadyWait, health_status
from services.common.store import MemoryStore

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "what colour is the object in row one column one ?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve():
    """`raincheck serve` (the demo model) just started: its address, while the process still loads."""
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--port", str(port),
                                "--metrics-port", "-1", "--model", "demo-v1"], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    yield f"127.0.0.1:{port}"
    process.terminate()
    process.wait(30)


def test_a_script_that_starts_serve_chats_at_once_with_wait_ready(serve):
    start = time.monotonic()
    with Client(serve, wait_ready=180) as client:
        waited = time.monotonic() - start
        assert client.create_session().send(QUESTION, max_new_tokens=4).text() == "red"
    assert waited > 1.0            # it was not ready when the client came: the SDK waited


def test_asyncio_chats_at_once_through_the_retry_alone(serve):
    """No wait_ready: opening the session is retried while the server is unreachable, then while it has no
    worker yet, within the call's deadline."""
    async def chat() -> str:
        async with AsyncClient(serve, timeout_s=180) as client:
            session = await client.create_session()
            return await session.send(QUESTION, max_new_tokens=4).text()
    assert asyncio.run(chat()) == "red"


def test_no_worker_yet_is_waited_for_then_served(cluster):
    """A frontend without a worker: wait_ready says why it is not ready, and a session opened while the worker
    is still starting is retried until the worker registers."""
    store = MemoryStore()
    frontend = cluster.frontend(store)
    with Client(frontend.address, timeout_s=1) as client:
        start = time.monotonic()
        # the reason is the server's last answer (a check that then runs out of time keeps it): 3 s leave a
        # loaded host time to answer at all ("not reachable yet")
        with pytest.raises(Unavailable, match=r"not ready after \d+ s \(loading its model\)"):
            client.wait_ready(3.0)
        with pytest.raises(Unavailable, match="no healthy decode worker"):
            client.create_session()           # retried for its 1 s deadline, then the server's own reason
        # bounded by the deadlines given (3 + 1 s), not the SDK's defaults (30 s a call, 60 a wait): a bound far
        # from both, so that a loaded host's slow answers never fail it and a wait that ignored them does
        assert time.monotonic() - start < 20
    threading.Timer(1.0, lambda: cluster.worker(store)).start()
    with Client(frontend.address, timeout_s=60) as client:
        assert client.create_session().send("hi", max_new_tokens=2).result().finish_reason in ("stop", "length")


def test_an_unreachable_server_is_unavailable_in_bounded_time():
    seen = []
    with Client("127.0.0.1:1", timeout_s=1.5) as client:
        start = time.monotonic()
        with pytest.raises(Unavailable, match=r"not ready after \d+ s \(not reachable yet\)"):
            client.wait_ready(1.2, lambda why, waited: seen.append(why))
        with pytest.raises(Unavailable, match="could not be reached"):
            client.list_models()
        # bounded by the deadlines given (1.2 + 1.5 s), as above
        assert time.monotonic() - start < 20 and seen and set(seen) == {"not reachable yet"}
    with Client("127.0.0.1:1", retry=False) as client:
        # no retry: the first try, which does not wait for a connection, fails with gRPC's own reason
        with pytest.raises(Unavailable, match="failed to connect") as refused:
            client.list_models()
        assert "could not be reached" not in str(refused.value)


def test_health_replies_are_read_by_hand():
    assert [health_status(r) for r in (b"\x08\x01", b"\x08\x02", b"", b"\x08\x03")] == [1, 2, 0, 3]


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


@pytest.mark.parametrize("code, why", [(grpc.StatusCode.DEADLINE_EXCEEDED, "loading its model"),
                                       (grpc.StatusCode.UNAVAILABLE, "not reachable yet")])
def test_a_check_that_runs_out_of_time_keeps_the_servers_last_answer(code, why):
    """A server that answered NOT_SERVING, then missed a check's deadline, is still loading; one that
    refuses connections has gone away."""
    wait = ReadyWait("127.0.0.1:1", 60.0, None)
    assert wait.after(b"\x08\x02", None) is not None
    wait.start -= 61.0                                   # the time is up at the next check
    with pytest.raises(Unavailable, match=rf"not ready after \d+ s \({why}\)"):
        wait.after(None, _RpcError(code))


def test_a_server_never_answered_is_not_reachable_yet():
    wait = ReadyWait("127.0.0.1:1", 0.0, None)
    with pytest.raises(Unavailable, match=r"\(not reachable yet\)"):
        wait.after(None, _RpcError(grpc.StatusCode.DEADLINE_EXCEEDED))
