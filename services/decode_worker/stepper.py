"""The worker's background engine loop: steps while there is work, sleeps otherwise.

Turns are driven by the threads streaming them (the engine steps for whoever waits on a turn); this
thread keeps stepping as well, so that a session's post-answer recovery proceeds in idle gaps, when no
turn is waiting, instead of at its next turn's barrier.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from raincheck_core import Engine

log = logging.getLogger(__name__)


class Stepper:
    def __init__(self, engine: Engine, after_step: Callable[[], None], idle_wait_s: float = 0.05):
        self.engine = engine
        self.after_step = after_step
        self.idle_wait_s = idle_wait_s
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raincheck-stepper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stopping.is_set():
            stepped = False
            try:
                if self.engine.scheduler.has_work():
                    stepped = self.engine.step()
                self.after_step()
            except Exception:   # keep the worker alive; the failing turn gets the error from the engine
                log.exception("background engine step failed")
            if not stepped:
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
