"""The rows of a step packed in plan order (engine/runner.py `prepare`): their embeddings, 3-D positions,
DeepStack features, and which rows' logits and hidden states the step keeps.

A decode step is mostly answer rows (a decode row, a verify segment's rows) of many sessions side by
side: consecutive answer segments are packed as one run (one embedding lookup and one positions tensor
for the run), not a tensor per segment; the packed rows are the same."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from ..ops.int_lists import long_tensor
from ..ops.uploads import Uploads
from .padding import Padded
from .plan import ANSWERING, Kind, StepPlan

# the rows whose last-layer hidden states a drafter observes (`ModelRunner.keep_hidden`): a turn's input and
# answer rows, never deferred ones
KEPT = (Kind.PREFILL, *ANSWERING)


@dataclass
class PackedRows:
    embeds: torch.Tensor                    # [R, hidden]
    positions: torch.Tensor                 # [3, R], on the host
    starts: list[int]                       # each segment's first row
    logit_rows: list[int]                   # rows whose logits the step keeps
    hidden_rows: list[int]                  # rows whose final-norm hidden states it keeps (`KEPT`)
    deepstack_rows: torch.Tensor | None     # visual rows that receive DeepStack features
    deepstack: list[torch.Tensor]           # per level, [len(deepstack_rows), hidden]
    # staged: the decode and verify rows' input tokens in the host staging buffer, in plan order, which may be
    # rewritten until the step's copy (a step planned ahead: engine/ahead.py); None when looked up at once
    tokens: np.ndarray | None = None


@dataclass
class _Pieces:
    """A step's rows in pieces, before they are joined: a segment's rows, or an answer run's."""

    embeds: list[torch.Tensor | None] = field(default_factory=list)     # None for an answer run's (looked up)
    positions: list[torch.Tensor | list[int]] = field(default_factory=list)     # … its positions
    runs: list[int] = field(default_factory=list)                       # the pieces that are answer runs
    run_rows: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)                     # the answer runs' tokens, in order
    ds_rows: list[torch.Tensor] = field(default_factory=list)
    ds_feats: list[list[torch.Tensor]] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    hidden_rows: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)


def pack_rows(plan: StepPlan, embed: torch.nn.Module, keep_hidden: bool, padded: Padded | None = None,
              uploads: Uploads | None = None) -> PackedRows:
    """`plan`'s rows; `embed` looks up the answer rows' tokens (on its device), `keep_hidden`: list the
    `KEPT` rows, `padded`: `plan` is that padded step's (its DeepStack rows are as many as its bucket's).
    `uploads`: the step's staged copies (ops/uploads.py): the tokens go with them, looked up once they are
    sent, into rows made for them now; else they are copied and looked up at once."""
    p = _decode_rows(plan, keep_hidden) if all(s.kind is Kind.DECODE for s in plan.segments) else \
        _segment_rows(plan, embed, keep_hidden)
    embeds, positions, runs, run_rows, tokens = p.embeds, p.positions, p.runs, p.run_rows, p.tokens
    ds_rows, ds_feats = p.ds_rows, p.ds_feats
    if ds_rows and padded is not None:     # as many as the bucket's chunk rows: zeros added to row 0
        n = padded.bucket.decode * padded.bucket.chunk - sum(len(r) for r in ds_rows)
        ds_rows.append(torch.zeros(n, dtype=torch.long))
        ds_feats.append([level.new_zeros(n, level.shape[1]) for level in ds_feats[0]])
    staged = bool(tokens) and uploads is not None
    if tokens:
        # staged: rows the lookup fills once the step's copy has sent the ids (below)
        looked_up = embed.weight.new_empty(len(tokens), embed.weight.shape[1]) if staged else \
            _look_up(embed, long_tensor(tokens, embed.weight.device))
        # one run (a step of answer rows only, as most decode steps are): nothing to split
        for at, e in zip(runs, looked_up.split(run_rows) if len(runs) > 1 else (looked_up,), strict=True):
            embeds[at] = e
            positions[at] = long_tensor(positions[at]).expand(3, -1)
    packed = _joined(embeds)
    host_tokens = None
    if staged:      # into the packed rows themselves: the join above copied what the runs held then
        if len(embeds) == 1:        # the step is one answer run (a decode step): its rows are the packed ones
            targets = [packed]
        else:
            offsets = np.cumsum([0, *(e.shape[0] for e in embeds)])
            targets = [packed[offsets[at]:offsets[at] + n] for at, n in zip(runs, run_rows, strict=True)]
        ids, host_tokens = uploads.put_rewritable(np.array(tokens, dtype=np.int64))
        uploads.then(partial(_look_up_into, embed, ids, targets))
    return PackedRows(
        packed, _joined(positions, dim=1), p.starts, p.logit_rows, p.hidden_rows,
        torch.cat(ds_rows) if ds_rows else None,
        [torch.cat(level) for level in zip(*ds_feats, strict=True)] if ds_feats else [], host_tokens)


