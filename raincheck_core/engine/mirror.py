"""Worker ranks kept in step with rank 0, when the engine started its own ranks (parallel/workers.py).

Rank 0 is the engine the caller holds: its sessions, its streams, its background stepper. Each worker
rank holds a replica, the same engine over its own shard. Every call that changes rank 0's state is sent
to the replicas as it starts (`Mirror.call`, entered under the engine lock, so the replicas receive the
calls in the order rank 0 runs them), and a replica replays it with the same code (`replay_commands`).
Both ranks then run the same steps and meet in the same collectives. What a replica cannot know by
itself comes with the call (session ids, the rendered prompt with its visuals' embeddings, the sampling
seed) or from rank 0 during it (the clock, parallel/group.py `shared`: read as a collective inside a
replayed call only, so the scheduler decides alike); the plan digest compared before each forward catches
a replica that still diverged. Only calls are sent, never tensors of the step: the replicas' pools hold
other heads than rank 0's.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import RankFailedError
from ..parallel.group import RankGroup
from ..parallel.workers import WorkerRanks, next_command

# the facade (engine/engine.py), which no module of the engine package imports: a replica's calls are its
Engine = Any

log = logging.getLogger(__name__)


class Mirror:
    """Rank 0's side: sends each state-changing call to the worker ranks before it runs here."""

    def __init__(self, ranks: WorkerRanks):
        self.ranks = ranks
        self.failure: RankFailedError | None = None     # set once: the ranks are out of step for good
        self._inside = threading.local()

    def replaying(self) -> bool:
        """This thread runs a call the replicas replay (their clock reads pair with this thread's)."""
        return getattr(self._inside, "call", False)

    def fail(self, error: RankFailedError) -> None:
        if self.failure is None:
            log.error("tensor-parallel ranks failed; the engine cannot serve until it is restarted: %s", error)
            self.failure = error

    @contextmanager
    def call(self, op: str, *args: Any, required: bool = True) -> Iterator[None]:
        """Send `op(*args)` to the replicas, then run the body (call under the engine lock). A call inside
        another is not sent: the replica makes it itself while replaying the outer one. Once the ranks
        failed, a `required` call raises RankFailedError; another (closing, cancelling: local bookkeeping,
        no collective) runs here alone."""
        if self.replaying():
            yield
            return
        if self.failure is None:
            try:
                self.ranks.send(pickle.dumps((op, args)))
            except RankFailedError as e:
                self.fail(e)
        if self.failure is not None:
            if required:
                raise RankFailedError(f"the engine's ranks failed: {self.failure}") from self.failure
            yield
            return
        self._inside.call = True
        try:
            yield
        except RankFailedError as e:
            self.fail(e)
            raise
        finally:
            self._inside.call = False


def rank_clock(clock: Callable[[], float], tp: RankGroup | None, mirror: Mirror | None) -> Callable[[], float]:
    """`clock`, or on a tensor-parallel rank (`tp`) rank 0's reading of it: ranks must take the same
    scheduling decisions, which depend on measured times (parallel/group.py `shared`). Rank 0 of ranks it
    started (`mirror`) shares its readings inside the calls its replicas replay, and only there."""
    if tp is None:
        return clock
    shared = tp.shared(clock)
    if mirror is None:
        return shared
    return lambda: shared() if mirror.replaying() else clock()


def _session(engine: Engine, sid: str) -> Any:
    return engine.sessions[sid]


def _turn(engine: Engine, sid: str, prompt: Any, chat_level: bool, params: Any, cfg: Any, return_logits: bool) -> None:
    session = _session(engine, sid)
    constraints = [session.constraint(params, chat_level) for _ in range(params.n)]
    with engine.lock:
        session.admit(prompt, chat_level, params, cfg, constraints, return_logits)


def _step(engine: Engine, sid: str | None) -> None:
    engine.step(None if sid is None else engine.core.cache(sid))


def _set(name: str) -> Callable[..., None]:
    def put(engine: Engine, value: Any) -> None:
        setattr(engine, name, value)
    return put


# what a replica does for each call rank 0 sends (the sender names the op where it makes the call)
REPLAY: dict[str, Callable[..., Any]] = {
    "open_session": lambda e, sid, max_pages, deferral: e.open_session(max_pages=max_pages, session_id=sid,
                                                                       deferral=deferral),
    "close": lambda e, sid: _session(e, sid).close(),
    "turn": _turn,
    "step": _step,
    "end_read": lambda e, sid, turn: _session(e, sid).end_read(turn),
    "cancel": lambda e, sid: _session(e, sid).cancel(),
    "abort": lambda e, sid: _session(e, sid).abort(),
    "complete_recovery": lambda e, sid: _session(e, sid).complete_recovery(),
    "clear_caches": lambda e: e.clear_caches(),
    # the replica's clock reads rank 0's, whichever clock rank 0 reads: only the cost model starts afresh
    "use_clock": lambda e: e.use_clock(time.perf_counter),
    "prefill_alignment": _set("prefill_alignment"),
    "audit_gdn_join": _set("audit_gdn_join"),
    "use_step_graphs": lambda e, capture: e.use_step_graphs(capture),
    "hold_residual": lambda e, sid, fuse: e.hold_residual(_session(e, sid), fuse=fuse),
    "take_back": lambda e, sid, ticket: e.take_back(_session(e, sid), ticket),
    "export_residual": lambda e, sid, ticket, have: e.export_residual(_session(e, sid), ticket, have),
    "prefill_residual": lambda e, payload: e.prefill_residual(payload),
    "apply_residual": lambda e, sid, ticket, result: e.apply_residual(_session(e, sid), ticket, result),
    "forward_logits": lambda e, ids, embeds, positions, visual: e.forward_logits(
        ids, inputs_embeds=embeds, position_ids=positions, visual=visual),
}


def replay_commands(engine: Engine, commands: Any) -> None:
    """A worker rank's loop: replay rank 0's calls on `engine` until rank 0 stops it or is gone. A call
    that raises here raised on rank 0 too (the same state, the same code); a failed collective ends the
    loop, since rank 0 is gone or out of step."""
    while (message := next_command(commands)) is not None:
        op, args = pickle.loads(message)
        try:
            REPLAY[op](engine, *args)
        except RankFailedError:
            log.exception("rank %d: replaying %s failed; stopping", engine.model.tp.rank, op)
            return
        except Exception as e:      # rank 0 raised the same, and told its caller
            log.debug("replayed %s raised %s: %s", op, type(e).__name__, e)
        finally:
            _drop_events(engine)


def _drop_events(engine: Engine) -> None:
    """A replica's turns have no reader: the events they made are dropped (rank 0 hands out its own)."""
    for request in engine.core.turns.values():
        request.events.clear()
