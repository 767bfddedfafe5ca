"""Paged KV cache: one pool of fixed-size pages shared by every session, and per-sequence page tables.

K/V of attention layer l live in `k[l]`/`v[l]`, flat over slots (`page * page_size + offset`).
A sequence's slots follow processing order; which slot a row may attend to is decided by the
forward batch (positions and visibility), never by slot order.

Pages are reference-counted: the prefix cache (cache/prefix.py) holds a reference to every page it
has registered and shares full pages read-only between sequences. A page goes back to the free list
when its last holder lets go; a page only the cache holds counts as free (`reclaim` evicts it when the
free list runs short), and a sequence about to write into a page someone else holds copies it first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidInputError, OutOfPagesError, SessionPageBudgetError


@dataclass(frozen=True)
class PoolStats:
    total_pages: int
    free_pages: int             # what admission can get: the free list plus pages only the prefix cache holds
    page_size: int
    cached_pages: int = 0       # pages the prefix cache holds (shared with sessions or not)

    @property
    def used_pages(self) -> int:
        return self.total_pages - self.free_pages

    @property
    def usage(self) -> float:
        return self.used_pages / self.total_pages


class KVPool:
    def __init__(
        self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str,
    ):
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (num_layers, num_pages * page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(num_pages - 1, -1, -1))     # pop() hands out low pages first
        self.refs = [0] * num_pages
        # the prefix cache: how many pages it holds, how many of them only it holds, and `reclaim(n)`, which
        # lets go of up to `n` of those (least recently used first)
        self.cached: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self.reclaim: Callable[[int], None] = lambda n: None

    def stats(self) -> PoolStats:
        held, only = self.cached()
        return PoolStats(self.num_pages, len(self._free) + only, self.page_size, held)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            self.reclaim(n - len(self._free))
        if n > len(self._free):
            raise OutOfPagesError("KV page pool exhausted", needed=n, available=len(self._free))
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder of each of `pages`."""
        for p in pages:
            self.refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """One holder fewer of each of `pages`; those nobody holds go back to the free list."""
        for p in reversed(pages):
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)

    def copy_page(self, src: int, dst: int, rows: int) -> None:
        """The first `rows` slots of page `src`, every layer's K and V, into page `dst`."""
        ps = self.page_size
        a, b = src * ps, dst * ps
        self.k[:, b:b + rows].copy_(self.k[:, a:a + rows])
        self.v[:, b:b + rows].copy_(self.v[:, a:a + rows])