def _decode_rows(plan: StepPlan, keep_hidden: bool) -> _Pieces:
    """`_segment_rows` of a plain decode step (decode rows alone, a row each, every one sampling): one answer
    run, its lists read off the segments in a few comprehensions rather than a pass of a dozen steps a row."""
    segments = plan.segments
    n = len(segments)
    return _Pieces(embeds=[None], positions=[[s.position for s in segments]], runs=[0], run_rows=[n],
                   tokens=[s.token for s in segments], logit_rows=list(range(n)),
                   hidden_rows=list(range(n)) if keep_hidden else [], starts=list(range(n)))


def _segment_rows(plan: StepPlan, embed: torch.nn.Module, keep_hidden: bool) -> _Pieces:
    """The pieces of `plan`'s rows, segment by segment: consecutive answer segments as one run (`embed`: for
    padding rows' zeros)."""
    p = _Pieces()
    embeds, positions, runs, run_rows, tokens = p.embeds, p.positions, p.runs, p.run_rows, p.tokens
    ds_rows, ds_feats, logit_rows, hidden_rows, starts = p.ds_rows, p.ds_feats, p.logit_rows, p.hidden_rows, p.starts
    row = 0
    for seg in plan.segments:
        starts.append(row)
        if seg.kind in ANSWERING:      # text rows: positions run on from the turn's
            if not runs or runs[-1] != len(embeds) - 1:
                runs.append(len(embeds))
                run_rows.append(0)
                embeds.append(None)
                positions.append([])
            run_rows[-1] += seg.rows
            if seg.kind is Kind.DECODE:     # most rows of a decode step: one row, written out
                tokens.append(seg.token)
                positions[-1].append(seg.position)
                if seg.sample:
                    logit_rows.append(row)
                if keep_hidden:
                    hidden_rows.append(row)
                row += 1
                continue
            tokens += seg.tokens
            positions[-1] += range(seg.position, seg.position + seg.rows)
        elif seg.kind is Kind.PADDING:      # rows of no session (engine/padding.py)
            embeds.append(embed.weight.new_zeros(seg.rows, embed.weight.shape[1]))
            positions.append(torch.zeros((3, seg.rows), dtype=torch.long))
        else:
            src, first, n = seg.source, seg.first, seg.rows
            embeds.append(src.embeds[first:first + n])
            positions.append(src.positions[:, first:first + n].cpu())
            if src.deepstack:
                # the index is ascending and on the host (`TurnInput`): the segment's are a range of it, and
                # its features views of each level, with no index copied to the device nor read back
                index = src.deepstack_index
                lo, hi = torch.searchsorted(index, torch.tensor([first, first + n])).tolist()
                if hi > lo:
                    ds_rows.append(index[lo:hi] - first + row)
                    ds_feats.append([level[lo:hi] for level in src.deepstack])
        logit_rows += range(row + seg.rows - seg.logit_rows, row + seg.rows)
        if keep_hidden and seg.kind in KEPT:
            hidden_rows += range(row, row + seg.rows)
        row += seg.rows
    return p


def _look_up(embed: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():   # not inference mode: a step's inputs may become a graph's buffers, written later
        return embed(ids)


def _look_up_into(embed: torch.nn.Module, ids: torch.Tensor, targets: list[torch.Tensor]) -> None:
    """`embed(ids)` into `targets`, the answer runs' rows in order."""
    rows = _look_up(embed, ids)
    for target, part in zip(targets, rows.split([t.shape[0] for t in targets]), strict=True):
        target.copy_(part)


def _joined(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """`torch.cat(parts, dim)`, or the one part itself (no copy: the forward only reads its inputs)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
