"""How a session's deferred tokens get prefilled after its answer: one `RecoveryBackend` per recovery mode.

`colocated` (here): the worker's own engine finishes them in idle gaps (its background stepping).
`disaggregated` (disaggregated_recovery.py): ships the residual to Ray deferred workers (docs/mechanism.md
§8) and joins what comes back.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..common.metrics import RECOVERY_BYTES, RECOVERY_LATENCY

if TYPE_CHECKING:
    from .sessions import WorkerSession


class RecoveryBackend(ABC):
    """Completes sessions' post-answer deferred prefill for one recovery mode.

    Contract:
    - `start()` / `stop()` bracket the worker's life.
    - `turn_started(ws)` is called right after each turn of a session in this mode is admitted.
    - `answer_done(ws)` is called once per turn, by the thread that streamed it, right after the
      turn's end (before the session is free for its next turn), when `ws.session.pending_deferred > 0`.
      The backend then owns finishing that remainder. It must return quickly (the stream is still open).
      A turn whose stream is abandoned or fails may end without this call.
    - The session's next turn passes the engine's completion barrier (`Session.turn` finishes any
      remainder locally before it starts), so a backend must always leave the session completable by
      the local engine: if a remote worker fails or times out, the recovery is not lost.
    - `pending(ws)` must be side-effect free and callable from any thread at any time (progress
      events, GetSession, gauges).
    - `forget(ws)` is called when the session closes: drop any in-flight work for it.
    - `poll()` is called by the engine's background stepping thread between steps (and while idle).
    - `watch(on_change)` is called once, before `start()`, with the callback that reports the mode's health.
    - Observe `RECOVERY_LATENCY` (answer end -> complete) and `RECOVERY_BYTES` (shipped both ways)
      once per completed recovery, labelled with `mode`.
    """

    mode: str

    def start(self) -> None:  # noqa: B027 (an optional hook)
        """Before the worker serves."""

    def stop(self) -> None:  # noqa: B027 (an optional hook)
        """After the worker's sessions are closed."""

    def turn_started(self, ws: WorkerSession) -> None:  # noqa: B027 (an optional hook)
        """A turn of `ws` was admitted."""

    def poll(self) -> None:  # noqa: B027 (an optional hook)
        """Between engine steps."""

    def watch(self, on_change: Callable[[bool], None]) -> None:  # noqa: B027 (an optional hook)
        """`on_change(up)` whenever the mode becomes usable as designed (True) or degraded (False, recoveries
        then finish locally). A mode that cannot degrade never calls it."""

    @abstractmethod
    def answer_done(self, ws: WorkerSession) -> None: ...

    def pending(self, ws: WorkerSession) -> int:
        """The session's deferred tokens not yet prefilled: the engine's count, wherever they are recovered."""
        return ws.session.pending_deferred

    @abstractmethod
    def forget(self, ws: WorkerSession) -> None: ...


class ColocatedRecovery(RecoveryBackend):
    """The engine finishes the remainder itself: background stepping runs its prefill-only chunks whenever
    the engine has nothing else to do (the scheduler also fits them into other turns' steps)."""

    mode = "colocated"

    def __init__(self, wake: Callable[[], None]):
        self.wake = wake
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[WorkerSession, float]] = {}   # session id -> (session, answer end)

    def answer_done(self, ws: WorkerSession) -> None:
        with self._lock:
            self._waiting[ws.session.id] = (ws, time.perf_counter())
        self.wake()

    def forget(self, ws: WorkerSession) -> None:
        with self._lock:
            self._waiting.pop(ws.session.id, None)

    def poll(self) -> None:
        """Observe the recoveries that have completed (called between background steps)."""
        now = time.perf_counter()
        with self._lock:
            done = [(sid, t) for sid, (ws, t) in self._waiting.items() if ws.session.pending_deferred == 0]
            for sid, _ in done:
                del self._waiting[sid]
        for _, t in done:
            RECOVERY_LATENCY.labels(self.mode).observe(now - t)
            RECOVERY_BYTES.labels(self.mode).observe(0)
