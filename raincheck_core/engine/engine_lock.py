"""The engine lock: re-entrant, and the step loops let anyone already waiting for it go first.

The step loops (the background stepper, a consumer driving its own turn) release the lock between steps
and take it again at once. With a plain `threading.RLock` the releasing thread nearly always wins that
race, so a thread that wanted the lock for anything else (a new turn's admission, a session's close or
status) waited until the loops ran out of work: a new turn of one session waited for another session's
whole post-answer recovery. Here a step loop takes the lock through `for_step()`, which first waits
until no other thread is queued for it: such a thread waits for at most the step in progress. Step loops
among themselves still race as before (whoever steps, a step serves every running turn).

Whoever else takes the lock may change the sessions (admit, cancel, close): `on_hold` is called whenever a
thread takes it other than for a step (`for_step`) or to read the sessions or drive steps (`for_reading`), and
the engine drops the step it staged ahead there (engine/ahead.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class EngineLock:
    """`threading.RLock`'s interface (`acquire`, `release`, `with`), plus `for_step()` and `for_reading()`."""

    def __init__(self, on_hold: Callable[[], None] | None = None) -> None:
        self.on_hold = on_hold      # called on each hold that is not for stepping (the holder may change anything)
        self._lock = threading.RLock()
        self._state = threading.Condition(threading.Lock())
        self._waiting = 0                   # threads blocked in acquire()
        self._owner: int | None = None      # written only by the holder
        self._depth = 0

    @property
    def waiting(self) -> int:
        """Threads blocked in `acquire()` right now (step loops waiting in `for_step()` not counted)."""
        return self._waiting

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._acquire(blocking, timeout)
        if got and self._depth == 1 and self.on_hold is not None:
            self.on_hold()
        return got

    def _acquire(self, blocking: bool, timeout: float) -> bool:
        got = self._lock.acquire(blocking=False)
        if not got and blocking:
            with self._state:
                self._waiting += 1
            try:
                got = self._lock.acquire(timeout=timeout)
            finally:
                with self._state:
                    self._waiting -= 1
                    if not self._waiting:
                        self._state.notify_all()
        if got:
            self._held()
        return got

    def _held(self) -> None:
        self._owner = threading.get_ident()
        self._depth += 1

    def release(self) -> None:
        if self._owner != threading.get_ident():
            raise RuntimeError("cannot release a lock this thread does not hold")
        self._depth -= 1
        if not self._depth:
            self._owner = None
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    @contextmanager
    def for_reading(self) -> Iterator[None]:
        """Hold the lock as any caller waits for it (ahead of the step loops' `for_step`), changing no session
        but through steps: to read them (a session's status), or to drive steps (a consumer driving its own
        turn's: engine/stepper.py `drive`). Not a hold that calls `on_hold`."""
        self._acquire(True, -1)
        try:
            yield
        finally:
            self.release()

    @contextmanager
    def for_step(self) -> Iterator[None]:
        """Hold the lock for one step, after every thread already waiting for it has had it (unless this
        thread holds it already: a step inside a held lock, such as the completion barrier's)."""
        if self._owner != threading.get_ident():
            with self._state:
                while self._waiting:
                    self._state.wait()
        self._lock.acquire()        # not counted as waiting: step loops do not make each other wait
        self._held()
        try:
            yield
        finally:
            self.release()
