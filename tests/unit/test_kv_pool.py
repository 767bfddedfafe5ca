from __future__ import annotations

import pytest
import torch

from raincheck_core.cache.gdn_state import GDNStatePool
from raincheck_core.cache.kv_pool import KVPool, PageTable
from raincheck_core.errors import InvalidInputError, OutOfPagesError


def _pool(pages: int = 4, page_size: int = 4) -> KVPool:
    return KVPool(2, pages, page_size, 1, 2, torch.float32, "cpu")


def test_slots_follow_pages_and_stats_count_them():
    pool = _pool()
    table = PageTable(pool, max_pages=4)
    first = table.append(3)
    second = table.append(3)
    assert first.tolist() == [0, 1, 2]
    assert second.tolist() == [3, 4, 5]            # crosses into the second page
    assert pool.stats().used_pages == 2 and pool.stats().usage == 0.5
    assert table.slots(0, 6).tolist() == [0, 1, 2, 3, 4, 5]


def test_reserve_is_all_or_nothing():
    pool = _pool(pages=3)
    a, b = PageTable(pool, 3), PageTable(pool, 3)
    a.reserve(8)                                   # 2 pages
    with pytest.raises(OutOfPagesError) as err:
        b.reserve(8)                               # needs 2, 1 left
    assert (err.value.needed, err.value.available) == (2, 1)
    assert b.pages == [] and pool.stats().free_pages == 1


def test_session_budget_is_enforced_before_allocation():
    pool = _pool(pages=8)
    table = PageTable(pool, max_pages=2)
    with pytest.raises(OutOfPagesError, match="budget"):
        table.append(9)
    assert pool.stats().free_pages == 8


def test_release_returns_pages():
    pool = _pool()
    table = PageTable(pool, 4)
    table.append(10)
    table.release()
    assert pool.stats().free_pages == 4 and table.length == 0


def test_gdn_slots_zeroed_on_allocate_and_bounded():
    pool = GDNStatePool(2, 1, 4, 4, 1, 2, 2, torch.float32, "cpu")
    s = pool.allocate()
    pool.ssm[s].fill_(1.0)
    pool.release(s)
    assert pool.allocate() == s and float(pool.ssm[s].abs().sum()) == 0.0
    pool.allocate()
    with pytest.raises(OutOfPagesError):
        pool.allocate()


def test_slots_are_claimed_ahead_then_filled_and_truncation_returns_pages():
    pool = _pool(pages=6)
    a, b = PageTable(pool, 4), PageTable(pool, 4)
    a.append(6)                         # pages 0, 1
    b.append(2)                         # page 2
    ahead = a.ahead(0, 4)               # claims slots 6..9: page 3 is reserved, the length stays
    assert ahead.tolist() == [6, 7, 12, 13] and a.length == 6 and pool.stats().free_pages == 2
    assert a.reserved_slots(0, 10).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 12, 13]
    with pytest.raises(InvalidInputError):
        a.slots(0, 10)                  # not filled yet
    a.advance(4)
    assert a.slots(8, 10).tolist() == [12, 13]
    a.truncate(5)                       # back to 5 slots: page 3 is free again, pages 0 and 1 stay
    assert a.length == 5 and a.pages == [0, 1] and pool.stats().free_pages == 3
    with pytest.raises(InvalidInputError):
        a.advance(4)                    # past the reserved pages
