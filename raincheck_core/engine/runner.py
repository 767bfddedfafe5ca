"""Turns a step's work into forward batches, runs the decoder, and hands each turn its logits.

A step's work is a list of pieces, each one sequence's contiguous rows: a prefill chunk, a decode
row, a deferred chunk. A deferred chunk goes right before its session's decode row (MECHANISM.md §6:
within each layer the chunk's K/V and GDN join happen before the decode row reads them). Fused, all
pieces share one forward (weights read once); serial mode runs deferred pieces in a pass of their own
first, for comparison.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cache.gdn_state import GDNStatePool
from ..cache.kv_pool import KVPool
from ..layers.batch import ForwardBatch, Segment
from ..models import DecoderLM
from .request import TurnRequest
from .scheduler import Work
from .turn_input import TurnInput


@dataclass
class Piece:
    n: int
    positions: torch.Tensor                      # [3, n]
    segment: Callable[[int], Segment]            # claims the rows' slots; called in batch order
    after: Callable[[], None]                    # advances cursors once the forward ran
    embeds: torch.Tensor | None = None           # [n, hidden]; None: a decode row (token below)
    token: int | None = None
    deepstack_rows: torch.Tensor | None = None   # rows within the piece that receive DeepStack
    deepstack: list[torch.Tensor] = field(default_factory=list)
    sample: TurnRequest | None = None            # the turn that samples from the piece's last row
    deferred: bool = False


def _input_piece(source: TurnInput, first: int, n: int, **kw) -> Piece:
    """Rows `[first, first + n)` of an input (a turn's I0 or its deferred rows D)."""
    sel = (source.deepstack_index >= first) & (source.deepstack_index < first + n)
    ds_rows, ds = None, []
    if source.deepstack and bool(sel.any()):
        ds_rows = source.deepstack_index[sel] - first
        ds = [level[sel.to(level.device)] for level in source.deepstack]
    return Piece(n, source.positions[:, first:first + n], embeds=source.embeds[first:first + n],
                 deepstack_rows=ds_rows, deepstack=ds, **kw)


class ModelRunner:
    def __init__(self, model: DecoderLM, kv: KVPool, gdn: GDNStatePool | None):
        self.model = model
        self.kv = kv
        self.gdn = gdn

    def run(self, work: list[Work]) -> None:
        pieces: list[Piece] = []
        for item in work:
            if item.recovery is not None and item.deferred:
                pieces.append(self._deferred_piece(item))
            if item.request is not None:
                item.request.restoring = item.deferred > 0
                pieces.append(self._request_piece(item.request, item.rows))
        serial = any(p.deferred for p in pieces) and any(
            item.recovery is not None and item.deferred and not item.recovery.cfg.fused for item in work)
        if serial:
            self._forward([p for p in pieces if p.deferred])
            self._forward([p for p in pieces if not p.deferred])
        else:
            self._forward(pieces)

    # ---------------------------------------------------------------- pieces
    def _request_piece(self, req: TurnRequest, n: int) -> Piece:
        seq = req.seq
        req.mark_started()
        if not req.decoding:
            first = req.cursor
            done = first + n == len(req.input)
            return _input_piece(req.input, first, n, segment=lambda row: seq.add_rows(row, n),
                                after=lambda: req.advance(n), sample=req if done else None)
        rec = req.recovery
        tracking = rec is not None and not rec.done
        join = rec.join if tracking else None

        def after() -> None:
            req.advance(1)
            if join is not None:
                join.advance()

        pos = torch.full((3, 1), seq.next_position, dtype=torch.long)
        return Piece(1, pos, token=req.last_token, sample=req, after=after, segment=lambda row: seq.add_rows(
            row, 1, generated=tracking, gdn_hook=join.after_generated if join is not None else None))

    def _deferred_piece(self, item: Work) -> Piece:
        rec, seq, n = item.recovery, item.seq, item.deferred
        first = rec.cursor
        slot = rec.join.prefix if rec.join is not None else None
        hook = rec.join.after_chunk if rec.join is not None else None

        def segment(row: int) -> Segment:
            seg = seq.add_deferred_rows(row, n, slot, hook)
            rec.slots.append(seg.write_slots)
            return seg

        return _input_piece(rec.rows, first, n, deferred=True, after=lambda: rec.advance(n), segment=segment)

    # ---------------------------------------------------------------- one forward
    def _forward(self, pieces: list[Piece]) -> None:
        if not pieces:
            return
        embeds: list[torch.Tensor | None] = []
        segments, logit_rows, samplers, ds_rows, ds_feats = [], [], [], [], []
        decode_at, decode_tokens = [], []
        row = 0
        for p in pieces:
            if p.embeds is None:
                decode_at.append(len(embeds))
                decode_tokens.append(p.token)
            embeds.append(p.embeds)
            segments.append(p.segment(row))
            if p.deepstack_rows is not None:
                ds_rows.append(p.deepstack_rows + row)
                ds_feats.append(p.deepstack)
            if p.sample is not None:
                logit_rows.append(row + p.n - 1)
                samplers.append(p.sample)
            row += p.n
        if decode_tokens:
            ids = torch.tensor(decode_tokens, dtype=torch.long, device=self.model.embed_tokens.weight.device)
            with torch.inference_mode():
                rows = self.model.embed_tokens(ids)
            for at, e in zip(decode_at, rows.split(1), strict=True):
                embeds[at] = e
        batch = ForwardBatch(
            embeds=torch.cat(embeds), positions=torch.cat([p.positions for p in pieces], dim=1),
            segments=segments, kv=self.kv, gdn=self.gdn,
            logit_rows=torch.tensor(logit_rows, dtype=torch.long),
            deepstack_rows=torch.cat(ds_rows) if ds_rows else None,
            deepstack=[torch.cat(level) for level in zip(*ds_feats, strict=True)] if ds_feats else [],
        )
        with torch.inference_mode():
            logits = self.model(batch)
        for p in pieces:
            p.after()
        for req, row_logits in zip(samplers, logits, strict=True):
            req.on_logits(row_logits)


