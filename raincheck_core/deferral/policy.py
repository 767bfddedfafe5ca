"""Deferral policies (docs/mechanism.md §1) and their knobs, chosen per session and overridable per turn."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import InvalidInputError

POLICIES = ("full", "hard", "raincheck", "post_answer")
CHUNK_SIZES = (7, 15, 31, 63)   # + 1 decode row = 8/16/32/64 rows: fixed shapes for graph capture


@dataclass(frozen=True)
class DeferralConfig:
    """`full`: every token first. `hard`: unselected visual tokens dropped for good. `raincheck`:
    deferred, prefilled in chunks fused with decode after `guard` tokens, the rest after the answer.
    `post_answer`: deferred, prefilled only after the answer. All four use the same selection and the
    same position ids, so they differ only in what is present and visible.

    `tpot_slo` (raincheck): the allowed mean TPOT of the turn as a ratio of a plain decode step. The
    scheduler then picks per step whether to fuse and how many rows (a chunk bucket), from its measured
    step costs, and leaves what does not fit to post-answer recovery (docs/mechanism.md §7). None: no
    objective, every step past the guard fuses `chunk_size` rows (the paper's setting). A turn's
    objective also limits what other sessions fuse into the steps it shares.

    `barrier_timeout_s`: how long this turn waits at the completion barrier for the previous turn's
    deferred rows. None: until they are all in (the paper's policy). After that long (0: at once) the turn
    is admitted with the rest still pending, and they are restored during and after its answer with the
    cross-turn visibility of docs/mechanism.md §10.

    `deterministic`: the session's answers depend only on its own inputs: its steps never share a step
    with another session's rows (the scheduler takes turns between such sessions and everyone else), and
    its deferred chunks follow `chunk_size` instead of the objective (which reads measured step times).
    It costs that session's TPOT under load (docs/services.md, "Deterministic mode")."""

    policy: str = "full"
    selector: str = "divprune"
    selector_options: dict = field(default_factory=dict)
    retention: float = 0.3
    chunk_size: int = 31
    guard: int = 16
    fused: bool = True        # False: the chunk and the decode row run as two passes (for comparison)
    tpot_slo: float | None = 1.10
    barrier_timeout_s: float | None = None
    deterministic: bool = False

    def __post_init__(self) -> None:
        from ..pruning import SELECTORS, keep_count

        if self.policy not in POLICIES:
            raise InvalidInputError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.selector not in SELECTORS:
            raise InvalidInputError(f"unknown selector {self.selector!r}; choose one of {', '.join(SELECTORS)}")
        keep_count(1, self.retention)   # raises InvalidInputError outside (0, 1]
        if self.chunk_size not in CHUNK_SIZES:
            raise InvalidInputError(f"chunk_size must be one of {CHUNK_SIZES}, got {self.chunk_size}")
        if self.guard < 0:
            raise InvalidInputError(f"guard must be >= 0, got {self.guard}")
        if self.tpot_slo is not None and not (math.isfinite(self.tpot_slo) and self.tpot_slo >= 1.0):
            raise InvalidInputError(f"tpot_slo must be >= 1 (a ratio of the plain decode step) or None for "
                                    f"a fixed chunk size, got {self.tpot_slo}")
        if self.barrier_timeout_s is not None and not (math.isfinite(self.barrier_timeout_s)
                                                       and self.barrier_timeout_s >= 0):
            raise InvalidInputError(f"barrier_timeout_s must be >= 0 seconds, or None to wait for the previous "
                                    f"turn's recovery, got {self.barrier_timeout_s}")

    @property
    def objective(self) -> float | None:
        """The TPOT objective the scheduler applies: none for a deterministic session (fixed chunks)."""
        return None if self.deterministic else self.tpot_slo

    @property
    def needs_vision_signals(self) -> bool:
        """Selectors that read the vision tower's attention or features (pruning/*.py say which)."""
        return self.selects and self.selector in ("mmtok", "hiprune", "visionzip")

    @property
    def selects(self) -> bool:
        return self.policy != "full" and self.retention < 1.0

    @property
    def defers(self) -> bool:
        return self.selects and self.policy in ("raincheck", "post_answer")

    @property
    def fuses(self) -> bool:
        return self.selects and self.policy == "raincheck"
