"""Drafts from the checkpoint's own multi-token-prediction head (models/mtp.py), as vLLM's MTP method does.

`observe` runs the head over the rows the target kept (the target's hidden at row i with the embedding of
the token after it), writing the head's own K/V; the head's output at the last row drafts the token after
the session's last one. `propose(k)` chains the head: each further draft is one more row whose hidden is
the head's own output at the row before and whose token is the draft before, at the next position (vLLM
with one MTP layer chains it the same way); those rows' K/V are dropped once the drafts are out, since the
target's verified rows replace them. The head never sees deferred rows (the engine does not observe them)
nor rows the prefix cache resumed; that lowers acceptance, never correctness (speculative/drafter.py).

The head's K/V live in the drafter's own one-layer-per-MTP-layer page pool (cache/kv_pool.py) with one
`PageTable` per session: paged, but apart from the engine's pool, so the engine's admission does not count
these pages and the prefix cache does not share them. Where the pool runs short the session's rows are
forgotten (it drafts again once it has observed new ones).

Which session token each observed row stands for: the protocol gives rows in order, not their indices, and
deferred rows leave gaps. Each `propose` pins them: its history ends with the token after the last observed
row, so that row's index is len(history) - 2, and the rows observed since the previous `propose` get the
largest indices they can have (contiguous up to it: exact where no deferred row came between, too large
where one did). Rows observed after that get one past the row before (exact in decode, whose accepted rows
are contiguous). `rollback(length)` keeps the rows whose next token lies within the first `length` tokens
(index <= length - 2): where an index is too large it forgets a row it could have kept, which costs
acceptance, never an answer.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..cache.kv_pool import KVPool, PageTable
from ..config import EngineConfig
from ..errors import OutOfPagesError
from ..layers.batch import ForwardBatch
from ..models.decoder import DecoderLM
from ..models.mtp import MtpHead, load_mtp_head
from ..ops.backend import select


@dataclass
class Track:
    """What the drafter holds of one session."""

    table: PageTable                       # the head's K/V of the observed rows, in order
    index: list[int] = field(default_factory=list)   # each observed row's token index (module docstring)
    pinned: int = 0                        # rows whose index the last `propose` pinned (the rest: one past)
    next_index: int = 0                    # the next observed row's index, at least
    last: torch.Tensor | None = None       # the head's output at the last observed row (None: forgotten)
    last_token: int = -1                   # the token after the last observed row
    last_position: torch.Tensor | None = None   # its rope position [3]

    def forget_rows(self, keep: int) -> None:
        self.table.truncate(keep)
        del self.index[keep:]
        self.pinned = min(self.pinned, keep)
        self.next_index = self.index[-1] + 1 if keep else 0
        self.last = None

    def pin(self, last: int) -> bool:
        """The last observed row is token `last`: the rows since the last pin get the largest indices they
        can have. False where the rows cannot end there (more of them than tokens before it)."""
        rows = len(self.index)
        if self.index[-1] > last:
            return False
        self.index[self.pinned:] = range(last - (rows - 1 - self.pinned), last + 1)
        self.pinned, self.next_index = rows, last + 1
        return True


class MtpDrafter:
    """Implements `speculative.drafter.Drafter`. `target` lends its embedding and LM head; `num_pages` pages
    of `page_size` slots hold every session's head K/V (a session at most `max_pages_per_session`)."""

    needs_hidden = True

    def __init__(self, head: MtpHead, target: DecoderLM, num_pages: int, page_size: int = 16,
                 max_pages_per_session: int | None = None, backend: str = "native"):
        cfg = head.config
        param = head.fc.weight
        self.head, self.embed, self.lm_head = head, target.embed_tokens, target.lm_head
        self.device = param.device
        self.pool = KVPool(len(head.layers), num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, param.dtype,
                           param.device)
        self.max_pages = max_pages_per_session or num_pages
        self.ops = select(param.device, param.dtype, param.dtype, None, backend)
        self.tracks: dict[str, Track] = {}

    @classmethod
    def from_checkpoint(cls, folder: str | Path, target: DecoderLM, config: EngineConfig) -> MtpDrafter:
        """The drafter of the checkpoint's own head (NoMtpHeadError where it ships none) for an engine of
        `config` over `target`: its pool has the engine's pages (one layer per MTP layer, so a fraction
        of the engine's KV bytes), enough for every row the engine holds."""
        head = load_mtp_head(target.config, folder, config.device, config.torch_dtype)
        return cls(head, target, config.num_pages, config.page_size, config.max_pages_per_session, config.backend)

    @torch.no_grad()
    def observe(self, session: str, next_tokens: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None) -> None:
        n = next_tokens.shape[0]
        if n == 0 or hidden is None:
            return
        track = self.tracks.get(session)
        if track is None:
            track = self.tracks[session] = Track(PageTable(self.pool, self.max_pages))
        try:
            out = self._run(track.table, next_tokens, hidden, positions)
        except OutOfPagesError:
            # a drafter that sees less is still exact: start this session's rows afresh
            start = track.next_index
            track.forget_rows(0)
            track.next_index = start
            try:
                out = self._run(track.table, next_tokens, hidden, positions)
            except OutOfPagesError:
                track.next_index += n
                return
        track.index.extend(range(track.next_index, track.next_index + n))
        track.next_index += n
        track.last, track.last_token = out[-1], int(next_tokens[-1])
        track.last_position = positions[:, -1].to(self.device)

    @torch.no_grad()
    def propose(self, session: str, history: Sequence[int], k: int) -> list[int]:
        track = self.tracks.get(session)
        if (k <= 0 or track is None or track.last is None or not history or history[-1] != track.last_token
                or not track.pin(len(history) - 2)):
            return []       # the last observed row is not the one before the history's last token
        hidden, position = track.last, track.last_position
        drafts = [int(self.lm_head(hidden[None]).argmax(-1))]
        length = track.table.length
        try:
            while len(drafts) < k:
                position = position + 1      # a draft row is text: every rope axis moves on by one
                hidden = self._run(track.table, torch.tensor(drafts[-1:], device=self.device), hidden[None],
                                   position[:, None])[0]
                drafts.append(int(self.lm_head(hidden[None]).argmax(-1)))
        except OutOfPagesError:
            pass                              # the drafts so far stand
        finally:
            track.table.truncate(length)
        return drafts

    def rollback(self, session: str, length: int) -> None:
        track = self.tracks.get(session)
        if track is None:
            return
        keep = bisect.bisect_right(track.index, length - 2)
        if keep < len(track.index):
            track.forget_rows(keep)

    def release(self, session: str) -> None:
        track = self.tracks.pop(session, None)
        if track is not None:
            track.table.release()

    def _run(self, table: PageTable, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
             ) -> torch.Tensor:
        """The head over `n` new rows of `table`'s sequence (their K/V appended): its outputs `[n, d]`."""
        n, start = tokens.shape[0], table.length
        write = table.ahead(0, n)
        layout = self.ops.attention.layout([n], [table.reserved_slots(0, start + n)], write, self.device, self.pool)
        batch = ForwardBatch(self.embed(tokens.to(self.device)), positions.to(self.device), self.pool, self.ops,
                             layout, None)
        out = self.head(hidden.to(device=self.device, dtype=self.head.fc.weight.dtype), batch)
        table.advance(n)
        return out
