"""The drafter an engine's `SpeculativeConfig` asks for."""

from __future__ import annotations

from ..errors import InvalidInputError
from .config import SpeculativeConfig
from .drafter import Drafter
from .ngram import NgramDrafter


def speculative_drafter(config: SpeculativeConfig, given: Drafter | None = None) -> Drafter | None:
    """`given` if the caller built one (an MTP head loaded with the checkpoint), else the n-gram drafter
    for method "ngram"; None with speculation off. Method "mtp" without a drafter is a typed error: the
    head is part of the checkpoint, so only loading the checkpoint can supply it."""
    if not config.enabled:
        return None
    if given is not None:
        return given
    if config.method == "ngram":
        return NgramDrafter(config)
    raise InvalidInputError(f"speculative method {config.method!r} needs a drafter loaded with the checkpoint "
                            "(Engine.from_pretrained loads the MTP head)")
