"""FlexAttention over the paged pool in place (ops/flex_attention.py) against the one-segment reference:
decode rows, prefill chunks, a deferred chunk that skips its turn's generated slots, a chunk and its
session's decode row in one step, pages shared by two sessions, padding rows on a scratch slot."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raincheck_core.cache.kv_pool import KVPool, PageTable
from raincheck_core.ops.attention import reference_attention
from raincheck_core.ops.attention_accounting import allocated_bytes, flex_accounting
from raincheck_core.ops.flex_attention import flex_varlen_attention, kernel_options
from raincheck_core.ops.flex_groups import MAX_STEP, Q_TILE, bucket, tables_of
from raincheck_core.ops.flex_layout import FixedGroups, flex_layout
from raincheck_core.ops.uploads import Uploads

KV, HEADS, D, PAGE = 2, 6, 16, 16


def _pool(pages: int = 64) -> KVPool:
    pool = KVPool(1, pages, PAGE, KV, D, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    return pool


def _session(pool: KVPool, filled: int) -> PageTable:
    table = PageTable(pool, 64)
    table.append(filled)
    return table


def _run(pool: KVPool, q_lens: list[int], reads: list[torch.Tensor], writes: list[torch.Tensor],
         prefixes: list[bool] | None = None):
    gen = torch.Generator().manual_seed(sum(q_lens))
    rows = sum(q_lens)
    q = torch.randn(rows, HEADS, D, generator=gen)
    k, v = torch.randn(rows, KV, D, generator=gen), torch.randn(rows, KV, D, generator=gen)
    layout = flex_layout(q_lens, reads, torch.cat(writes), "cpu", pool, prefixes=prefixes)
    out = flex_varlen_attention(q, k, v, pool.k[0], pool.v[0], layout)
    at = 0
    for s, n in enumerate(q_lens):
        ref = reference_attention(q[at:at + n], pool.k[0], pool.v[0], reads[s])
        assert float((out[at:at + n] - ref).abs().max()) <= 1e-5, s
        at += n
    return layout


@pytest.mark.parametrize("marked", [False, True])
def test_segments_of_every_kind_in_one_step_equal_each_alone(marked):
    """`marked`: the lists say how they relate to their page tables, as the engine's do (ops/flex_runs.py)."""
    pool = _pool()
    sessions = [_session(pool, n) for n in (40, 0, 3, 37, 100)]
    # reserve pages for the rows each session writes this step, in the order the scheduler claims them
    q_lens, reads, writes = [], [], []

    def claim(t: PageTable, offset: int, n: int) -> torch.Tensor:
        return t.ahead(offset, n)

    # 0: a decode row; 1: a first prefill over 70 rows; 2: a decode row on a 3-slot session
    for t, n in ((sessions[0], 1), (sessions[1], 70), (sessions[2], 1)):
        w = claim(t, 0, n)
        q_lens.append(n)
        reads.append(t.reserved_slots(0, t.length + n))
        writes.append(w)
    # 3: a deferred chunk of 7 rows, then its session's decode row (which sees the chunk)
    t = sessions[3]
    generated = torch.zeros(t.length, dtype=torch.bool)
    generated[[3, 17, 18, 36]] = True
    chunk = claim(t, 0, 7)
    past = t.reserved_slots(0, t.length)
    q_lens.append(7)
    reads.append(torch.cat([past[~generated], chunk]))
    writes.append(chunk)
    row = claim(t, 7, 1)
    q_lens.append(1)
    reads.append(t.reserved_slots(0, t.length + 8))
    writes.append(row)
    # 4: a continued prefill of 9 rows
    w = claim(sessions[4], 0, 9)
    q_lens.append(9)
    reads.append(sessions[4].reserved_slots(0, sessions[4].length + 9))
    writes.append(w)
    prefixes = [True, True, True, generated.nonzero().flatten().numpy(), True, True] if marked else None
    layout = _run(pool, q_lens, reads, writes, prefixes)
    assert [g.q for g in layout.groups] == [1, 8, 16, 128]


def test_a_deferred_chunk_claimed_after_its_decode_row_does_not_see_it():
    pool = _pool()
    t = _session(pool, 20)
    row = t.ahead(0, 1)                           # the decode row first: GEN, the chunk must skip it
    chunk = t.ahead(1, 5)
    decode_read = t.reserved_slots(0, 21)
    chunk_read = torch.cat([t.reserved_slots(0, 20), chunk])
    _run(pool, [1, 5], [decode_read, chunk_read], [row, chunk])


