"""A step as plain data: which rows of which sessions run, where their K/V go, what each may read.

The scheduler builds a `StepPlan` (deciding and claiming slots, changing nothing else); the model
runner turns it into tensors and runs the forward; the update applies the results and says what
happened; the engine core settles that (ends, fails, finishes). A segment names its session by id and
carries slot lists, row counts and flags only, so a plan can be built and checked without a model
(tests/engine/test_scheduler.py), dropped when its forward fails (`cancel`), split into passes, and
compared with a reference. What a segment's rows *are* (their embeddings, the join's recorded factors
and maps) the engine core puts in the segment just before its forward (`EngineCore.resolve`): the runner
reads the plan and the pools, never a session.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import numpy as np

    from ..deferral.handoff import ResidualResult
    from ..multimodal.turn_input import TurnInput


class Kind(StrEnum):
    PREFILL = "prefill"        # a running turn's input rows (I0)
    DECODE = "decode"          # a running turn's one generated-token row
    VERIFY = "verify"          # a running turn's last generated token and k draft tokens (speculation)
    DEFERRED = "deferred"      # deferred rows fused into their turn's decode step (raincheck)
    RECOVERY = "recovery"      # deferred rows after the answer (idle gaps, the barrier)
    RESIDUAL = "residual"      # rows prefilled outside a turn (a hand-off on a deferred worker, a scratch forward)
    HANDOFF = "handoff"        # deferred rows a deferred worker prefilled, joined from its result (a step of its own)
    PADDING = "padding"        # rows that only fill a bucketed step to its bucket (engine/padding.py)


# rows that are not a running turn's input or answer
CHUNKS = (Kind.DEFERRED, Kind.RECOVERY, Kind.RESIDUAL, Kind.HANDOFF)
RESTORING = (Kind.DEFERRED, Kind.RECOVERY, Kind.HANDOFF)    # rows of a recovery's D
ANSWERING = (Kind.DECODE, Kind.VERIFY)                       # a decoding turn's rows: one per turn and step
# rows whose read list is the first slots of their session's page table (engine/segment_claims.py takes it
# from `readable(n)`, no turn's labels filtering it): FlexAttention's layout reads their pages off each
# page's first slot instead of every slot (ops/flex_runs.py); a deferred chunk's list is those less the
# positions its segment's `read_skips` holds
TABLE_PREFIX = (Kind.PREFILL, Kind.DECODE, Kind.VERIFY, Kind.RESIDUAL)


@dataclass(frozen=True, eq=False)
class JoinInputs:
    """What the forward of a chunk that joins reads of its turn's GDN join (docs/mechanism.md §5), taken
    just before it runs, after the join's buffered factors were folded into P_rest."""

    lead_u: torch.Tensor           # [layers, lead, conv dim]: the recorded lead, appended to the chunk
    lead_g: torch.Tensor           # [layers, lead, H]
    lead_beta: torch.Tensor        # [layers, lead, H]
    p_rest: torch.Tensor           # [layers, H, Dk, Dk] fp32: the correction's map
    s_lead: torch.Tensor           # [layers, H, Dk, Dv] fp32: the correction's reference
    in_lead: bool                  # the turn has not generated its whole conv lead: the live conv history
                                   # still reaches back across the insertion boundary, so it is replaced too


@dataclass(frozen=True)
class Tracking:
    """What the forward of tracked rows needs of the pending GDN joins their tokens extend: which rows'
    states the lead records, and whether v is kept."""

    lead: int                      # lead tokens the session's oldest pending join still lacks: the first
                                   # `lead` rows of a multi-row run keep the state after them
    in_lead: bool                  # some pending join lacks lead tokens: a one-row run keeps u and its state
    audit: bool                    # some pending join keeps every token's factors (v too)


@dataclass(frozen=True)
class AttentionSegments:
    """A step's rows as attention sees them (`StepPlan.attention_segments`), per attention segment."""

    q_lens: list[int]
    reads: list[torch.Tensor]
    prefixes: list[bool | np.ndarray]
    pages: list[np.ndarray | None]


