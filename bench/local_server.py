"""`raincheck serve` as a process of its own on free loopback ports, for what drives a server from outside as
users do: `bench.serve` (guidellm), `bench.readiness`, tests/clients/conformance.py. Standard library only, so
that the clients' venv (requirements/clients.txt, without the project's packages) can import it too.
"""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_server(python: str, *flags: str, timeout_s: float = 300) -> Iterator[str]:
    """`python -m services.cli serve` (the demo model unless `flags` say otherwise) from the repository's root,
    its HTTP API on a free loopback port; yields that API's root URL once /health names a model, and stops the
    process after. Its output goes to a temporary log, named when it fails to start."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="raincheck-serve-", suffix=".log")[1])
    with log.open("wb") as out:       # the child holds its own copy of the file
        process = subprocess.Popen([python, "-m", "services.cli", "serve", "--port", "0", "--http-port", str(port),
                                    "--metrics-port", "-1", *flags], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _serving(url):
            if process.poll() is not None:
                raise RuntimeError(f"raincheck serve exited with {process.returncode}; its log: {log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"raincheck serve was not ready in {timeout_s:.0f} s; its log: {log}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def _serving(url: str) -> bool:
    try:
        return bool(json.load(urllib.request.urlopen(url + "/health", timeout=5)).get("models"))
    except OSError:         # not listening yet, or 503 until a worker serves
        return False