def test_pages_shared_by_two_sessions_and_padding_rows():
    pool = _pool()
    a = _session(pool, 48)
    b = PageTable(pool, 64)
    b.adopt(a.pages[:2], 32)                      # the prefix cache's pages, read by both
    ra, rb = a.ahead(0, 1), b.ahead(0, 3)
    scratch = torch.tensor([pool.allocate(1)[0] * PAGE])
    pad = scratch.expand(4)
    q_lens = [1, 3, 4]
    reads = [a.reserved_slots(0, 49), b.reserved_slots(0, 35), pad]
    gen = torch.Generator().manual_seed(5)
    rows = sum(q_lens)
    q = torch.randn(rows, HEADS, D, generator=gen)
    k, v = torch.randn(rows, KV, D, generator=gen), torch.randn(rows, KV, D, generator=gen)
    layout = flex_layout(q_lens, reads, torch.cat([ra, rb, pad]), "cpu", pool)
    out = flex_varlen_attention(q, k, v, pool.k[0], pool.v[0], layout)
    for s, (at, n) in enumerate(((0, 1), (1, 3))):
        ref = reference_attention(q[at:at + n], pool.k[0], pool.v[0], reads[s])
        assert float((out[at:at + n] - ref).abs().max()) <= 1e-5
    assert bool(out[4:].isfinite().all())        # padding rows: dropped, but never NaN


@pytest.mark.parametrize("marked", [False, True])
def test_deferred_chunks_of_sessions_sharing_prefix_pages_skip_only_their_own_slots(marked):
    """Two sessions on the same two prefix pages (the prefix cache's), each with a chunk that skips its
    turn's generated slots on its own pages and sees the shared pages whole, and a decode row each: the
    chunks' hidden slots are found in one pass over the pages they skip slots of, and a shared page is
    no such page, so nothing of it is hidden from either (or from the decode rows)."""
    pool = _pool()
    a = _session(pool, 50)
    b = PageTable(pool, 64)
    b.adopt(a.pages[:2], 32)
    b.append(13)
    chunks, reads, writes, prefixes = [], [], [], []
    for t, skipped in ((a, [33, 40, 49]), (b, [32, 36, 44])):
        generated = torch.zeros(t.length, dtype=torch.bool)
        generated[skipped] = True
        chunk, row = t.ahead(0, 6), t.ahead(6, 1)
        chunks += [6, 1]
        reads += [torch.cat([t.reserved_slots(0, t.length)[~generated], chunk]), t.reserved_slots(0, t.length + 7)]
        writes += [chunk, row]
        prefixes += [np.array(skipped), True]
    layout = _run(pool, chunks, reads, writes, prefixes if marked else None)
    assert layout.groups[1].filtered[:2].tolist() == [True, True]


@pytest.mark.parametrize("marked", [False, True])
def test_two_chunks_of_a_session_that_skip_the_same_slots_of_a_page_attend_as_their_lists_say(marked):
    """Two chunks of one session in one step (an older turn's late rows and the latest turn's), both leaving
    out slots 5 and 9: the page they share is looked at slot by slot, and the later chunk reads the earlier."""
    pool = _pool()
    t = _session(pool, 20)
    c1, c2 = t.ahead(0, 2), t.ahead(2, 3)
    keep = torch.ones(20, dtype=torch.bool)
    keep[[5, 9]] = False
    past = t.reserved_slots(0, 20)[keep]
    layout = _run(pool, [2, 3], [torch.cat([past, c1]), torch.cat([past, c1, c2])], [c1, c2],
                  [np.array([5, 9]), np.array([5, 9])] if marked else None)
    assert [bool(g.filtered[0]) for g in layout.groups] == [True, True]


@pytest.mark.parametrize("marked", [False, True])
def test_two_chunks_that_disagree_on_a_slot_are_refused(marked):
    pool = _pool()
    t = _session(pool, 20)
    c1 = t.ahead(0, 2)
    c2 = t.ahead(2, 2)
    past = t.reserved_slots(0, 20)
    with pytest.raises(ValueError, match="disagree"):
        flex_layout([2, 2], [torch.cat([past[1:], c1]), torch.cat([past[:1], past[2:], c1, c2])],
                    torch.cat([c1, c2]), "cpu", pool, prefixes=[np.array([0]), np.array([1])] if marked else None)