@dataclass(eq=False)
class Segment:
    """Contiguous rows of one session in the packed step. Build it with the constructor of its kind."""

    kind: Kind
    session: str                          # the session (engine core id) whose rows these are
    rows: int
    write_slots: torch.Tensor             # [rows] claimed KV slots
    read_slots: torch.Tensor              # slots the rows may read, own last (bottom-right causal)
    gdn_slot: int | None                  # the state the rows start from and advance
    first: int = 0                        # rows [first, first + rows) of the session's rows of this kind
    token: int | None = None              # a decode row's input token and position (a verify segment's first)
    position: int = 0
    drafts: tuple[int, ...] = ()          # a verify segment's draft tokens, its rows after the first
    sample: bool = False                  # the turn samples its next token from the last row's logits
    tracked: bool = False                 # a decode, verify or input row while a GDN join is pending: its
                                          # (kept) tokens extend the join's map (and complete its lead)
    serial: bool = False                  # a deferred chunk run in a pass before the rest (fused=False, or
                                          # ahead of a follow-up's input on a GDN model)
    lead: int = 0                         # a chunk with a GDN join: lead rows appended
    checkpoints: tuple[int, ...] = ()     # a prefill's rows after which the prefix cache keeps the GDN state
    splits: tuple[int, ...] = ()          # a prefill's rows where its attention runs as separate segments
                                          # (a prefix hit resumes there: `attention_segments`)
    live_slot: int | None = None          # … and the live state the join corrects
    read_skips: np.ndarray | None = None  # a deferred chunk's: the positions of its session's slots up to its
                                          # last that `read_slots` leaves out (its turn's generated ones)
    read_pages: np.ndarray | None = None  # a decode row's: its page table's pages (int64), of which `read_slots`
                                          # spans the first ones (FlexAttention's layout reads them here)
    # what the rows are, put in by the engine core just before the forward (`EngineCore.resolve`)
    source: TurnInput | None = None       # the rows [first, first + rows) are of (not a decode, padding or
                                          # hand-off row's)
    result: ResidualResult | None = None  # a hand-off: the deferred worker's result, which holds D's rows from
                                          # its own `first` on (K/V, and the prefix state after D)
    join_inputs: JoinInputs | None = None     # a chunk that joins: what its forward reads of the join
    tracking: Tracking | None = None      # tracked rows: what their forward needs of the joins they extend

    def resolved(self, source: TurnInput | None, result: ResidualResult | None, join_inputs: JoinInputs | None,
                 tracking: Tracking | None) -> Segment:
        """A copy holding what the engine core read of its session (`EngineCore.resolve`); the plan keeps
        its own. The fields are copied as they are: `dataclasses.replace` would run each through `__init__`
        again, ~5x the cost, once per tracked decode row and step."""
        copy = object.__new__(Segment)
        copy.__dict__.update(self.__dict__, source=source, result=result, join_inputs=join_inputs, tracking=tracking)
        return copy

    @property
    def joins(self) -> bool:
        """A deferred chunk whose GDN state change is joined into its turn's live state."""
        return self.live_slot is not None

    @classmethod
    def prefill(cls, session: str, first: int, rows: int, write: torch.Tensor, read: torch.Tensor,
                gdn_slot: int | None, last: bool, tracked: bool = False, checkpoints: tuple[int, ...] = (),
                splits: tuple[int, ...] = ()) -> Segment:
        """Input rows [first, first + rows) of the session's running turn; `last`: they end its input."""
        return cls(Kind.PREFILL, session, rows, write, read, gdn_slot, first=first, sample=last, tracked=tracked,
                   checkpoints=checkpoints, splits=splits)

    @classmethod
    def decode(cls, session: str, token: int, position: int, write: torch.Tensor, read: torch.Tensor,
               gdn_slot: int | None, tracked: bool, pages: np.ndarray | None = None) -> Segment:
        """`pages`: `read_pages`."""
        return cls(Kind.DECODE, session, 1, write, read, gdn_slot, token=token, position=position, sample=True,
                   tracked=tracked, read_pages=pages)

    @classmethod
    def verify(cls, session: str, token: int, drafts: tuple[int, ...], position: int, write: torch.Tensor,
               read: torch.Tensor, gdn_slot: int | None, tracked: bool = False) -> Segment:
        """A decode row followed by `drafts` (docs/mechanism.md §13): rows `token, *drafts` at positions
        `position, position + 1, ...`, causal among themselves; every row's logits are kept. On a GDN
        model the state after each row but the last is kept too (`checkpoints`): the update commits the
        one after the last accepted row. `tracked`: a GDN join of the session is pending, and the kept
        rows extend it (never a step where a chunk of the session joins: §13)."""
        rows = 1 + len(drafts)
        return cls(Kind.VERIFY, session, rows, write, read, gdn_slot, token=token, position=position, sample=True,
                   drafts=drafts, checkpoints=tuple(range(rows - 1)) if gdn_slot is not None else (), tracked=tracked)

    @property
    def tokens(self) -> tuple[int, ...]:
        """A decode or verify segment's input tokens."""
        return (self.token, *self.drafts)

    @property
    def logit_rows(self) -> int:
        """How many of its rows' logits the step keeps: every verify row, a sampling segment's last."""
        return self.rows if self.kind is Kind.VERIFY else int(self.sample)

    @classmethod
    def fused(cls, session: str, first: int, rows: int, write: torch.Tensor, read: torch.Tensor,
              prefix_slot: int | None, lead: int, live_slot: int | None, skips: np.ndarray | None = None,
              serial: bool = False) -> Segment:
        """Deferred rows [first, first + rows) riding on their turn's decode step (`skips`: `read_skips`)."""
        return cls(Kind.DEFERRED, session, rows, write, read, prefix_slot, first=first, lead=lead, live_slot=live_slot,
                   serial=serial, read_skips=skips)

    @classmethod
    def post_answer(cls, session: str, first: int, rows: int, write: torch.Tensor, read: torch.Tensor,
                    prefix_slot: int | None, lead: int, live_slot: int | None, skips: np.ndarray | None = None,
                    serial: bool = False) -> Segment:
        """Deferred rows [first, first + rows) after the answer (a gap, the barrier, ahead of a follow-up's
        input; `skips`: `read_skips`)."""
        return cls(Kind.RECOVERY, session, rows, write, read, prefix_slot, first=first, lead=lead, live_slot=live_slot,
                   serial=serial, read_skips=skips)

    @classmethod
    def residual(cls, session: str, first: int, rows: int, write: torch.Tensor, read: torch.Tensor,
                 gdn_slot: int | None) -> Segment:
        """Rows [first, first + rows) of a scratch session's rows (no turn, no join)."""
        return cls(Kind.RESIDUAL, session, rows, write, read, gdn_slot, first=first)

    @classmethod
    def handoff(cls, session: str, first: int, rows: int, write: torch.Tensor, read: torch.Tensor,
                prefix_slot: int | None, lead: int, live_slot: int | None, skips: np.ndarray | None = None
                ) -> Segment:
        """Deferred rows [first, first + rows) whose K/V and prefix state come from a deferred worker's
        result (`read`: what they saw there): the forward runs none of them, only the join (the lead
        re-run from the result's prefix state)."""
        return cls(Kind.HANDOFF, session, rows, write, read, prefix_slot, first=first, lead=lead, live_slot=live_slot,
                   read_skips=skips)

    @classmethod
    def padding(cls, rows: int, slot: torch.Tensor, gdn_slot: int | None) -> Segment:
        """Rows of no session that fill a step to its bucket: they write and read one scratch KV `slot` no
        session reads, start from (and their state is written to) a scratch GDN slot, sample nothing, and
        the update never sees them (engine/padding.py)."""
        slots = slot.reshape(1).expand(rows)
        return cls(Kind.PADDING, "", rows, slots, slots, gdn_slot)


