"""The decode worker's Ray driver: a process of its own (`python -m services.deferred_worker.driver FD`,
started by bridge.py), so that losing Ray never takes the decode worker down.

A Ray driver does not survive its Ray: when the raylet it is attached to goes, Ray ends the process
("connection to the plasma store is failed"), and when the GCS goes, Ray calls block for minutes. So the
decode worker runs none itself. This process attaches to Ray, keeps the deferred-worker pool (pool.py)
and forwards residuals over the socket pair inherited as file descriptor FD (channel.py). It exits
when Ray is lost (a Ray call stuck for `STUCK_S`, or Ray's own termination), when the decode worker
closes its end, or on `stop`; the decode worker then recovers locally and starts a new one.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

from ..common.logs import setup_logging
from ..common.settings import DeferredSettings, ModelSpec
from .channel import Channel
from .pool import DeferredPool, Job

log = logging.getLogger(__name__)
STUCK_S = 5.0         # a Ray call that takes this long means Ray is gone (every call the loop makes is short)
PROBE_S = 1.0         # while idle, how often the loop asks Ray something (so a lost Ray is noticed)
EXIT_RAY_LOST = 3


def main(argv: list[str]) -> int:
    _die_with_parent()
    channel = Channel(Connection(int(argv[0])))
    init = channel.recv()
    setup_logging(init["log_level"], init["log_json"])
    settings, spec = DeferredSettings(**init["settings"]), ModelSpec(**init["spec"])
    pool = DeferredPool(settings, spec, init["model"], channel.send)
    loop = _Loop(pool, channel)
    watchdog = threading.Thread(target=loop.watch, name="raincheck-ray-watchdog", daemon=True)
    watchdog.start()
    try:
        pool.attach()       # not watched: a local Ray takes a while to start (bridge.py bounds this)
    except Exception as e:
        log.error("cannot attach to Ray: %s", e)
        return EXIT_RAY_LOST
    channel.send({"op": "ready", "actors": len(pool.actors), "registered": pool.registered_actors()})
    threading.Thread(target=loop.read, name="raincheck-ray-channel", daemon=True).start()
    try:
        loop.run()
    except Exception:       # Ray's own errors once it is gone: nothing more to ask it
        log.exception("lost Ray")
        return EXIT_RAY_LOST
    loop.enter()
    pool.stop()
    return 0


class _Loop:
    """Every Ray call happens in `run`'s thread; `read` feeds it the decode worker's messages; `watch`
    ends the process when a Ray call has been stuck for STUCK_S."""

    def __init__(self, pool: DeferredPool, channel: Channel):
        self.pool = pool
        self.channel = channel
        self.inbox: queue.Queue[dict] = queue.Queue()
        self._since: float | None = None        # when the Ray call in progress began

    def enter(self) -> None:
        self._since = time.monotonic()

    def leave(self) -> None:
        self._since = None

    def read(self) -> None:
        while True:
            try:
                message = self.channel.recv()
            except (EOFError, OSError):       # the decode worker has gone
                message = {"op": "stop"}
            self.inbox.put(message)
            if message["op"] == "stop":
                return

    def run(self) -> None:
        probed = time.monotonic()
        while True:
            try:
                message = self.inbox.get(timeout=0.05 if self.pool.idle() else 0)
            except queue.Empty:
                message = None
            self.enter()
            if message is not None and not self._handle(message):
                self.leave()
                return
            moved = self.pool.turn()
            if not moved and time.monotonic() - probed > PROBE_S:
                self.pool.probe()
                probed = time.monotonic()
            self.leave()

    def _handle(self, message: dict) -> bool:
        op = message["op"]
        if op == "prefill":
            self.pool.submit(Job(message["id"], message["session"], message.get("actor"), message["request"]))
        elif op == "cancel":
            self.pool.cancel(message["id"])
        elif op == "forget":
            self.pool.forget(message["session"], message.get("actor"))
        elif op == "stats":          # may wait for busy actors: not a stuck call
            self.leave()
            self.channel.send({"op": "stats", "id": message["id"], **self.pool.stats()})
            self.enter()
        elif op == "stop":
            return False
        return True

    def watch(self) -> None:
        while True:
            time.sleep(STUCK_S / 5)
            since = self._since
            if since is not None and time.monotonic() - since > STUCK_S:
                log.error("a Ray call has not returned in %.0fs: Ray is gone", STUCK_S)
                os._exit(EXIT_RAY_LOST)


def _die_with_parent() -> None:
    """SIGKILL when the decode worker process ends (Linux), so no driver outlives it."""
    with contextlib.suppress(OSError):     # not Linux: the closed socket ends it instead
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
