"""What the scheduler reads of sessions and turns (`CacheView`, `TurnView`), and the one constructor per
segment kind that claims a segment's slots from its session's cache (engine/scheduler.py decides how many
rows of which kind a step takes; these build them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from .plan import Kind, Segment
from .speculation import join_pending
from .step_sessions import ScratchWork

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ..deferral.recovery import Recovery


class CacheView(Protocol):
    """What the scheduler reads of a session's cache (engine/session_cache.py), and the one thing it
    changes: the slots it claims for the step it plans (dropped again if the step fails)."""

    session: str
    gdn_slot: int | None
    next_position: int
    recovery: Recovery | None
    length: int                 # slots filled
    deterministic: bool

    def claim(self, n: int, turn: int | None = None, generated: bool = False) -> torch.Tensor: ...

    def readable(self, n: int) -> torch.Tensor: ...

    @property
    def pages(self) -> np.ndarray: ...

    def deferred_readable(self, n: int, turn: int) -> tuple[torch.Tensor, np.ndarray]: ...

    def recoveries(self) -> list[Recovery]: ...


class TurnView(Protocol):
    """What the scheduler reads of a running turn (engine/request.py)."""

    cache: CacheView
    cursor: int
    turn: int                 # the session's turn index
    tpot_slo: float | None
    step_tokens: int          # tokens its latest decode step emitted (several after a verify)
    drafts_accepted: int      # over the turn (engine/draft_choice.py: its acceptance rate)
    drafts_tried: int

    @property
    def decoding(self) -> bool: ...

    @property
    def input_remaining(self) -> int: ...

    @property
    def boundaries(self) -> list[int]: ...      # rows of its input where a message or visual ends

    @property
    def answer_fed(self) -> int: ...

    @property
    def last_token(self) -> int: ...

    @property
    def draft_room(self) -> int: ...     # draft tokens a verify step may carry (engine/speculation.py)

    def history(self) -> list[int]: ...

    def slack_s(self, plain_step_s: float) -> float: ...

    def charge(self, seconds: float, plain_step_s: float) -> None: ...


def prefill_segment(req: TurnView, n: int, checkpoints: tuple[int, ...] = (), splits: tuple[int, ...] = ()
                    ) -> Segment:
    cache = req.cache
    write = cache.claim(n)
    rec = cache.recovery     # a previous turn's join still pending: these rows extend its recorded suffix
    tracked = rec is not None and rec.turn < req.turn and rec.join is not None
    return Segment.prefill(cache.session, req.cursor, n, write, cache.readable(n), cache.gdn_slot,
                           last=n == req.input_remaining, tracked=tracked, checkpoints=() if tracked else checkpoints,
                           splits=splits)


def scratch_segment(work: ScratchWork, n: int) -> Segment:
    cache = work.cache
    write = cache.claim(n)
    return Segment.residual(cache.session, work.cursor, n, write, cache.readable(n), cache.gdn_slot)


def decode_segment(req: TurnView) -> Segment:
    cache = req.cache
    tracked = join_pending(cache)
    write = cache.claim(1, generated=True)
    return Segment.decode(cache.session, req.last_token, cache.next_position, write, cache.readable(1),
                          cache.gdn_slot, tracked=tracked, pages=cache.pages)


def verify_segment(req: TurnView, drafts: tuple[int, ...]) -> Segment:
    cache = req.cache
    rows = 1 + len(drafts)
    write = cache.claim(rows, generated=True)     # draft rows are generated rows: deferred rows never read them
    return Segment.verify(cache.session, req.last_token, drafts, cache.next_position, write, cache.readable(rows),
                          cache.gdn_slot, tracked=join_pending(cache))


def deferred_segment(cache: CacheView, n: int, kind: Kind, ahead: bool = False) -> Segment:
    """`n` deferred rows of the cache's recovery from its cursor, fused (`kind` DEFERRED), after the answer
    (RECOVERY) or joined from a deferred worker's result (HANDOFF): they read what their labels allow, run
    on the prefix GDN state, and (GDN models) carry the turn's conv lead for the join. `ahead`: they go
    ahead of the session's follow-up input in this step."""
    rec = cache.recovery
    write = cache.claim(n, rec.turn)
    read, skips = cache.deferred_readable(n, rec.turn)
    join = rec.join
    prefix, lead, live = (join.prefix, join.lead_rows, join.live) if join is not None else (None, 0, None)
    if kind is Kind.DEFERRED:
        return Segment.fused(cache.session, rec.cursor, n, write, read, prefix, lead, live, skips,
                             serial=not rec.cfg.fused)
    if kind is Kind.HANDOFF:
        return Segment.handoff(cache.session, rec.cursor, n, write, read, prefix, lead, live, skips)
    # ahead of its session's input in the same step: a GDN join must correct the live state before the
    # input runs from it, so the chunk takes a pass of its own (attention needs none: K/V go in first)
    return Segment.post_answer(cache.session, rec.cursor, n, write, read, prefix, lead, live, skips,
                               serial=ahead and join is not None)