@dataclass
class StepPlan:
    segments: list[Segment] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.segments)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    def sessions(self) -> list[str]:
        """The sessions in this step, in order, once each."""
        return list(dict.fromkeys(s.session for s in self.segments))

    def rows_of(self, *kinds: Kind) -> int:
        return sum(s.rows for s in self.segments if s.kind in kinds)

    def count(self, kind: Kind) -> int:
        return sum(1 for s in self.segments if s.kind is kind)

    def fingerprint(self) -> int:
        """A digest of what the step runs (kinds, counts, slots, tokens, flags; not session ids, which
        each process draws itself): tensor-parallel ranks compare it before a forward, so ranks whose
        schedulers diverged fail with a typed error instead of mixing each other's collectives."""
        digest = 0
        for s in self.segments:
            head = (s.kind.value, s.rows, s.first, s.token, s.drafts, s.position, s.gdn_slot, s.sample, s.tracked,
                    s.serial, s.lead, s.live_slot, s.splits)
            digest = zlib.crc32(repr(head).encode(), digest)
            for slots in (s.write_slots, s.read_slots):
                digest = zlib.crc32(slots.to(device="cpu", dtype=torch.int64).numpy().tobytes(), digest)
        return digest

    def attention_segments(self) -> AttentionSegments:
        """The step's rows as attention sees them: each segment's row count, readable slots, how those
        relate to its page table (ops/flex_runs.py `Prefix`: its first slots (`TABLE_PREFIX`), those less
        `read_skips`, or neither) and the table's pages where the segment carries them (`read_pages`), a
        prefill with `splits` as one segment per piece (a piece reads what a step starting there would: the
        slots before it and its own, bottom-right causal)."""
        q_lens, reads, prefixes, pages = [], [], [], []
        for s in self.segments:
            prefix = s.read_skips if s.read_skips is not None else s.kind in TABLE_PREFIX
            if not s.splits:        # most segments (every decode row): one piece, its whole read list
                q_lens.append(s.rows)
                reads.append(s.read_slots)
                prefixes.append(prefix)
                pages.append(s.read_pages)
                continue
            cuts = (0, *s.splits, s.rows)
            for a, b in itertools.pairwise(cuts):
                q_lens.append(b - a)
                reads.append(s.read_slots[:len(s.read_slots) - (s.rows - b)])
                prefixes.append(prefix)
                pages.append(s.read_pages)
        return AttentionSegments(q_lens, reads, prefixes, pages)

    def passes(self) -> list[StepPlan]:
        """Serial comparison mode (`DeferralConfig.fused=False`), or a chunk ahead of a follow-up's input on
        a GDN model: those chunks run in a pass of their own before the rest. Otherwise one pass."""
        serial = [s for s in self.segments if s.serial]
        if not serial:
            return [self]
        return [StepPlan(serial), StepPlan([s for s in self.segments if not s.serial])]
