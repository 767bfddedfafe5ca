"""One Engine and the sessions it holds: open, turn, cancel, close, status, load; the engine's background
stepping (post-answer recovery in idle gaps; the recovery backends are polled between steps)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

from raincheck_client._gen import chat_pb2
from raincheck_core import Engine, RaincheckError, SessionClosedError
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.errors import RankFailedError

from .._gen import worker_pb2
from ..common.logs import bind
from ..common.metrics import (
    AHEAD_VOID_ROWS,
    DEFERRED_PENDING,
    ENCODER_BYTES,
    ENCODER_HITS,
    KV_USAGE,
    PREFIX_PAGES,
    SESSIONS,
    STEP_COST_DRIFT,
    STEPS_AHEAD,
)
from ..common.recovery_modes import MODES
from ..common.settings import WorkerSettings
from . import chats, completions
from .convert import from_deferral, to_deferral, to_mode
from .eviction import admit
from .recovery import ColocatedRecovery, RecoveryBackend
from .sessions import WorkerSession
from .special_tokens import keep_special_tokens
from .turns import run_turn, start_turn

log = logging.getLogger(__name__)
DRAIN_POLL_S = 0.05
STEP_IDLE_S = 0.05      # how often the idle background stepper looks for work it was not woken for


class ModeUnavailableError(RaincheckError):
    """The session asked for a recovery mode this worker does not offer."""


class SessionExistsError(RaincheckError):
    """A session with this id is already open here."""


class DrainingError(RaincheckError):
    """The worker is shutting down: it takes no new sessions or turns (the frontend goes elsewhere)."""


class WorkerRuntime:
    def __init__(self, engine: Engine, settings: WorkerSettings, worker_id: str,
                 backends: list[RecoveryBackend] | None = None):
        self.engine = engine
        self.settings = settings
        self.worker_id = worker_id
        self.default_deferral = DeferralConfig(policy=settings.default_policy, tpot_slo=settings.tpot_slo or None,
                                               barrier_timeout_s=settings.barrier_timeout_s,
                                               deterministic=settings.deterministic)
        self.sessions: dict[str, WorkerSession] = {}
        self._lock = threading.Lock()
        self.colocated = ColocatedRecovery(lambda: self.engine.wake())     # the engine may be replaced
        offered = [self.colocated] if "colocated" in settings.recovery_modes else []
        self.backends: dict[str, RecoveryBackend] = {b.mode: b for b in [*offered, *(backends or [])]}
        self.on_change: Callable[[], None] = lambda: None   # load changed (the registration refreshes)
        # the engine's tensor-parallel ranks failed (once, with why): the worker cannot serve any more
        self.on_rank_failure: Callable[[str], None] = lambda why: None
        self.rank_failure: str | None = None
        self.draining = False
        self.encoder_hits = 0        # the encoder cache's hits already counted in ENCODER_HITS
        # … and the steps planned ahead in STEPS_AHEAD, their void rows in AHEAD_VOID_ROWS
        self.ahead_counted = {"launched": 0, "dropped": 0, "void_rows": 0}
        self.steps = 0
        self._turn_rpcs = 0                                  # Turn RPCs still streaming (recovery followed too)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        for backend in self.backends.values():
            backend.start()
        self.engine.start_background(self._after_step, idle_wait_s=STEP_IDLE_S)

    def drain(self, timeout_s: float) -> bool:
        """Refuse new sessions and turns, and wait (up to `timeout_s`) until the running turns' streams
        have ended and no session has deferred tokens left. True if all finished."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while (busy := self._busy()) and time.monotonic() < deadline:
            time.sleep(DRAIN_POLL_S)
        if busy:
            log.warning("drain: %d turn streams and %d deferred tokens left after %.1fs", *busy, timeout_s)
        return not busy

    def _busy(self) -> tuple[int, int] | None:
        with self._lock:
            streams = self._turn_rpcs
        pending = self.stats().deferred_pending_tokens
        return (streams, pending) if streams or pending else None

    def stop(self) -> None:
        self.engine.close()       # its worker ranks, if it started any, exit
        for session_id in list(self.sessions):
            self.close(session_id)
        for backend in self.backends.values():
            backend.stop()
        for gauge in (DEFERRED_PENDING, SESSIONS, KV_USAGE, PREFIX_PAGES, ENCODER_BYTES, STEP_COST_DRIFT):
            gauge.remove(self.worker_id)

    def replace_engine(self, load: Callable[[], Engine]) -> Engine:
        """Serve the engine `load()` makes instead of the current one, whose tensor-parallel ranks failed:
        the old engine's sessions are closed (the server marked them for takeover first: frontends rebuild
        them from their turn logs) and its remaining ranks stopped, before the new one loads (its ranks
        start afresh, its memory is free). Turns are refused until the new engine is in place; if `load`
        raises, the worker stays failed."""
        self.engine.close()
        for session_id in list(self.sessions):
            self.close(session_id)
        engine = self.engine = load()
        self.encoder_hits = 0
        self.ahead_counted = {"launched": 0, "dropped": 0, "void_rows": 0}
        engine.start_background(self._after_step, idle_wait_s=STEP_IDLE_S)
        self.rank_failure = None
        self.on_change()
        return engine

    # ---------------------------------------------------------------- sessions
    def open(self, request: worker_pb2.OpenSessionRequest) -> WorkerSession:
        self._check_serving()
        deferral = to_deferral(request.deferral, self.default_deferral)
        mode = to_mode(request.recovery_mode)
        if mode not in self.backends:
            raise ModeUnavailableError(f"worker {self.worker_id} does not offer {mode} recovery "
                                       f"(it offers: {', '.join(self.backends)})")
        ws = admit(self, lambda: self._open(request, deferral, mode))
        bind(log, session_id=ws.id).info("session opened (%s, %s recovery, %d turns to replay)",
                                         deferral.policy, mode, len(ws.history))
        self.on_change()
        return ws

    def _open(self, request: worker_pb2.OpenSessionRequest, deferral: DeferralConfig, mode: str) -> WorkerSession:
        with self._lock:
            if request.session_id in self.sessions:
                raise SessionExistsError(f"session {request.session_id} is already open on worker {self.worker_id}")
            session = self.engine.open_session(session_id=request.session_id or None, deferral=deferral)
            ws = WorkerSession(session, mode, request.owner, list(request.history))
            self.sessions[session.id] = ws
        return ws

    def get(self, session_id: str) -> WorkerSession:
        ws = self.sessions.get(session_id)
        if ws is None:
            raise SessionClosedError(f"session {session_id} is not open on worker {self.worker_id}")
        return ws

    def close(self, session_id: str) -> None:
        with self._lock:
            ws = self.sessions.pop(session_id, None)
        if ws is None:
            raise SessionClosedError(f"session {session_id} is not open on worker {self.worker_id}")
        self.backends[ws.recovery_mode].forget(ws)
        ws.session.close()
        bind(log, session_id=session_id).info("session closed")
        self.on_change()

    def cancel(self, session_id: str) -> bool:
        ws = self.get(session_id)
        with ws.lock:
            running = ws.active
        ws.session.cancel()
        return running

    def reap_idle(self) -> None:
        """Close sessions without a turn for `session_idle_s` (their store records expire too)."""
        cutoff = time.monotonic() - self.settings.session_idle_s
        for session_id, ws in list(self.sessions.items()):
            if not ws.active and ws.last_used < cutoff:
                bind(log, session_id=session_id).info("closing idle session")
                self.close(session_id)

    # ---------------------------------------------------------------- turns
    def turn(self, request: worker_pb2.TurnRequest, alive: Callable[[], bool]
             ) -> tuple[Iterator[chat_pb2.ChatEvent], Callable[[], None]]:
        """Admit the turn now (typed errors raise here). Returns its event stream, and the callback for
        the end of the RPC streaming it: that cancels the turn if it still runs (the client went away)."""
        self._check_serving()
        ws = self.get(request.session_id)
        backend = self.backends[ws.recovery_mode]
        stream = admit(self, lambda: start_turn(self.engine, ws, request, self.settings.max_new_tokens), ws.id)
        backend.turn_started(ws)
        with self._lock:
            self._turn_rpcs += 1
        self.engine.wake()
        self.on_change()

        def rpc_ended() -> None:
            ws.release(stream)
            with self._lock:
                self._turn_rpcs -= 1
            self.on_change()

        return keep_special_tokens(self.engine, request.sampling, run_turn(ws, stream, request, backend, alive)), \
            rpc_ended

    def complete(self, request: chat_pb2.CompleteRequest) -> Iterator[chat_pb2.ChatEvent]:
        """A completion outside sessions (completions.py): checked and admitted now, run by the returned
        stream."""
        self._check_serving()
        answer = chats.complete_chat if chats.renders_here(request) else completions.complete
        events = answer(self.engine, request, self.settings.max_new_tokens, lambda action: admit(self, action))
        return keep_special_tokens(self.engine, request.sampling, events)

    def _check_serving(self) -> None:
        if self.draining:
            raise DrainingError(f"worker {self.worker_id} is shutting down")
        if self.rank_failure is not None:
            raise RankFailedError(f"worker {self.worker_id} cannot serve: {self.rank_failure}")

    # ---------------------------------------------------------------- status
    def describe(self, ws: WorkerSession) -> worker_pb2.WorkerSession:
        pending = self.backends[ws.recovery_mode].pending(ws)
        status = (chat_pb2.SESSION_STATUS_STREAMING if ws.active else
                  chat_pb2.SESSION_STATUS_RECOVERING if pending else chat_pb2.SESSION_STATUS_IDLE)
        return worker_pb2.WorkerSession(
            session_id=ws.id, status=status, turns=ws.session.turns, pending_deferred_tokens=pending,
            cached_tokens=ws.session.cached_tokens, recovery_mode=MODES[ws.recovery_mode],
            deferral=from_deferral(ws.session.deferral),
        )

    def stats(self) -> worker_pb2.WorkerStats:
        pool = self.engine.pool_stats()
        sessions = list(self.sessions.values())
        return worker_pb2.WorkerStats(
            worker_id=self.worker_id, sessions=len(sessions), active_turns=sum(ws.active for ws in sessions),
            deferred_pending_tokens=sum(self.backends[ws.recovery_mode].pending(ws) for ws in sessions),
            total_pages=pool.total_pages, free_pages=pool.free_pages, page_size=pool.page_size,
            recovery_modes=[MODES[m] for m in self.backends],
        )

    def _after_step(self) -> None:
        if self.rank_failure is None and (why := self.engine.rank_failure) is not None:
            self.rank_failure = why
            self.on_rank_failure(why)
        for backend in self.backends.values():
            backend.poll()
        sessions = list(self.sessions.values())
        DEFERRED_PENDING.labels(self.worker_id).set(sum(self.backends[ws.recovery_mode].pending(ws)
                                                        for ws in sessions))
        SESSIONS.labels(self.worker_id).set(len(sessions))
        pool = self.engine.pool_stats()
        KV_USAGE.labels(self.worker_id).set(pool.usage)
        PREFIX_PAGES.labels(self.worker_id).set(pool.cached_pages)
        self.steps += 1
        if self.steps % 32 == 1:    # it moves slowly, and reading the windows' medians is not free
            STEP_COST_DRIFT.labels(self.worker_id).set(self.engine.step_costs.drift())
        ahead = self.engine.ahead_counts
        counters = {"launched": STEPS_AHEAD.labels("launched"), "dropped": STEPS_AHEAD.labels("dropped"),
                    "void_rows": AHEAD_VOID_ROWS}
        for outcome, counter in counters.items():
            counter.inc(getattr(ahead, outcome) - self.ahead_counted[outcome])
            self.ahead_counted[outcome] = getattr(ahead, outcome)
        encoder = self.engine.encoder_cache_stats()
        if encoder is not None:
            ENCODER_HITS.inc(encoder.hits - self.encoder_hits)
            self.encoder_hits = encoder.hits
            ENCODER_BYTES.labels(self.worker_id).set(encoder.bytes)

