"""The FlexAttention path's work and traffic, counted from each step's layout (ops/attention_accounting.py)
on real engine steps of both families: a first prefill, decode steps of two sessions, and decode steps
with fused deferred chunks. Every segment reads only the pages of its own read list (a decode row computes
no score outside its session), the lists the engine marks as page-table prefixes give the layout their
every slot gives, score entries computed / visible <= 1.25 and K/V bytes read / visible <=
1.1 (contexts of about a thousand tokens, the shortest the issue bounds: the last partly filled page, the
16-row query tiles the GPU kernels need and the causal diagonal's pages are what the bounds cover; over a
few hundred tokens a 31-row chunk's two tiles alone come near 1.25)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine.plan import Kind
from raincheck_core.ops import backend
from raincheck_core.ops.attention_accounting import flex_accounting, pages_read
from raincheck_core.ops.flex_layout import FlexLayout
from tests.engine.reference import image_tokens, random_visual

GRID = (1, 16, 16)          # 64 visual tokens, most of them deferred


def owned(layout: FlexLayout) -> FlexLayout:
    """`layout` with tensors of its own: a step's staged ones are views of buffers the next step writes again."""
    def own(x: object) -> dict:
        return {f.name: getattr(x, f.name).clone() for f in dataclasses.fields(x)
                if isinstance(getattr(x, f.name), torch.Tensor)}
    return dataclasses.replace(layout, groups=[dataclasses.replace(g, **own(g)) for g in layout.groups], **own(layout))


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_steps_compute_and_read_only_what_their_rows_see(tiny_checkpoints, family, monkeypatch):
    # skipping: a step's chunk lists leave out their turn's generated slots; carried: its decode rows carry pages
    layouts, skipping, carried = [], [], []

    def recording(q_lens, read_slots, write_slots, device, pool, prefixes, pages, uploads):
        # the lists the engine calls page-table prefixes, and the pages its decode rows carry, give the layout
        # of their every slot read (the reference is built first, copied as it is made: the step's own
        # layout, staged, must be the pool tables' latest)
        every = backend.flex_layout(q_lens, read_slots, write_slots, device, pool)
        layout = backend.flex_layout(q_lens, read_slots, write_slots, device, pool, prefixes=prefixes, pages=pages,
                                     uploads=uploads)
        assert any(p is True for p in prefixes)
        carried.append(any(p is not None for p in pages))
        skipping.append(any(isinstance(p, np.ndarray) and p.shape[0] for p in prefixes))

        def same() -> None:      # once the step's staged tensors are sent
            assert torch.equal(every.write_slots, layout.write_slots)
            for a, b in zip(every.groups, layout.groups, strict=True):
                for f in dataclasses.fields(a):
                    if f.name not in ("stamp", "step"):     # the step's number, one apart
                        x, y = getattr(a, f.name), getattr(b, f.name)
                        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f.name
            layouts.append((owned(layout), [s.clone() for s in read_slots], pool.page_size, pool.k.element_size()))
        uploads.then(same)
        return layout

    monkeypatch.setattr(backend, "FLEX_ATTENTION", dataclasses.replace(backend.FLEX_ATTENTION, layout=recording))
    engine = Engine.from_pretrained(tiny_checkpoints[family][1], backend="flex", deferred_budget=4096)
    kinds = []
    remove = engine.on_plan(lambda plan: kinds.append({s.kind for s in plan.segments}))
    cfg = engine.model_config
    visual = random_visual("image", GRID, cfg.hidden_size, cfg.deepstack_levels, seed=3)
    text = [10 + i % 50 for i in range(1000)]
    deferring = engine.open_session()
    plain = engine.open_session()
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    turns = [
        deferring.turn(Prompt([*text, *image_tokens(GRID), 7, 8], [visual]), params,
                       deferral=DeferralConfig("raincheck", tpot_slo=None, guard=0, chunk_size=31,
                                               selector="uniform")),
        plain.turn(Prompt(text[::-1]), params, deferral=DeferralConfig("full")),
    ]
    for t in turns:
        t.tokens()
    remove()
    assert len(kinds) == len(layouts)
    seen = set()
    attn = engine.model_config
    for step_kinds, (layout, reads, page_size, itemsize) in zip(kinds, layouts, strict=True):
        for s, pages in enumerate(pages_read(layout)):
            assert pages == set((reads[s] // page_size).tolist()), s
        acc = flex_accounting(layout, attn.num_kv_heads, attn.head_dim, itemsize)
        assert acc.score_ratio <= 1.25, (step_kinds, acc)
        assert acc.kv_ratio <= 1.1, (step_kinds, acc)
        seen.add(frozenset(step_kinds))
    assert any(Kind.PREFILL in k for k in seen)
    assert frozenset({Kind.DECODE}) in seen
    assert any({Kind.DECODE, Kind.DEFERRED} <= k for k in seen)
    assert any(skipping)        # the lists of chunks after generated tokens gave their pages from their skips
    assert any(carried)         # and decode rows theirs from their page tables
