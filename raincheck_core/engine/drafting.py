"""The engine's drafter for speculative decoding (docs/mechanism.md §13): which drafter the engine runs,
what the scheduler drafts with (engine/speculation.py), and what the drafter is told when a session is
forgotten or undone. Kept apart from the core's transitions because drafts only save steps: a drafter
that fails is logged here and never fails a transition."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..errors import InvalidInputError
from ..speculative.config import SpeculativeConfig
from ..speculative.drafter import Drafter
from ..speculative.factory import speculative_drafter
from .speculation import Speculation

log = logging.getLogger(__name__)


class Drafting:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter | None, vocab_size: int):
        """`drafter`: what proposes draft tokens when `config` is on (default: the n-gram drafter for
        method "ngram"; an "mtp" drafter comes from the checkpoint, `Engine.from_pretrained`)."""
        self.drafter = speculative_drafter(config, drafter)
        self.num_tokens = config.num_tokens
        self.vocab_size = vocab_size

    @property
    def needs_hidden(self) -> bool:
        """The drafter reads the steps' last-layer hidden states (the runner keeps them)."""
        return self.drafter is not None and self.drafter.needs_hidden

    def initial(self) -> Speculation | None:
        """What the scheduler drafts with from start-up: the configured drafts, or none without a drafter."""
        return None if self.drafter is None else Speculation(self.drafter, self.num_tokens, self.vocab_size)

    def speculation(self, num_tokens: int | None) -> Speculation | None:
        """What the scheduler drafts with for up to `num_tokens` drafts per decode step (None: none)."""
        if num_tokens is not None and self.drafter is None:
            raise InvalidInputError("this engine was loaded without speculative decoding (EngineConfig.speculative)")
        return None if num_tokens is None else Speculation(self.drafter, num_tokens, self.vocab_size)

    def release(self, session: str) -> None:
        """The session is forgotten: the drafter drops what it holds of it."""
        self._tell(lambda d: d.release(session))

    def rollback(self, session: str, length: int) -> None:
        """The session was undone to `length` tokens: the drafter forgets what it saw past them."""
        self._tell(lambda d: d.rollback(session, length))

    def _tell(self, tell: Callable[[Drafter], None]) -> None:
        """`tell(drafter)`, if there is a drafter; its failure is logged, never raised: the engine's own state
        has changed already, and drafts only save steps."""
        if self.drafter is not None:
            try:
                tell(self.drafter)
            except Exception:
                log.exception("the drafter failed")
