"""`n > 1` answers to one prompt (docs/mechanism.md §12), both families, fp32: the prompt is prefilled once
and its pages shared (the pool's refcounts), each answer decodes on its own pages and GDN state with logits
equal to a single-answer run (<= 1e-5), seeded answers differ (seed + i), the session continues answer 0,
the other answers' pages go back, an image prompt's deferred rows are prefilled with the prompt, and n
too large for the pool is refused up front."""

from __future__ import annotations

import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine.events import TokenEvent
from raincheck_core.errors import RequestTooLargeError
from tests.engine.reference import image_tokens, random_visual

FAMILIES = ["qwen3_vl", "qwen3_5"]
TOL = 1e-5
PROMPT = list(range(10, 50))          # 40 tokens: two full pages of 16 and a partial one
RAINCHECK = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=0, chunk_size=7)


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    """family -> (engine, a reference engine without the prefix cache)."""
    return {f: (Engine.from_pretrained(folder, page_size=16), Engine.from_pretrained(folder, prefix_cache=False))
            for f, (_, folder) in tiny_checkpoints.items()}


def _logits(events: list, choice: int) -> torch.Tensor:
    return torch.stack([e.logits for e in events if isinstance(e, TokenEvent) and e.choice == choice])


def _single(engine: Engine, prompt, params: SamplingParams, cfg: DeferralConfig | None = None):
    session = engine.open_session()
    stream = session.turn(prompt, params, deferral=cfg, return_logits=True)
    events = list(stream)
    return stream.result(), _logits(events, 0), session


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_answers_share_the_prompt_and_equal_one_answer(engines, family):
    engine, ref = engines[family]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, n=3)
    free = engine.pool_stats().free_pages
    rows: list[int] = []
    remove = engine.on_step(lambda stats: rows.append(stats.decode_rows))
    session = engine.open_session()
    stream = session.turn(PROMPT, params, return_logits=True)
    events = []
    # read until every answer has decoded a token of its own, then look at the pool
    while sum(isinstance(e, TokenEvent) and e.index == 1 for e in events) < 3:
        events.append(next(stream))
    kv = engine.kv
    parent = session.cache.table.pages
    branches = [engine.core.caches[f"{session.id}#0.{i}"].table.pages for i in (1, 2)]
    full = len(PROMPT) // kv.page_size
    for pages in branches:
        assert pages[:full] == parent[:full]                    # the prompt's full pages, shared
        assert not set(pages[full:]) & set(parent)              # the partial page copied, the answer's own
    assert not set(branches[0][full:]) & set(branches[1][full:])
    assert all(kv.refs[p] >= 3 for p in parent[:full])
    assert all(kv.refs[p] == 1 for pages in branches for p in pages[full:])
    events += list(stream)
    remove()
    assert rows.count(3) == 5          # the three answers decode in the same steps (tokens 2..6)
    ends = stream.results()
    one, one_logits, _ = _single(ref, PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True))
    for i, end in enumerate(ends):
        assert end.choice == i and end.token_ids == one.token_ids
        assert float((_logits(events, i) - one_logits).abs().max()) <= TOL
    assert ends[0].metrics.prompt_tokens == len(PROMPT)
    # the other answers' pages went back; the session holds answer 0
    assert not [s for s in engine.core.caches if s.startswith(f"{session.id}#")]
    assert session.cache.tokens == PROMPT + one.token_ids[:-1]
    session.close()
    engine.clear_caches()
    assert engine.pool_stats().free_pages == free


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_answers_are_seed_plus_i(engines, family):
    engine, ref = engines[family]
    params = SamplingParams(temperature=1.5, seed=7, max_new_tokens=8, ignore_eos=True, n=3)
    session = engine.open_session()
    stream = session.turn(PROMPT, params, return_logits=True)
    events = list(stream)
    ends = stream.results()
    assert len({tuple(e.token_ids) for e in ends}) > 1
    for i, end in enumerate(ends):
        one, one_logits, _ = _single(ref, PROMPT, SamplingParams(temperature=1.5, seed=7 + i, max_new_tokens=8,
                                                                 ignore_eos=True))
        assert end.token_ids == one.token_ids
        assert float((_logits(events, i) - one_logits).abs().max()) <= TOL
    session.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_session_continues_answer_0(engines, family):
    engine, ref = engines[family]
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=5, ignore_eos=True)
    session = engine.open_session()
    session.turn(PROMPT, SamplingParams(temperature=1.0, seed=3, max_new_tokens=5, ignore_eos=True, n=2)).results()
    nxt = list(session.turn([60, 61, 62], params, return_logits=True))
    _, _, alone = _single(ref, PROMPT, params)
    expected = list(alone.turn([60, 61, 62], params, return_logits=True))
    assert float((_logits(nxt, 0) - _logits(expected, 0)).abs().max()) <= TOL
    session.close()
    alone.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_an_image_prompt_defers_nothing_with_n(engines, family):
    engine, ref = engines[family]
    mc = engine.model_config
    grid = (1, 8, 12)
    prompt = Prompt([5, 6] + image_tokens(grid) + [7, 8, 9],
                    [random_visual("image", grid, mc.hidden_size, mc.deepstack_levels, seed=1)])
    session = engine.open_session(deferral=RAINCHECK)
    stream = session.turn(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True, n=2), return_logits=True)
    events = list(stream)
    ends = stream.results()
    assert all(e.metrics.deferred_tokens == 0 for e in ends) and session.pending_deferred == 0
    one, one_logits, _ = _single(ref, prompt, SamplingParams(max_new_tokens=4, ignore_eos=True),
                                 DeferralConfig("full"))
    for i in (0, 1):
        assert ends[i].token_ids == one.token_ids
        assert float((_logits(events, i) - one_logits).abs().max()) <= TOL
    session.close()


def test_n_too_large_for_the_pool_is_refused(tiny_checkpoints):
    engine = Engine.from_pretrained(tiny_checkpoints["qwen3_vl"][1], num_pages=64)
    session = engine.open_session()
    # the first answer holds 22 pages (40 + 300 slots), each other one 20 (8 + 300): n=2 fits, n=4 does not
    with pytest.raises(RequestTooLargeError, match="n=4 answers of up to 300 tokens after a 40-token context "
                                                   "need 82 KV pages of 16 tokens; this worker's KV pool holds 64"):
        session.turn(PROMPT, SamplingParams(max_new_tokens=300, n=4))
    assert list(engine.core.caches) == [session.id]
    ends = session.turn(PROMPT, SamplingParams(max_new_tokens=3, ignore_eos=True, n=2)).results()
    assert [len(e.token_ids) for e in ends] == [3, 3]
