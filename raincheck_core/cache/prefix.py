"""Automatic prefix cache: full KV pages shared between sessions, found by a chain of content hashes.

What a slot's K/V hold is a function of the model, the row (its embedding: a token, or a visual row of
an image or video; its position) and of every slot it saw when it ran. A session's slots are described
only while each of them saw every slot before it (a plain prefill or decode row): the chain of row
descriptions in slot order (`RowKeys`: token id, 3-D position, the visual's content hash and the row's
index in it) is then a complete key. The processing history is part of that chain: under deferral a
turn's I0 is a different row sequence from its source-order input (the deferred rows are missing, the
kept ones keep their positions), so the same image processed in full, or with another selector's
selection, has another chain and finds no page of this one. The first slot that did not see every
earlier one ends the description for good (a deferred row, which skips the GEN slots, and a generated
row of a recovering turn, whose K/V depend on which deferred rows were in when it ran): nothing from
there on is shared. A page's hash is `H(previous page's hash, its rows' descriptions)`.

Gated DeltaNet layers have no pages: their state after a prefix is kept as a checkpoint (conv history
and recurrent state, fp32) at the page boundaries where a step ended and at those where a prefill took
one inside its step (message boundaries and a grid, engine/scheduler.py `checkpoint_rows`), and a hit on a
hybrid model reaches only as far as the last shared page that has one (docs/mechanism.md §11).
Checkpoints live in slots of a slab allocated (and written) once, as many as the byte budget holds, like
the KV pool's pages: the memory is taken at start-up and a busy cache recycles its least recently used
slot, so the process does not grow as the cache fills, and a budget the machine lacks fails at start, not
under load.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .gdn_state import GDNStatePool
from .kv_pool import KVPool

ROW_KEY_WIDTH = 7     # token id, 3 position ids, the visual's content hash (2 x 64 bits), row within the visual


@dataclass
class Hit:
    pages: list[int]
    hashes: list[bytes]
    state: tuple[torch.Tensor, torch.Tensor] | None     # GDN (conv, ssm) after the last page


@dataclass(frozen=True)
class PrefixStats:
    cached_pages: int           # pages the cache holds
    checkpoints: int            # GDN state checkpoints held
    checkpoint_bytes: int
    checkpoint_slab_bytes: int  # the slab they live in (taken at start-up): the budget, in whole checkpoints
    lookups: int
    hits: int
    hit_tokens: int             # prompt rows served from the cache


class PrefixChain:
    """A session's row descriptions and the hashes of its full pages, while its slots are describable.
    The descriptions are a numpy array: a decode step writes one row per session, and a numpy row write
    costs a tenth of a tensor's on the host."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.hashes: list[bytes] = []         # of each full page, in order
        self.keys = np.zeros((0, ROW_KEY_WIDTH), dtype=np.int64)
        self.described = 0                    # slots described (a prefix of the session's slots)
        self.open = True                      # False from the first slot that cannot be described

    def extend(self, start: int, keys: torch.Tensor | np.ndarray | None) -> int:
        """Slots from `start` were filled with rows described by `keys` (None: not describable). Returns
        how many pages this completed."""
        if not self.open or keys is None or start != self.described:
            self.open = False
            return 0
        end = start + len(keys)
        if self.keys.shape[0] < end:
            grown = np.zeros((max(2 * self.keys.shape[0], end, 64), ROW_KEY_WIDTH), dtype=np.int64)
            grown[: self.described] = self.keys[: self.described]
            self.keys = grown
        self.keys[start:end] = keys.numpy() if isinstance(keys, torch.Tensor) else keys    # numpy casts to int64
        self.described = end
        before = len(self.hashes)
        ps = self.page_size
        while (len(self.hashes) + 1) * ps <= end:
            i = len(self.hashes)
            self.hashes.append(page_hash(self.hashes[-1] if i else b"", self.keys[i * ps:(i + 1) * ps]))
        return len(self.hashes) - before

    def adopt(self, hit: Hit, keys: torch.Tensor) -> None:
        """An empty session starts on `hit`'s pages, whose rows `keys` describes."""
        self.hashes = list(hit.hashes)
        self.keys = row_keys(keys).copy()
        self.described = len(keys)
        self.open = True

    def truncate(self, length: int) -> None:
        """The session keeps its first `length` slots (a turn undone)."""
        if length <= self.described:
            self.open = True           # what ended the description came later
            self.described = length
        del self.hashes[self.described // self.page_size:]


def row_keys(keys: torch.Tensor | np.ndarray) -> np.ndarray:
    """Row descriptions as an int64 numpy array (a view of a CPU tensor's memory where it can be)."""
    return np.ascontiguousarray(keys.numpy() if isinstance(keys, torch.Tensor) else keys, dtype=np.int64)


def page_hash(previous: bytes, keys: torch.Tensor | np.ndarray) -> bytes:
    return hashlib.blake2b(previous + row_keys(keys).tobytes(), digest_size=16).digest()


class PrefixCache:
    """Pages by chain hash (LRU), and GDN checkpoints by the hash of the page they end (LRU, in slab slots).

    `gdn`: a hybrid model's live state pool (its slots' shapes); None: no GDN layers. `checkpoint_bytes`
    sizes the slab: as many fp32 checkpoints as fit, at most one per page the cache may hold."""

    def __init__(self, pool: KVPool, max_pages: int, checkpoint_bytes: int, gdn: GDNStatePool | None):
        self.pool = pool
        self.max_pages = max_pages
        self.hybrid = gdn is not None          # GDN layers: a hit needs a checkpoint where it ends
        self.pages: OrderedDict[bytes, int] = OrderedDict()
        self.states: OrderedDict[bytes, int] = OrderedDict()     # page hash -> slab slot
        self.slab: GDNStatePool | None = None
        self.slot_bytes = 0
        if gdn is not None:
            conv, ssm = gdn.conv.shape[1:], gdn.ssm.shape[1:]
            self.slot_bytes = 4 * (conv.numel() + ssm.numel())
            slots = min(checkpoint_bytes // self.slot_bytes, max_pages)
            if slots:
                layers, lead, width = conv
                _, heads, dk, dv = ssm
                self.slab = GDNStatePool(slots, layers, width, lead + 1, heads, dk, dv, torch.float32, gdn.conv.device,
                                         rows_per_slot=1)
        self.lookups = self.hits = self.hit_tokens = 0
        pool.cached = self.held
        pool.reclaim = self.reclaim

    # ---------------------------------------------------------------- lookup
    def match(self, keys: torch.Tensor, limit: int) -> Hit | None:
        """The longest run of cached full pages starting the sequence `keys` describes, at most `limit`
        rows, ending where a GDN checkpoint is kept on a hybrid model; None on a miss."""
        self.lookups += 1
        ps = self.pool.page_size
        hashes: list[bytes] = []
        usable = 0
        for i in range(limit // ps):
            h = page_hash(hashes[-1] if i else b"", keys[i * ps:(i + 1) * ps])
            if h not in self.pages:
                break
            hashes.append(h)
            if not self.hybrid or h in self.states:
                usable = len(hashes)
        if not usable:
            return None
        hashes = hashes[:usable]
        for h in reversed(hashes):     # the chain's head most recently used: leaves are evicted first
            self.pages.move_to_end(h)
        state = None
        if self.hybrid:
            self.states.move_to_end(hashes[-1])
            slot = self.states[hashes[-1]]
            state = (self.slab.conv[slot], self.slab.ssm[slot])     # read (copied) before the next step
        self.hits += 1
        self.hit_tokens += usable * ps
        return Hit([self.pages[h] for h in hashes], hashes, state)

    # ---------------------------------------------------------------- filling
    def publish(self, hashes: list[bytes], pages: list[int], start: int,
                states: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A session's full pages `pages` hold the rows chained into `hashes`, of which those from `start`
        are new; `states`: the GDN states (conv, ssm) after the first `k` pages, by `k` (each copied into a
        slab slot): where a step ended, and the checkpoints taken inside steps."""
        for h, page in zip(hashes[start:], pages[start:], strict=True):
            if h not in self.pages:
                self.pool.share([page])
                self.pages[h] = page
        for h in reversed(hashes):     # the chain's head most recently used: leaves are evicted first
            if h in self.pages:
                self.pages.move_to_end(h)
        for k, state in sorted(states.items()):
            self._keep_state(hashes[k - 1], state)
        while len(self.pages) > self.max_pages:
            self._drop(next(iter(self.pages)))

    def _keep_state(self, h: bytes, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        slab = self.slab
        if slab is None or h in self.states or h not in self.pages:
            return
        if not slab.free_slots:          # the least recently used checkpoint's slot
            self._drop_state(next(iter(self.states)))
        slot = slab.allocate()
        slab.conv[slot].copy_(state[0])
        slab.ssm[slot].copy_(state[1])
        self.states[h] = slot

    # ---------------------------------------------------------------- eviction
    def held(self) -> tuple[int, int]:
        """Pages the cache holds, and how many of them nobody else does (read without the engine lock, by
        the workers' stats: from a copy made in one call)."""
        refs, pages = self.pool.refs, list(self.pages.values())
        return len(pages), sum(1 for p in pages if refs[p] == 1)

    def reclaim(self, n: int) -> None:
        """Let go of up to `n` pages only the cache holds, least recently used first (the pool is short)."""
        refs = self.pool.refs
        for h in [h for h, p in self.pages.items() if refs[p] == 1][:n]:
            self._drop(h)

    def clear(self) -> None:
        for h in list(self.pages):
            self._drop(h)

    def _drop(self, h: bytes) -> None:
        self.pool.release([self.pages.pop(h)])
        if h in self.states:
            self._drop_state(h)

    def _drop_state(self, h: bytes) -> None:
        self.slab.release(self.states.pop(h))

    def stats(self) -> PrefixStats:
        slots = self.slab.ssm.shape[0] if self.slab is not None else 0
        return PrefixStats(len(self.pages), len(self.states), len(self.states) * self.slot_bytes,
                           slots * self.slot_bytes, self.lookups, self.hits, self.hit_tokens)
