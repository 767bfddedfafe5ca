"""The GDN half of preparing a step (engine/runner.py `prepare`): from the plan's segments, where each
sits among the step's rows, to the `GDNStep` every GDN layer reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.gdn_state import GDNStatePool
from ..ops.backend import OpSet
from ..ops.gdn_layout import varlen_layout
from ..ops.gdn_rows import row_captures
from ..ops.gdn_step import AtRows, GDNCorrections, GDNMulti, GDNSingle, GDNStep
from ..ops.uploads import Uploads
from .padding import Padded
from .plan import Kind, Segment


@dataclass(eq=False, slots=True)     # not frozen: a frozen init costs 4x, and a step makes one per segment
class Placed:
    """A segment as the step's tensors hold it: where its rows start and which GDN group runs them."""

    segment: Segment
    start: int        # its first row among the step's rows
    multi: bool       # a multi-row GDN sequence (several rows, or a chunk that joins); else a one-row one
    idle: bool = False    # a padded step's fill of a chunk: idle rows of that chunk's sequence, none of its own


class DecodeSteps:
    """The GDN steps of steps of decode rows, kept for later steps that read the same pool rows.

    Such a step's metadata (sequences, kernel arguments) depends only on which pool rows its rows read
    (each writes its slot's other row), on which rows are tracked (they hand their factors to a pending
    join, docs/mechanism.md) and on the op set, and it holds nothing of the step it served past that step:
    no appended rows, no states at chosen rows; its outputs are in the pool or read within the step, and
    the factors its tracked rows collect are copied out by the runner (`ModelRunner.collect`) and cleared
    when the step is handed out again. A slot's rows alternate, so at a steady batch the same two steps
    come back in turn; up to `KEEP` are kept, the least recently used dropped first. Kept for tracked rows
    too: while a turn's deferred rows are pending, every decode step of the session has one, and building
    its metadata anew made a `bench` Qwen3.5 decode step ~5% slower (0.15-0.2 ms)."""

    KEEP = 4

    def __init__(self) -> None:
        self._kept: dict[tuple, GDNStep] = {}

    def step(self, placed: list[Placed], ops: OpSet, gdn: GDNStatePool, kernel: int, key_heads: int,
             device: torch.device, staged: bool = False) -> GDNStep:
        """`gdn_step(placed, ...)` for a step whose placed segments are all one-row decode rows, in order,
        padding rows among them (`plain_decode`: chunks and multi-row segments take `gdn_step` itself). A padded
        step's are as an unpadded one's: its padding only shapes multi-row sequences. `staged` (the GPU
        path): a new step's tensors go to the device in one copy of their own, in buffers that stay its."""
        tracked = tuple(p.segment.tracked for p in placed)
        key = (ops.gdn, kernel, key_heads, device, tracked, *gdn.rows(p.segment.gdn_slot for p in placed).read)
        step = self._kept.pop(key, None)
        if step is not None:
            step.out.factors.clear()        # the last use's, copied out by then
        else:
            own = Uploads(device).begin() if staged else None
            step = gdn_step(placed, ops, gdn, kernel, key_heads, device, uploads=own)
            if own is not None:
                own.send()
            if len(self._kept) >= self.KEEP:
                del self._kept[next(iter(self._kept))]
        self._kept[key] = step
        return step

    def forget(self, step: GDNStep | None) -> None:
        """`step` is no longer handed out: it became a graph's static buffers (engine/graphs.py), which
        later steps of its skeleton are copied into, so it would not keep the metadata of its rows."""
        for key in [k for k, kept in self._kept.items() if kept is step]:
            del self._kept[key]


def plain_decode(placed: list[Placed]) -> bool:
    """Whether a step's placed segments are decode rows only (tracked or not), and a padded step's padding
    rows (what `DecodeSteps` keeps)."""
    return all(p.segment.kind is Kind.DECODE
               or (p.segment.kind is Kind.PADDING and p.segment.rows == 1) for p in placed)


