"""Bucketed decode steps: a decode step padded to a fixed shape, so that one captured graph
(engine/graphs.py) serves every step of that shape.

A bucket is (decoding sessions, fused deferred rows per session): the decode rows are padded to a power
of two and each session's chunk to one of `CHUNK_BUCKETS` rows. Padding rows are segments of no session
(`Segment.padding`): they write one scratch KV slot that no session reads and are attended by none,
start from a scratch GDN state and write theirs back to it (the rows that fill a session's chunk run
idle in that chunk's GDN sequence instead: engine/gdn_inputs.py), and sample nothing; the runner runs
the padded plan and the update applies what it returns to the plan as scheduled, so no session sees a
padding row. A padded step's shapes are its bucket's alone (`Padded`), so that a session's last, shorter
chunk runs as every other step of its bucket. Only decode steps are bucketed (decode rows and at most
one fused chunk per decoding session); prefill of any length, post-answer chunks and serial passes run
as planned.

The padding is the same code on every device: the CPU tests run a padded step eagerly and compare it
with the unpadded one (tests/engine/test_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.gdn_state import GDNStatePool
from ..cache.kv_pool import KVPool
from ..ops.flex_groups import bucket as flex_bucket
from ..ops.flex_layout import FixedGroups
from .plan import Kind, Segment, StepPlan

CHUNK_BUCKETS = (0, 7, 15, 31, 63)     # fused deferred rows per session of a captured step


@dataclass(frozen=True)
class Bucket:
    decode: int      # decode rows: decoding sessions, padded to a power of two
    chunk: int       # fused deferred rows per session: one of CHUNK_BUCKETS

    @property
    def rows(self) -> int:
        return self.decode * (1 + self.chunk)


@dataclass(frozen=True)
class Scratch:
    """Where padding rows go: a KV slot (of a page the runner holds) and a GDN slot, or None."""

    kv_slot: torch.Tensor       # [1]
    gdn_slot: int | None

    @classmethod
    def reserve(cls, kv: KVPool, gdn: GDNStatePool | None) -> Scratch:
        """Takes one KV page and one GDN slot out of the pools for as long as the runner lives."""
        page = kv.allocate(1)[0]
        return cls(torch.tensor([page * kv.page_size]), gdn.allocate() if gdn is not None else None)


def decode_bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def chunk_bucket(rows: int) -> int | None:
    """The smallest chunk bucket holding `rows`, or None when none does."""
    return next((c for c in CHUNK_BUCKETS if c >= rows), None)


def bucket_of(plan: StepPlan) -> Bucket | None:
    """The bucket of a decode step (decode rows and fused chunks, at most one per decoding session, of at
    most the largest chunk bucket); None for any other step (it runs as planned)."""
    decoding: list[str] = []
    chunks: list[str] = []
    longest = 0
    for s in plan.segments:       # one pass: a decode step has a segment per session (64 or more)
        if s.kind is Kind.DECODE:
            decoding.append(s.session)
        elif s.kind is Kind.DEFERRED:
            chunks.append(s.session)
            longest = max(longest, s.rows)
        else:
            return None
    if not decoding or len(set(chunks)) < len(chunks) or not set(decoding).issuperset(chunks):
        return None
    chunk = chunk_bucket(longest)
    return None if chunk is None else Bucket(decode_bucket(len(decoding)), chunk)


@dataclass(frozen=True)
class Padded:
    """A decode step padded to its bucket, with what fixes its shapes to the bucket's (engine/graphs.py
    takes a step's shapes for its graph): the attention groups (`FixedGroups`: `bucket.decode` decode rows
    in the one-row group, as many chunks in the chunk bucket's group; padding rows attended by none) and,
    for the GDN layers (engine/gdn_inputs.py), which padding segment fills which chunk."""

    plan: StepPlan
    bucket: Bucket
    groups: FixedGroups
    fills: dict[int, int]       # plan index of a chunk of fewer rows than the bucket's -> its fill's


def pad(plan: StepPlan, bucket: Bucket, scratch: Scratch) -> Padded:
    """`plan` (of `bucket`) with padding segments after its own: each decoding session's chunk filled to
    `bucket.chunk` rows, then decode rows (each with a chunk of `bucket.chunk` rows) up to
    `bucket.decode`. The result has exactly `bucket.rows` rows."""
    chunk_at = {s.session: i for i, s in enumerate(plan.segments) if s.kind is Kind.DEFERRED}
    decoding = [s.session for s in plan.segments if s.kind is Kind.DECODE]
    chunk_q = flex_bucket(bucket.chunk)
    query = [1 if s.kind is Kind.DECODE else chunk_q for s in plan.segments]
    extra: list[Segment] = []
    fills: dict[int, int] = {}

    def fill(rows: int) -> None:
        if rows:
            extra.append(Segment.padding(rows, scratch.kv_slot, scratch.gdn_slot))
            query.append(0)

    for sid in decoding:
        rows = bucket.chunk - (plan.segments[chunk_at[sid]].rows if sid in chunk_at else 0)
        if sid in chunk_at and rows:
            fills[chunk_at[sid]] = len(query)
        fill(rows)
    for _ in range(bucket.decode - len(decoding)):
        fill(1)
        fill(bucket.chunk)
    groups = FixedGroups(query, {1: bucket.decode, **({chunk_q: bucket.decode} if bucket.chunk else {})})
    return Padded(StepPlan([*plan.segments, *extra]), bucket, groups, fills)