class PageTable:
    """The pages of one sequence and how many of its slots are filled."""

    def __init__(self, pool: KVPool, max_pages: int):
        self.pool = pool
        self.max_pages = max_pages
        self.pages: list[int] = []
        self.length = 0
        self._slot_ids = torch.empty(0, dtype=torch.long)   # of every reserved slot, rebuilt as pages come
        self._slot_np = self._slot_ids.numpy()             # the same memory: a numpy slice is a tenth of a tensor's
        # the reserved pages, int64, rebuilt (never changed in place) as they change: a read list made from
        # `_slot_np` and this array taken with it describe the same pages (ops/flex_layout.py reads decode
        # rows' pages from it rather than off their lists)
        self.page_ids = np.zeros(0, dtype=np.int64)
        self._page_slots: dict[int, tuple[torch.Tensor, ...]] = {}    # `reserved_slot`'s views, by page

    def pages_needed(self, n: int) -> int:
        ps = self.pool.page_size
        return max(0, -(-(self.length + n) // ps) - len(self.pages))

    def reserve(self, n: int) -> None:
        """Make room for `n` more slots, or raise without changing anything."""
        need = self.pages_needed(n)
        if len(self.pages) + need > self.max_pages:
            raise SessionPageBudgetError(
                "session page budget exceeded", needed=len(self.pages) + need, available=self.max_pages
            )
        if need:
            self.pages.extend(self.pool.allocate(need))
            self._index()

    def ahead(self, offset: int, n: int) -> torch.Tensor:
        """Slot ids of the `n` slots `offset` past the filled ones, reserving pages for them as needed;
        the length does not move (a step claims slots when it is planned and fills them if it runs)."""
        start = self.length + offset
        if start + n > len(self._slot_np):     # past the reserved pages (a decode row rarely is)
            self.reserve(offset + n)
        return self.reserved_slot(start) if n == 1 else self.reserved_slots(start, start + n)

    def advance(self, n: int) -> None:
        """`n` more slots are filled (their pages were reserved by `ahead` or `reserve`)."""
        if self.length + n > len(self._slot_np):
            raise InvalidInputError(f"advancing by {n} slots past the reserved pages")
        self.length += n

    def append(self, n: int) -> torch.Tensor:
        """Claim and fill the next `n` slots (reserving pages as needed); returns their global slot ids."""
        slots = self.ahead(0, n)
        self.length += n
        return slots

    def adopt(self, pages: list[int], length: int) -> None:
        """Start an empty sequence on `pages` (shared, read-only: full pages holding its first `length`
        slots, as the prefix cache found them)."""
        if self.pages or len(pages) * self.pool.page_size != length or len(pages) > self.max_pages:
            raise InvalidInputError(f"cannot adopt {len(pages)} pages for {length} slots")
        self.pool.share(pages)
        self.pages = list(pages)
        self.length = length
        self._index()

    def fork(self, parent: PageTable) -> None:
        """This empty table, holding only pages it reserved, becomes a copy of `parent`: its full pages shared
        read-only, a partly filled last page copied into the first reserved one (both will write into it),
        the rest of the reserved pages after them."""
        ps = self.pool.page_size
        full, rows = divmod(parent.length, ps)
        own = self.pages
        if self.length or (rows and not own) or full + len(own) > self.max_pages:
            raise InvalidInputError(f"cannot fork {parent.length} slots onto {len(own)} reserved pages")
        shared = parent.pages[:full]
        self.pool.share(shared)
        if rows:
            self.pool.copy_page(parent.pages[full], own[0], rows)
        self.pages = shared + own
        self.length = parent.length
        self._index()

    def truncate(self, length: int) -> None:
        """Forget every slot from `length` on and return the pages no longer needed to the pool. A partly
        kept last page that someone else holds too is copied (copy on write: later slots overwrite it)."""
        if not 0 <= length <= self.length:
            raise InvalidInputError(f"cannot truncate {self.length} slots to {length}")
        self.length = length
        ps = self.pool.page_size
        keep = -(-length // ps)
        self.pool.release(self.pages[keep:])
        del self.pages[keep:]
        if length % ps and self.pool.refs[self.pages[-1]] > 1:
            fresh = self.pool.allocate(1)[0]
            self.pool.copy_page(self.pages[-1], fresh, length % ps)
            self.pool.release([self.pages[-1]])
            self.pages[-1] = fresh
        self._index()

    def slots(self, start: int, end: int) -> torch.Tensor:
        if not 0 <= start <= end <= self.length:
            raise InvalidInputError(f"slot range [{start}, {end}) outside the sequence's {self.length} slots")
        return self.reserved_slots(start, end)

    def reserved_slots(self, start: int, end: int) -> torch.Tensor:
        """Slot ids of `[start, end)` within the reserved pages (filled or not); a view, not a copy."""
        reserved = len(self._slot_np)
        if not 0 <= start <= end <= reserved:
            raise InvalidInputError(f"slot range [{start}, {end}) outside the {reserved} reserved slots")
        return torch.from_numpy(self._slot_np[start:end])

    def reserved_slot(self, i: int) -> torch.Tensor:
        """Slot id `i` of the reserved ones as a one-element tensor: a view of its page's ids made once per
        page (a decode row claims one slot a step, and a tensor slice per row was most of the claim's cost)."""
        page, at = divmod(i, self.pool.page_size)
        views = self._page_slots.get(page)
        if views is None:
            ps = self.pool.page_size
            if not 0 <= i < self._slot_ids.shape[0]:
                raise InvalidInputError(f"slot {i} outside the {self._slot_ids.shape[0]} reserved slots")
            views = self._page_slots[page] = self._slot_ids[page * ps:(page + 1) * ps, None].unbind(0)
        return views[at]

    def _index(self) -> None:
        ps = self.pool.page_size
        pages = torch.tensor(self.pages, dtype=torch.long)
        self.page_ids = pages.numpy()
        self._slot_ids = (pages[:, None] * ps + torch.arange(ps)[None, :]).flatten()
        self._slot_np = self._slot_ids.numpy()
        self._page_slots = {}

    def release(self) -> None:
        self.pool.release(self.pages)
        self.pages = []
        self.length = 0
        self._index()