def gdn_step(placed: list[Placed], ops: OpSet, gdn: GDNStatePool, kernel: int, key_heads: int,
             device: torch.device, padded: Padded | None = None, uploads: Uploads | None = None) -> GDNStep:
    """The step's GDN groups from its placed segments: which pool rows each sequence reads and writes,
    deferred chunks with their turn's conv lead appended, the live states their joins correct, the
    decode rows seeded from a join, and the rows whose states are kept (`Segment.checkpoints`).

    `padded`: the segments are a padded step's, whose shapes its bucket fixes (engine/padding.py): each
    session's chunk runs as one sequence of the bucket's rows (the chunk, then its fill's rows, which are
    idle: `PackedSequences.live`) and, where it joins, a lead of `kernel - 1` rows (its turn's, then idle
    rows), so that the sequences' lengths, splits and appended rows do not follow the chunk's rows nor its
    turn's lead. The fills have no sequence of their own. `uploads`: the staged copies (ops/uploads.py) the
    layouts' tensors go by (the step's, or for a step `DecodeSteps` keeps, buffers of its own)."""
    dev = device
    multi = [p for p in placed if p.multi and not p.idle]
    fill_of = {} if padded is None else {placed[c]: placed[f] for c, f in padded.fills.items()}
    single = [p.segment for p in placed if not p.multi and not p.idle]
    joins = [p.segment for p in multi if p.segment.joins]
    step = GDNStep(gdn)
    seed_hist, seed_state = [-1] * len(single), [-1] * len(single)     # see GDNSingle.layout
    if multi:
        lengths, splits, source, live = [], [], [], []
        extra_u, extra_g, extra_b, join_seqs = [], [], [], []
        appended = 0
        # each sequence reads its slot's current row and writes the other; a joined chunk's state after
        # its lead (S_lead') has no slot and goes to the step's buffers, its state at the split (the new
        # prefix state) to its slot's other row
        rows = gdn.rows(p.segment.gdn_slot for p in multi)
        outs, split_outs = [], []
        for j, p in enumerate(multi):
            s = p.segment
            fill = fill_of.get(p)
            own = s.rows + (fill.segment.rows if fill is not None else 0)
            source.extend(range(p.start, p.start + s.rows))
            if fill is not None:
                source.extend(range(fill.start, fill.start + fill.segment.rows))
            live += [True] * s.rows + [False] * (own - s.rows)
            outs.append(-1 - len(join_seqs) if s.joins else rows.write[j])
            lead = s.lead if padded is None or not s.joins else kernel - 1
            lengths.append(own + lead)
            if s.joins:
                splits.append(own)
                split_outs.append(rows.write[j])
                join_seqs.append(j)
                if lead:
                    jn = s.join_inputs
                    source.extend(range(-1 - appended, -1 - appended - lead, -1))
                    live += [True] * s.lead + [False] * (lead - s.lead)
                    appended += lead
                    extra_u.append(_rows(jn.lead_u, lead))
                    extra_g.append(_rows(jn.lead_g, lead))
                    extra_b.append(_rows(jn.lead_beta, lead))
            else:
                splits.append(None)
        live_rows = gdn.rows(s.live_slot for s in joins).read
        step.multi = GDNMulti(varlen_layout(
            lengths, kernel, splits, device=dev, source=source, slots=rows.read,
            joins=list(zip(join_seqs, live_rows, strict=True)), out_rows=(outs, split_outs),
            live=live if padded is not None else None, uploads=uploads))
        if any(p.segment.checkpoints for p in multi):
            step.at_rows = AtRows(row_captures(step.multi.layout.seqs, [list(p.segment.checkpoints) for p in multi],
                                               kernel, device=dev), ops.gdn.varlen, key_heads)
        if joins:
            for j, k in enumerate(_decode_of(s, single) for s in joins):
                if k >= 0:
                    seed_state[k] = j
                    if joins[j].join_inputs.in_lead:
                        seed_hist[k] = j     # the joined chunk's history after its lead: buffer row j
            step.corrections = GDNCorrections(
                p=_batched([s.join_inputs.p_rest for s in joins]),
                s_ref=_batched([s.join_inputs.s_lead for s in joins]),
                extra_u=torch.cat(extra_u, dim=1) if extra_u else None,
                extra_g=torch.cat(extra_g, dim=1) if extra_g else None,
                extra_beta=torch.cat(extra_b, dim=1) if extra_b else None,
            )
    if single:
        rows = gdn.rows(s.gdn_slot for s in single)
        step.single = GDNSingle(
            layout=varlen_layout([1] * len(single), kernel, device=dev,
                                 source=[p.start for p in placed if not p.multi], slots=rows.read,
                                 seeds=(seed_hist, seed_state) if joins else None, out_rows=(rows.write, []),
                                 uploads=uploads),
            factors=any(s.tracked for s in single),
        )
    inputs = [p for p in multi if p.segment.tracked]     # input rows after a previous turn's pending join
    if inputs:
        rows = torch.cat([torch.arange(p.start, p.start + p.segment.rows) for p in inputs])
        step.input_rows = rows.to(dev) if uploads is None else uploads.put(rows)
    if uploads is not None:     # what the op will read, staged with the rest of the step
        for group, parts in zip((step.multi, step.single), ops.gdn.parts, strict=True):
            if group is not None:
                group.layout.lay_out(parts)
    step.op = ops.gdn.prepare(step, key_heads)
    return step


def _rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t [layers, n, ...]` with zero rows after its own up to `rows` (idle rows of a padded step's lead)."""
    if t.shape[1] == rows:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], rows - t.shape[1], *t.shape[2:])], dim=1)


def _batched(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Stacked, or a view of the one tensor (a lone join reads its P_rest without copying it)."""
    return tensors[0][None] if len(tensors) == 1 else torch.stack(tensors)


def _decode_of(chunk: Segment, single: list[Segment]) -> int:
    for k, s in enumerate(single):
        if s.kind is Kind.DECODE and s.session == chunk.session:
            return k
    return -1