def test_a_segment_reading_no_slot_is_refused_with_a_value_error():
    """Wherever it stands (last too): a list with nothing to read is a caller's error, said as such."""
    pool = _pool()
    t = _session(pool, 8)
    row = t.ahead(0, 1)
    read = torch.cat([t.reserved_slots(0, 8), row])
    for q_lens, reads in (([1, 0], [read, row[:0]]), ([0, 1], [row[:0], read])):
        with pytest.raises(ValueError, match="at least one slot"):
            flex_layout(q_lens, reads, row, "cpu", pool)


def test_a_decode_step_allocates_no_copy_of_the_keys_it_reads():
    """16 sessions decoding over ~400 slots each: what the attention call allocates (outputs, the query
    gather) is under a tenth of the K/V bytes it reads; the old path copied them all per layer."""
    pool = _pool(512)
    sessions = [_session(pool, 380 + 3 * i) for i in range(16)]
    writes = [t.ahead(0, 1) for t in sessions]
    reads = [t.reserved_slots(0, t.length + 1) for t in sessions]
    layout = _run(pool, [1] * 16, reads, writes)
    acc = flex_accounting(layout, KV, D, 4)
    assert acc.kv_ratio <= 1.1 and acc.score_ratio <= 1.25
    q = torch.randn(16, HEADS, D)
    k, v = torch.randn(16, KV, D), torch.randn(16, KV, D)
    allocated = allocated_bytes(lambda: flex_varlen_attention(q, k, v, pool.k[0], pool.v[0], layout))
    assert allocated <= 0.1 * acc.kv_read, (allocated, acc.kv_read)


def test_the_step_counter_wraps_with_clean_tables():
    """Entries of steps before the wrap could match new stamps: the tables start clean."""
    pool = _pool()
    t = _session(pool, 30)
    tables = tables_of(pool, pool.k.shape[1], PAGE, "cpu")
    tables.step = MAX_STEP - 2
    for _ in range(3):
        row = t.ahead(0, 1)
        _run(pool, [1], [t.reserved_slots(0, t.length + 1)], [row])
        t.advance(1)
    assert tables.step == 2         # MAX_STEP - 1, then 1 and 2 after the wrap


@pytest.mark.parametrize("shared_heads", [1, 3, 4, 8])
def test_every_group_declares_blocks_the_gpu_kernels_accept(shared_heads):
    """What torch's FlexAttention lowering requires on a GPU, checked where no GPU is: the main kernel
    needs the declared query block and the page to be multiples of its BLOCK_M and BLOCK_N (at least 16,
    Triton's smallest matrix tile) and reads one block list per block of BLOCK_M rows; the decoding kernel
    (a KV head's query heads packed in one block, a power of two of them) needs the declared query block
    to be a multiple of max(16, next power of two of rows x shared heads) and reads the first list only.
    The first device run failed every call on these rules."""
    pool = _pool(128)
    q_lens, reads, writes = [], [], []
    for filled, n in ((40, 1), (20, 2), (33, 3), (7, 5), (100, 16), (300, 31), (0, 70), (10, 130), (0, 300)):
        t = _session(pool, filled)
        writes.append(t.ahead(0, n))
        reads.append(t.reserved_slots(0, filled + n))
        q_lens.append(n)
    layout = _run(pool, q_lens, reads, writes)
    assert sorted(g.q for g in layout.groups) == [1, 2, 4, 8, 16, 32, 128, 256, 512]
    for g in layout.groups:
        declared = g.declared_q_block(shared_heads)
        assert (declared, PAGE) == g.block_mask(layout.tables, shared_heads).BLOCK_SIZE
        options = kernel_options(g, shared_heads, PAGE, torch.device("cuda"))
        if options["BACKEND"] == "TRITON_DECODE":
            assert g.q // g.tile == 1 and g.q < 128 and shared_heads & (shared_heads - 1) == 0
            assert declared % max(16, bucket(g.q * shared_heads)) == 0 and set(options) == {"BACKEND"}
        else:                           # the main kernel, one block list per tile
            assert options["BACKEND"] == "TRITON"
            assert options["BLOCK_M"] >= 16 and options["BLOCK_N"] >= 16
            assert declared % options["BLOCK_M"] == 0 and PAGE % options["BLOCK_N"] == 0
            assert declared >= g.q if g.q < Q_TILE else declared == options["BLOCK_M"] == g.tile


