"""Which decoding turns verify draft tokens in a step, and which (docs/mechanism.md §13): the scheduler
asks for each decoding turn's drafts; a turn with none decodes one row as usual. A turn whose session has
a GDN join pending verifies tracked: its kept rows extend the join (engine/update.py)."""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Protocol

from ..speculative.drafter import Drafter

if TYPE_CHECKING:
    from ..deferral.recovery import Recovery

log = logging.getLogger(__name__)


class DraftingCache(Protocol):
    session: str
    recovery: Recovery | None     # None: no recovery pending (nor queued behind one)

    def recoveries(self) -> list[Recovery]: ...


def join_pending(cache: DraftingCache) -> bool:
    """A GDN join of the session is pending: its decode rows are tracked (they extend the join's map)."""
    # most sessions have no recovery: a decode row asks once a step, so that case reads one attribute
    return cache.recovery is not None and any(not r.done and r.join is not None for r in cache.recoveries())


class DraftingTurn(Protocol):
    """What speculation reads of a decoding turn (the scheduler's `TurnView` has it)."""

    cache: DraftingCache

    @property
    def draft_room(self) -> int: ...

    def history(self) -> list[int]: ...


class Speculation:
    def __init__(self, drafter: Drafter, num_tokens: int, vocab_size: int):
        self.drafter = drafter
        self.num_tokens = num_tokens
        self.vocab_size = vocab_size

    def drafts(self, req: DraftingTurn, limit: int) -> tuple[int, ...]:
        """At most `limit` draft tokens for `req`'s next decode step (fewer where its length limit is near).
        Whether the step carries them, beside or instead of a deferred chunk, is the scheduler's choice
        (engine/draft_choice.py)."""
        k = min(self.num_tokens, req.draft_room, limit)
        if k <= 0:
            return ()
        try:
            drafts = [int(t) for t in self.drafter.propose(req.cache.session, req.history(), k)[:k]]
        except Exception:   # drafts only save steps: a drafter that fails costs its turn nothing else
            log.exception("the drafter failed; this step decodes without drafts")
            return ()
        # a token the model cannot embed ends the drafts
        return tuple(itertools.takewhile(lambda t: 0 <= t < self.vocab_size, drafts))
