"""Reference-counted pages, copy on write, and the prefix cache's bookkeeping (without a model)."""

from __future__ import annotations

import torch

from raincheck_core.cache.kv_pool import KVPool, PageTable
from raincheck_core.cache.prefix import ROW_KEY_WIDTH, PrefixCache, PrefixChain
from services.common.settings import WorkerSettings


def _keys(n: int, start: int = 0) -> torch.Tensor:
    keys = torch.zeros(n, ROW_KEY_WIDTH, dtype=torch.long)
    keys[:, 0] = torch.arange(start, start + n)
    return keys


def test_a_shared_page_is_freed_by_its_last_holder_and_copied_before_a_rewrite():
    pool = KVPool(1, 4, 4, 1, 2, torch.float32, "cpu")
    a = PageTable(pool, 4)
    a.append(8)
    pool.k[0, :8] = torch.arange(8.0)[:, None, None]
    b = PageTable(pool, 4)
    b.adopt(a.pages, 8)
    assert pool.refs[a.pages[0]] == 2 and pool.stats().free_pages == 2
    shared = a.pages[1]
    a.truncate(6)                                  # a goes on from inside page 1, which b still reads
    assert a.pages[1] != shared and pool.refs[shared] == 1
    assert pool.k[0, a.pages[1] * 4:a.pages[1] * 4 + 2, 0, 0].tolist() == [4.0, 5.0]
    b.release()
    assert pool.stats().free_pages == 2            # page 0 is a's alone now, page 1 went back
    a.release()
    assert pool.stats().free_pages == 4


def test_the_chain_matches_whole_pages_and_pages_only_the_cache_holds_count_as_free():
    pool = KVPool(1, 4, 4, 1, 2, torch.float32, "cpu")
    cache = PrefixCache(pool, max_pages=4, checkpoint_bytes=0, gdn=None)
    table, chain = PageTable(pool, 4), PrefixChain(4)
    table.append(10)
    assert chain.extend(0, _keys(10)) == 2
    cache.publish(chain.hashes, table.pages[:2], 0, {})
    assert cache.match(_keys(10), 9).pages == table.pages[:2]
    assert cache.match(_keys(7), 6).pages == table.pages[:1]           # a prompt of 7: one page, then its own
    assert cache.match(_keys(10, start=1), 9) is None                  # other rows: no hit
    table.release()
    assert pool.stats().cached_pages == 2 and pool.stats().free_pages == 4
    PageTable(pool, 4).append(16)                  # needs every page: the cache lets go of its own
    assert pool.stats().cached_pages == 0 and cache.match(_keys(10), 9) is None


def test_a_chain_ends_at_the_first_slot_it_cannot_describe_and_reopens_when_that_is_undone():
    chain = PrefixChain(4)
    chain.extend(0, _keys(5))
    chain.extend(5, None)                          # a deferred or generated row
    assert chain.extend(6, _keys(4, 6)) == 0 and len(chain.hashes) == 1
    chain.truncate(5)
    assert chain.open and chain.extend(5, _keys(3, 5)) == 1


def test_cache_flags_become_engine_options():
    assert WorkerSettings(prefix_cache_pages=0).engine == {"prefix_cache": False}
    assert WorkerSettings(prefix_cache_pages=64, gdn_checkpoint_mib=2, encoder_cache_mib=0).engine == {
        "prefix_cache_pages": 64, "gdn_checkpoint_bytes": 2 << 20, "encoder_cache_bytes": 0}