@pytest.mark.parametrize("chunk", [None, "skips", "general"])
def test_page_table_prefixes_give_the_layout_every_slot_gives(chunk):
    """Lists that are the first slots of page tables (decode, verify, prefill rows) have their runs read off
    each page's first slot: the same layout as from every slot, at page boundaries too (a list ending on a
    page's last slot, on a new page's first, one slot long); beside a short list that skips slots, marked
    with the positions it leaves out as the engine's deferred chunks are, or as any list (the page-table
    lists and the general one merged in list order)."""
    pool = _pool(128)
    q_lens, reads, writes = [], [], []
    for filled, n in ((15, 1), (16, 1), (0, 1), (47, 1), (31, 3), (5, 40), (0, 130)):
        t = _session(pool, filled)
        writes.append(t.ahead(0, n))
        reads.append(t.reserved_slots(0, filled + n))
        q_lens.append(n)
    prefixes = [True] * len(q_lens)
    if chunk is not None:       # a 3-row chunk that skips two slots of its 20, placed among the others
        t = _session(pool, 20)
        chunk = t.ahead(0, 3)
        keep = torch.ones(20, dtype=torch.bool)
        keep[[4, 17]] = False
        writes.insert(2, chunk)
        reads.insert(2, torch.cat([t.reserved_slots(0, 20)[keep], chunk]))
        q_lens.insert(2, 3)
        prefixes.insert(2, np.array([4, 17]) if chunk == "skips" else False)
    every = flex_layout(q_lens, reads, torch.cat(writes), "cpu", pool)
    layout = _run(pool, q_lens, reads, writes, prefixes)        # attends as the reference does, too
    assert any(bool(g.filtered.any()) for g in layout.groups) == (chunk is not None)
    for a, b in zip(every.groups, layout.groups, strict=True):
        for name in ("q_rows", "out_rows", "last", "filtered", "rows", "partial_num", "partial_idx", "full_num",
                     "full_idx"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("padded", [False, True])
def test_a_step_of_decode_rows_read_off_their_page_tables_gives_the_layout_every_slot_gives(padded):
    """A step of decode rows only, each list its page table's first slots (the engine's plain decode step),
    is built from each page's first slot alone (ops/flex_groups.py `one_row_group`), or from the pages their
    tables hold (`PageTable.page_ids`, which decode segments carry): the layout every slot gives, at page
    boundaries (a row on a page's last slot, on a new page's first, a session's first row), for sessions
    sharing prefix pages, and padded to a fixed shape with padding rows on a scratch slot (a captured graph's
    step); and its rows attend as the reference does."""
    pool = _pool(128)
    q_lens, reads, writes, pages = [], [], [], []
    shared = _session(pool, 40)
    for filled in (15, 16, 0, 47, 31, 200, None):
        if filled is None:          # the prefix cache's pages, read by a second session
            t = PageTable(pool, 64)
            t.adopt(shared.pages[:2], 32)
            filled = 32
        else:
            t = _session(pool, filled)
        writes.append(t.ahead(0, 1))
        reads.append(t.reserved_slots(0, filled + 1))
        pages.append(t.page_ids)
        q_lens.append(1)
    rows, fixed, prefixes = len(q_lens), None, [True] * len(q_lens)
    if padded:
        scratch = torch.tensor([pool.allocate(1)[0] * PAGE])
        q_lens += [1] * 3
        reads += [scratch] * 3
        writes += [scratch] * 3
        prefixes += [False] * 3
        pages += [None] * 3
        fixed = FixedGroups([1] * rows + [0] * 3, {1: 16})
    every = flex_layout(q_lens, reads, torch.cat(writes), "cpu", pool, fixed=fixed)
    layout = flex_layout(q_lens, reads, torch.cat(writes), "cpu", pool, fixed=fixed, prefixes=prefixes)
    carried = flex_layout(q_lens, reads, torch.cat(writes), "cpu", pool, fixed=fixed, prefixes=prefixes, pages=pages)
    assert [g.q for g in layout.groups] == [1] and layout.groups[0].stamp.shape[0] == (16 if padded else 8)
    for a, b in [*zip(every.groups, layout.groups, strict=True), *zip(every.groups, carried.groups, strict=True)]:
        for name in ("q_rows", "out_rows", "last", "filtered", "rows", "partial_num", "partial_idx", "full_num",
                     "full_idx"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), name
        assert a.cols == b.cols and torch.equal(a.stamp - a.step * (a.stamp >= 0) * (1 << 16),
                                                b.stamp - b.step * (b.stamp >= 0) * (1 << 16))
    assert every.k_lens == layout.k_lens
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(q_lens), HEADS, D, generator=gen)
    k, v = torch.randn(len(q_lens), KV, D, generator=gen), torch.randn(len(q_lens), KV, D, generator=gen)
    for built in (layout, carried):
        out = flex_varlen_attention(q, k, v, pool.k[0], pool.v[0], built)
        for s in range(rows):
            ref = reference_attention(q[s:s + 1], pool.k[0], pool.v[0], reads[s])
            assert float((out[s:s + 1] - ref).abs().max()) <= 1e-5, s


