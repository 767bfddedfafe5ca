"""The decode worker's side of its Ray driver process (driver.py): start it, talk to it, start another
when it goes.

The decode worker never attaches to Ray itself: a Ray driver dies with its raylet and blocks on a dead
GCS, and a serving process must do neither. `RayBridge` runs the driver as a child process and sends it
residuals over a socket pair. While no driver is attached, `connected` is False and every request
fails at once with `DeferredWorkerError("ray_lost")` (the recovery backend then recovers locally);
when the driver goes, every request in flight fails the same way. A supervisor thread starts a new
driver after a pause (RETRY_MIN_S, doubling to RETRY_MAX_S), so the bridge reconnects by itself when
Ray comes back.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..common.logs import JsonFormatter
from ..common.settings import DeferredSettings, ModelSpec
from .channel import Channel
from .messages import PrefillReply, PrefillRequest

log = logging.getLogger(__name__)
RETRY_MIN_S = 1.0
RETRY_MAX_S = 10.0
STOP_WAIT_S = 30.0
# The directory holding this package, for the driver's (and a local Ray's workers') imports.
_ROOT = str(Path(__file__).resolve().parents[2])


class DeferredWorkerError(Exception):
    """A request the deferred workers did not answer. `reason`: ray_lost (no driver, or it went),
    worker_died, error (the actor raised)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class _Driver:
    """One driver process and its requests."""

    def __init__(self, settings: DeferredSettings, spec: ModelSpec, model: str):
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)}
        self.process = subprocess.Popen([sys.executable, "-m", f"{__package__}.driver", str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.channel = Channel(Connection(ours.detach()))
        self.pending: dict[int, tuple[Future, Callable[[dict], Any]]] = {}   # id -> (its future, reply -> result)
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.gone = threading.Event()
        self.info: dict = {}
        root = logging.getLogger()
        self.channel.send({"op": "init", "settings": asdict(settings), "spec": asdict(spec), "model": model,
                           "log_level": logging.getLevelName(root.getEffectiveLevel()),
                           "log_json": any(isinstance(h.formatter, JsonFormatter) for h in root.handlers)})

    def settled(self) -> bool:
        """Attached, or gone before it could."""
        return self.ready.is_set() or self.gone.is_set()

    def request(self, message: dict, future: Future, parse: Callable[[dict], Any]) -> None:
        with self.lock:
            if self.gone.is_set():
                raise DeferredWorkerError("ray_lost", "the Ray driver has gone")
            self.pending[message["id"]] = (future, parse)
        try:
            self.channel.send(message)
        except OSError as e:
            with self.lock:
                self.pending.pop(message["id"], None)
            raise DeferredWorkerError("ray_lost", f"the Ray driver has gone: {e}") from None

    def read(self, on_queue: Callable[[int], None]) -> None:
        """Until the driver's end closes: replies to their futures."""
        try:
            while True:
                message = self.channel.recv()
                op = message.pop("op")
                if op == "ready":
                    self.info = message
                    self.ready.set()
                elif op == "queue":
                    on_queue(message["depth"])
                else:
                    with self.lock:
                        future, parse = self.pending.pop(message["id"], (None, None))
                    if future is None or future.done():
                        continue
                    if message.get("ok", True):
                        future.set_result(parse(message))
                    else:
                        future.set_exception(DeferredWorkerError(message["reason"], message["message"]))
        except (EOFError, OSError):
            pass
        finally:
            self._fail_pending()
            on_queue(0)

    def _fail_pending(self) -> None:
        with self.lock:
            self.gone.set()
            pending, self.pending = self.pending, {}
        for future, _ in pending.values():
            if not future.done():
                future.set_exception(DeferredWorkerError("ray_lost", "the Ray driver has gone"))

    def stop(self, wait_s: float) -> None:
        try:
            self.channel.send({"op": "stop"})
            self.process.wait(timeout=wait_s)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class RayBridge:
    """`on_state(up)` is called when the driver attaches (True) or goes (False); `on_queue(depth)` when the
    number of residuals waiting for a free deferred worker changes."""

    def __init__(self, settings: DeferredSettings, spec: ModelSpec, model: str, attach_wait_s: float = 60.0,
                 attach_timeout_s: float = 120.0):
        self.settings = settings
        self.spec = spec
        self.model = model
        self.attach_wait_s = attach_wait_s
        self.attach_timeout_s = attach_timeout_s
        self.on_state: Callable[[bool], None] = lambda up: None
        self.on_queue: Callable[[int], None] = lambda depth: None
        self._ids = itertools.count(1)
        self._driver: _Driver | None = None        # attached and ready
        self._stopping = threading.Event()
        self._attached = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="raincheck-ray-bridge", daemon=True)

    @property
    def connected(self) -> bool:
        driver = self._driver
        return driver is not None and not driver.gone.is_set()

    def start(self) -> None:
        """Start the driver; wait up to `attach_wait_s` for it to attach (then serve anyway: requests fail
        over to local recovery until it does)."""
        self._thread.start()
        if not self._attached.wait(self.attach_wait_s):
            log.warning("Ray not reached within %gs: serving anyway, disaggregated recoveries finish locally "
                        "until it is", self.attach_wait_s)

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=STOP_WAIT_S + 10)

    def prefill(self, session_id: str, actor: str | None, request: PrefillRequest) -> Future:
        """Run `request` on `actor` (None: any). The future's result is the PrefillReply; it fails with
        DeferredWorkerError."""
        return self._request({"op": "prefill", "session": session_id, "actor": actor, "request": request.to_wire()},
                             PrefillReply.from_wire)

    def cancel(self, future: Future) -> None:
        """Drop interest in a request (the driver drops it unless it has started)."""
        driver = self._driver
        if driver is None:
            return
        with driver.lock:
            ids = [i for i, (f, _) in driver.pending.items() if f is future]
            for i in ids:
                del driver.pending[i]
        for i in ids:
            self._send({"op": "cancel", "id": i})

    def forget(self, session_id: str, actor: str | None) -> None:
        """The session closed: its actor may drop what it keeps for it."""
        self._send({"op": "forget", "session": session_id, "actor": actor})

    def stats(self, timeout_s: float = 60.0) -> dict:
        """The driver's view: `actors` (key, own, busy, pid, calls, ...), `queued`, `registered`."""
        return self._request({"op": "stats"}).result(timeout=timeout_s)

    def _request(self, message: dict, parse: Callable[[dict], Any] = lambda reply: reply) -> Future:
        future: Future = Future()
        driver = self._driver
        message["id"] = next(self._ids)
        try:
            if driver is None:
                raise DeferredWorkerError("ray_lost", "not attached to Ray")
            driver.request(message, future, parse)
        except DeferredWorkerError as e:
            future.set_exception(e)
        return future

    def _send(self, message: dict) -> None:
        driver = self._driver
        if driver is not None:
            with contextlib.suppress(OSError):      # gone: nothing left to tell it
                driver.channel.send(message)

    # ---------------------------------------------------------------- the driver's life
    def _supervise(self) -> None:
        delay = RETRY_MIN_S
        while not self._stopping.is_set():
            driver = _Driver(self.settings, self.spec, self.model)
            reader = threading.Thread(target=driver.read, args=(self.on_queue,), name="raincheck-ray-reader",
                                      daemon=True)
            reader.start()
            settled = driver.settled
            if self._wait(settled, self.attach_timeout_s) and driver.ready.is_set() and not driver.gone.is_set():
                log.info("attached to Ray: %d deferred workers (%s)", driver.info.get("actors", 0),
                         "registered" if driver.info.get("registered") else "own")
                self._driver = driver
                self._attached.set()
                self.on_state(True)
                delay = RETRY_MIN_S
                self._wait(driver.gone.is_set)
                self._driver = None
                self.on_state(False)
                if not self._stopping.is_set():
                    log.error("lost the Ray driver (exit code %s): disaggregated recovery is degraded, recoveries "
                              "finish locally; reconnecting", driver.process.poll())
            if self._stopping.is_set():
                driver.stop(STOP_WAIT_S)
            else:
                driver.kill()
            reader.join(timeout=5)
            if self._stopping.wait(delay):
                break
            delay = min(2 * delay, RETRY_MAX_S)

    def _wait(self, done: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Wait until `done()` (True), the bridge stops or `timeout_s` passes (False)."""
        waited = 0.0
        while not done():
            if self._stopping.wait(0.05):
                return False
            waited += 0.05
            if timeout_s is not None and waited > timeout_s:
                return False
        return True
