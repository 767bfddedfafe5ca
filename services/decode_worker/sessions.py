"""A session as the worker holds it: the engine session plus serving state (mode, running turn, history)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from raincheck_core import Session
from raincheck_core.engine import TurnStream

from .._gen import worker_pb2


@dataclass
class WorkerSession:
    session: Session
    recovery_mode: str                                  # colocated | disaggregated
    owner: str = ""                                     # the API key id it belongs to ("": no auth)
    history: list[worker_pb2.HistoryTurn] = field(default_factory=list)   # re-prefilled by the next turn
    stream: TurnStream | None = None                    # the latest turn
    active: bool = False                                # a turn is streaming
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def id(self) -> str:
        return self.session.id

    def release(self, stream: TurnStream) -> None:
        """The RPC streaming `stream` is over (finished, failed or abandoned): undo the turn if it is still
        running (its client never saw it end, and its frontend never logged it: the session must hold
        what its turn log holds, which a rebuild replays), and free the session for its next turn. A
        no-op once a newer turn has started."""
        with self.lock:
            if self.stream is not stream:
                return
            if stream.end is None:
                self.session.abort()
            self.active = False
            self.last_used = time.monotonic()