def test_a_one_row_chunk_takes_the_two_row_group_and_the_decode_rows_keep_theirs():
    """A deferred chunk cut to one row by the step's budget reads a list that leaves its turn's generated slots
    out: it runs in the two-row group, and the decode rows' group is the one their pages alone give (the
    same as without the chunk); every row attends as the reference does."""
    pool = _pool()
    a, b = _session(pool, 40), _session(pool, 21)
    chunk = a.ahead(0, 1)
    keep = torch.ones(40, dtype=torch.bool)
    keep[[30, 35]] = False
    reads = [torch.cat([a.reserved_slots(0, 40)[keep], chunk]), a.reserved_slots(0, 42), b.reserved_slots(0, 22)]
    writes = [chunk, a.ahead(1, 1), b.ahead(0, 1)]
    layout = _run(pool, [1, 1, 1], reads, writes, [np.array([30, 35]), True, True])
    assert [g.q for g in layout.groups] == [1, 2] and layout.groups[1].filtered[0]
    alone = flex_layout([1, 1], reads[1:], torch.cat(writes[1:]), "cpu", pool, prefixes=[True, True])
    for name in ("last", "partial_num", "partial_idx", "full_num", "full_idx"):
        assert torch.equal(getattr(alone.groups[0], name), getattr(layout.groups[0], name)), name
    assert layout.groups[0].q_rows.tolist() == [1, 2]


def test_random_decode_and_chunk_steps_give_the_same_layout_marked_or_not():
    """Steps of decode rows and deferred chunks that skip random positions, each chunk before its session's
    decode row, padded to fixed shapes with padding rows or not: built from the lists' marks (the one-row
    group from its pages, the chunks' groups from their own runs) or from every slot of every list, the
    groups are the same tensors."""
    pool = _pool(512)
    rng = np.random.default_rng(1)
    for trial in range(60):
        q_lens, reads, writes, prefixes, tables, pages = [], [], [], [], [], []
        for _ in range(int(rng.integers(1, 7))):
            filled = int(rng.integers(0, 120))
            t = _session(pool, filled)
            tables.append(t)
            rows = 0
            if filled > 4 and rng.random() < 0.5:
                rows = int(rng.choice([3, 7, 15, 31]))
                skipped = np.sort(rng.choice(filled - 1, int(rng.integers(0, 6)), replace=False)).astype(np.int64)
                keep = np.ones(filled, dtype=bool)
                keep[skipped] = False
                chunk = t.ahead(0, rows)
                reads.append(torch.cat([t.reserved_slots(0, filled)[torch.from_numpy(keep)], chunk]))
                writes.append(chunk)
                q_lens.append(rows)
                prefixes.append(skipped if skipped.size else True)
                pages.append(None)
            writes.append(t.ahead(rows, 1))
            reads.append(t.reserved_slots(0, filled + rows + 1))
            q_lens.append(1)
            prefixes.append(True)
            pages.append(t.page_ids)        # as the engine's decode segments carry them
        fixed = None
        if trial % 2:
            scratch = torch.tensor([pool.allocate(1)[0] * PAGE])
            query = [bucket(n) for n in q_lens]
            for n in rng.choice([1, 3], int(rng.integers(0, 3))):
                q_lens.append(int(n))
                reads.append(scratch.expand(int(n)))
                writes.append(scratch.expand(int(n)))
                prefixes.append(False)
                pages.append(None)
                query.append(0)
            fixed = FixedGroups(query, {q: query.count(q) + int(rng.integers(0, 3)) for q in set(query) - {0}})
        marked = flex_layout(q_lens, reads, torch.cat(writes), "cpu", pool, fixed=fixed, prefixes=prefixes)
        every = flex_layout(q_lens, reads, torch.cat(writes), "cpu", pool, fixed=fixed)
        carried = flex_layout(q_lens, reads, torch.cat(writes), "cpu", pool, fixed=fixed, prefixes=prefixes,
                              pages=pages)
        assert [g.q for g in marked.groups] == [g.q for g in every.groups] == [g.q for g in carried.groups]
        for a, b in [*zip(every.groups, marked.groups, strict=True), *zip(every.groups, carried.groups, strict=True)]:
            for name in ("q_rows", "out_rows", "last", "filtered", "rows", "partial_num", "partial_idx", "full_num",
                         "full_idx"):
                assert torch.equal(getattr(a, name), getattr(b, name)), (trial, name)
            assert a.cols == b.cols and torch.equal(a.stamp - a.step * (a.stamp >= 0) * (1 << 16),
                                                    b.stamp - b.step * (b.stamp >= 0) * (1 << 16))
        for t in tables:
            t.truncate(0)


def test_chunks_leaving_out_a_page_head_a_whole_page_or_a_last_page_slot_attend_as_their_lists_say():
    """A chunk's list given as its page table less positions: a left-out run starting a page (the page's
    first listed slot is later on it), one covering a whole page (the page is not read), one on the
    chunk's own page; next to a decode row of the same session, which reads everything."""
    pool = _pool()
    t = _session(pool, 70)
    skipped = np.array([0, 1, 2, *range(16, 33), 47, 66, 69])
    chunk, row = t.ahead(0, 5), t.ahead(5, 1)
    keep = torch.ones(70, dtype=torch.bool)
    keep[torch.from_numpy(skipped)] = False
    reads = [torch.cat([t.reserved_slots(0, 70)[keep], chunk]), t.reserved_slots(0, 76)]
    layout = _run(pool, [5, 1], reads, [chunk, row], [skipped, True])
    every = flex_layout([5, 1], reads, torch.cat([chunk, row]), "cpu", pool)
    for a, b in zip(every.groups, layout.groups, strict=True):
        for name in ("last", "filtered", "partial_num", "partial_idx", "full_num", "full_idx"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    with pytest.raises(ValueError, match="page-table prefix"):      # the positions do not match the list
        flex_layout([5], reads[:1], chunk, "cpu", pool, prefixes=[skipped[1:]])


def test_a_list_marked_as_a_prefix_that_is_not_one_is_refused():
    pool = _pool()
    t = _session(pool, 40)
    row = t.ahead(0, 1)
    skipping = torch.cat([t.reserved_slots(0, 40)[torch.arange(40) != 3], row])     # slot 3 skipped
    with pytest.raises(ValueError, match="page-table prefix"):
        flex_layout([1], [skipping], row, "cpu", pool, prefixes=[True])


def test_a_staged_decode_steps_block_lists_start_aligned_for_the_gpu_kernels():
    """The one-row group stages its partial and full block lists as one array (ops/flex_groups.py): the full
    list, laid after the partial one, starts 64-byte aligned as a staged tensor does, whatever the pool's size
    (here 301 pages: a tail of 45 entries past the 256 columns), and the lists are the general build's."""
    pool = _pool(301)
    tables = [_session(pool, filled) for filled in (5, 40, 17)]
    writes = [t.ahead(0, 1) for t in tables]
    reads = [t.reserved_slots(0, t.length + 1) for t in tables]
    up = Uploads("cpu").begin()
    staged = flex_layout([1] * 3, reads, torch.cat(writes), "cpu", pool, prefixes=[True] * 3,
                         pages=[t.page_ids for t in tables], uploads=up)
    up.send()
    every = flex_layout([1] * 3, reads, torch.cat(writes), "cpu", pool)
    (group,), (general,) = staged.groups, every.groups
    for name in ("partial_idx", "full_idx", "partial_num", "full_num"):
        assert torch.equal(getattr(group, name), getattr(general, name)), name
    assert group.partial_idx.data_ptr() % 64 == 0 and group.full_idx.data_ptr() % 64 == 0
