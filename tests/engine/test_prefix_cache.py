"""The prefix cache gives the same logits as a fresh engine (fp32, <= 1e-5), for both families: text,
image and video prefixes, under full, hard and raincheck histories, after eviction and copy on write; a
request whose processing history differs finds no page of another's. On one engine, a repeated request
gets bit-identical logits whether its prefix was cached or not."""

from __future__ import annotations

import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine.memory import MAX_DEFAULT_CHECKPOINT_BYTES
from raincheck_core.engine.prefill_cuts import checkpoint_rows
from raincheck_core.multimodal.turn_input import MessageMarks, message_boundaries
from tests import tiny
from tests.deferral.helpers import split
from tests.engine.reference import image_tokens, random_visual, video_tokens

FAMILIES = ["qwen3_vl", "qwen3_5"]
TOL = 1e-5
PAGE = 16
POLICIES = {
    "full": DeferralConfig("full"),
    "hard": DeferralConfig("hard", selector="uniform"),
    "raincheck": DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=0, chunk_size=7),
}


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    """family -> (engine with the prefix cache, fresh engine without it)."""
    return {f: (Engine.from_pretrained(folder), Engine.from_pretrained(folder, prefix_cache=False))
            for f, (_, folder) in tiny_checkpoints.items()}


def _prompt(engine: Engine, kind: str, seed: int) -> Prompt:
    """20 text tokens (a system prompt), then the visual (if any), then a question."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(10, 60, (20,), generator=g).tolist()
    mc = engine.model_config
    if kind == "text":
        return Prompt(text + torch.randint(10, 60, (30,), generator=g).tolist())
    grid = (1, 8, 12) if kind == "image" else (4, 4, 8)
    visual = random_visual(kind, grid, mc.hidden_size, mc.deepstack_levels, seed=seed)
    tokens = image_tokens(grid) if kind == "image" else video_tokens(grid, [11, 12])
    return Prompt(text + tokens + [7, 8, 9], [visual])


def _turn(engine: Engine, prompt, cfg: DeferralConfig = POLICIES["full"], n: int = 4, session=None):
    """(rows served from the prefix cache, logits of each generated token, the session)."""
    session = session or engine.open_session(deferral=cfg)
    stream = session.turn(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), deferral=cfg,
                          return_logits=True)
    logits = torch.stack([e.logits for e in stream.tokens()])
    session.complete_recovery()
    return stream.end.metrics.cached_prompt_tokens, logits, session


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["text", "image", "video"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_hit_matches_a_fresh_engine(engines, family, kind, policy):
    warm, fresh = engines[family]
    cfg = POLICIES[policy]
    prompt = _prompt(warm, kind, seed=10 * list(POLICIES).index(policy) + ["text", "image", "video"].index(kind))
    cached, _, first = _turn(warm, prompt, cfg)
    first.close()      # its pages stay, held by the cache alone
    assert cached == 0
    cached, logits, second = _turn(warm, prompt, cfg)
    _, ref, _ = _turn(fresh, prompt, cfg)
    i0, _ = split(warm, prompt, cfg)
    assert cached == (len(i0) - 1) // PAGE * PAGE
    if kind != "text":
        assert cached > 20         # visual rows came from the cache
    assert _err(logits, ref) <= TOL
    # the session goes on from the shared pages: a next turn is right too (unless the random model's last
    # token is a visual placeholder, which a next turn cannot start with)
    if set(second.cache.pending_ids) & {tiny.IMAGE_TOKEN, tiny.VIDEO_TOKEN, tiny.VISION_START, tiny.VISION_END}:
        return
    cont = [21, 22, 23]
    _, nxt, _ = _turn(warm, cont, cfg, session=second)
    ref_session = fresh.open_session(deferral=cfg)
    _turn(fresh, prompt, cfg, session=ref_session)
    _, nxt_ref, _ = _turn(fresh, cont, cfg, session=ref_session)
    assert _err(nxt, nxt_ref) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["text", "image", "video"])
@pytest.mark.parametrize("policy", ["full", "raincheck"])
def test_a_repeat_is_bit_identical_to_its_cold_run(engines, family, kind, policy):
    """The cold run's prefill ends a step at the page boundary where the repeat's hit ends, so the rest
    runs as the same step in both: the same request gets the same answer, cached or not."""
    warm, _ = engines[family]
    cfg = POLICIES[policy]
    prompt = _prompt(warm, kind, seed=40 + ["text", "image", "video"].index(kind) + 3 * (policy == "full"))
    runs = []
    for _ in range(2):
        cached, logits, session = _turn(warm, prompt, cfg)
        session.close()
        runs.append((cached, logits))
    assert runs[1][0] > runs[0][0]
    assert torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("first,second", [("full", "raincheck"), ("raincheck", "other-selector"),
                                          ("hard", "full")])
def test_a_different_processing_history_gets_no_hit(engines, family, first, second):
    warm, fresh = engines[family]
    cfgs = dict(POLICIES, **{"other-selector": DeferralConfig("raincheck", tpot_slo=None, selector="random",
                                                               guard=0, chunk_size=7)})
    prompt = _prompt(warm, "image", seed=500 + len(first) + 7 * len(second))
    _turn(warm, prompt, cfgs[first])[2].close()
    cached, logits, _ = _turn(warm, prompt, cfgs[second])
    # the text before the image only (on qwen3_5 where the first request kept a GDN checkpoint there: the
    # page boundary before the end of its image in its own I0, when that is the first one)
    assert cached == PAGE if family == "qwen3_vl" else cached in (0, PAGE)
    _, ref, _ = _turn(fresh, prompt, cfgs[second])
    assert _err(logits, ref) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_eviction_frees_cached_pages_first_and_hits_stay_right(tiny_checkpoints, engines, family):
    _, folder = tiny_checkpoints[family]
    _, fresh = engines[family]
    engine = Engine.from_pretrained(folder, num_pages=6, prefix_cache_pages=6)
    a, b = _prompt(engine, "image", seed=901), _prompt(engine, "image", seed=902)   # 49 rows + 4: 4 pages
    _turn(engine, a)[2].close()
    held = engine.pool_stats()
    assert held.cached_pages == 3 and held.free_pages == 6        # pages only the cache holds count as free
    keeper = _turn(engine, b)[2]          # 4 pages with 3 free: a's least recently used page goes
    stats = engine.pool_stats()
    assert stats.cached_pages == 2 + 3 and stats.free_pages == 2    # a's first two, b's three (b holds them)
    keeper.close()
    cached, logits, _ = _turn(engine, a)
    _, ref, _ = _turn(fresh, a)
    assert cached == (32 if family == "qwen3_vl" else 0)    # a's last full page was evicted (and with it
    assert _err(logits, ref) <= TOL                         # the only GDN checkpoint of its prompt)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_caches_stay_within_their_budgets(tiny_checkpoints, family):
    _, folder = tiny_checkpoints[family]
    engine = Engine.from_pretrained(folder, prefix_cache_pages=2, gdn_checkpoint_bytes=1)
    for seed in range(3):
        _turn(engine, _prompt(engine, "text", seed=seed))[2].close()
        assert engine.pool_stats().cached_pages <= 2
    stats = engine.prefix_stats()
    assert stats.checkpoints == 0 and stats.checkpoint_bytes == 0   # one checkpoint is more than a byte


def test_gdn_checkpoints_recycle_the_slots_of_a_slab_taken_at_start(tiny_checkpoints):
    _, folder = tiny_checkpoints["qwen3_5"]
    probe = Engine.from_pretrained(folder)
    slot = probe.core.prefix.slot_bytes
    default = min(MAX_DEFAULT_CHECKPOINT_BYTES, probe.kv.k.nbytes // 2)      # a quarter of the KV pool
    assert probe.core.prefix.slab.ssm.shape[0] == default // slot
    engine = Engine.from_pretrained(folder, gdn_checkpoint_bytes=2 * slot + 1)
    slab = engine.core.prefix.slab
    assert slab.ssm.shape[0] == 2
    prompts = [_prompt(engine, "text", seed=seed) for seed in range(4)]
    for prompt in prompts:                     # a checkpoint each (their last page boundary): 2 slots recycled
        _turn(engine, prompt, n=1)[2].close()
        stats = engine.prefix_stats()
        assert stats.checkpoints <= 2 and stats.checkpoint_bytes <= 2 * slot
    assert slab.ssm.shape[0] == 2              # the slab never grew
    cached, logits, _ = _turn(engine, prompts[-1], n=1)
    _, ref, _ = _turn(Engine.from_pretrained(folder, prefix_cache=False), prompts[-1], n=1)
    assert cached == 48 and _err(logits, ref) <= TOL     # the most recent checkpoint survived, and serves
    assert _turn(engine, prompts[0], n=1)[0] == 0       # the oldest one was recycled: no hit on a hybrid model


@pytest.mark.parametrize("family", FAMILIES)
def test_copy_on_write_when_a_session_rewrites_a_shared_page(engines, family):
    warm, fresh = engines[family]
    g = torch.Generator().manual_seed(77)
    t1, t2, t2b = (torch.randint(10, 60, (n,), generator=g).tolist() for n in (20, 30, 30))
    a = warm.open_session()
    _turn(warm, t1, n=2, session=a)                  # 21 slots: page 1 partly filled
    stream = a.turn(t2, SamplingParams(max_new_tokens=4, ignore_eos=True))
    next(iter(stream))                                # turn 2's rows are in: pages 1 and 2 full and cached
    held = list(a.cache.tokens[:48])
    shared_page = a.cache.table.pages[1]
    a.abort()                                         # back to 21 slots, inside the shared page 1
    assert a.cache.table.pages[1] != shared_page      # copied before anything overwrites it
    _, mine, _ = _turn(warm, t2b, session=a)          # a's own different turn 2 (writes into its copy)
    ref_a = fresh.open_session()
    _turn(fresh, t1, n=2, session=ref_a)
    _, mine_ref, _ = _turn(fresh, t2b, session=ref_a)
    assert _err(mine, mine_ref) <= TOL
    other = held + [30, 31, 32]                       # a new session on what a held before the abort
    cached, logits, _ = _turn(warm, other)
    _, ref, _ = _turn(fresh, other)
    assert cached == 48
    assert _err(logits, ref) <= TOL


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("family,threads,backend,steps", [
    ("qwen3_vl", 2, "native", [600]),
    ("qwen3_5", 1, "native", [600]),    # GDN token by token (the native kernel)
    ("qwen3_5", 2, "native", [600]),    # still token by token, the heads split between the threads
    ("qwen3_5", 2, "torch", [592, 8]),  # the chunked rule: the step ends where hits resume
], indirect=["threads"])
def test_a_prefill_ends_a_step_for_the_prefix_cache_only_where_its_gdn_rows_must(engines, tiny_checkpoints, family,
                                                                                 threads, backend, steps):
    """The 600-row prompt is one step where every op gives a row the same bits whatever rows run beside it
    (attention split where a repeat resumes, 599 -> 592; GDN checkpoints every 256 slots and at 592 taken
    inside it); where the GDN rows would run the chunked rule, the step ends at 592. Either way the repeat
    resumes at 592 and gets the cold run's logits bit for bit."""
    if backend == "native":
        warm, fresh = engines[family]
    else:
        folder = tiny_checkpoints[family][1]
        warm = Engine.from_pretrained(folder, backend=backend)
        fresh = Engine.from_pretrained(folder, backend=backend, prefix_cache=False)
    warm.core.prefix.clear()
    rows: list[int] = []
    remove = warm.on_step(lambda s: rows.append(s.prefill_rows) if s.prefill_rows else None)
    prompt = torch.randint(10, 60, (600,), generator=torch.Generator().manual_seed(5)).tolist()
    _, cold, _ = _turn(warm, prompt, n=1)
    remove()
    assert rows == steps
    if family == "qwen3_5":     # a fork resumes at the checkpoint taken inside the step, and is right
        fork = prompt[:512] + [61, 62, 63]
        cached, logits, _ = _turn(warm, fork, n=1)
        assert cached == 512
        assert _err(logits, _turn(fresh, fork, n=1)[1]) <= TOL
    cached, again, _ = _turn(warm, prompt, n=1)
    assert cached == 592                                                  # the same prompt: all but its tail
    assert torch.equal(cold, again)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["image", "video"])
def test_a_new_question_after_the_same_system_text_and_visual_resumes_before_it(tiny_checkpoints, engines, family,
                                                                                  kind):
    """Two requests with the same system text and visual and different questions: the second gets every page
    before its question from the cache (on qwen3_5 from the GDN checkpoint the first took inside its step at
    the end of its visual), and bit-identical logits to a cold engine, which ends a step there too."""
    warm, _ = engines[family]
    warm.core.prefix.clear()
    first = _prompt(warm, kind, seed=70)
    other = Prompt(first.token_ids[:-3] + [31, 32, 33, 34], first.visuals)
    _turn(warm, first)[2].close()
    cached, logits, _ = _turn(warm, other)
    question = len(other.token_ids) - 4         # its first row: right after the visual
    assert cached == question // PAGE * PAGE > 20
    cold = Engine.from_pretrained(tiny_checkpoints[family][1])
    cold_cached, ref, _ = _turn(cold, other)
    assert cold_cached == 0
    assert torch.equal(logits, ref)


def test_message_boundaries_and_checkpoint_rows():
    """Where a chat prompt's messages and visuals end, and the rows a prefill keeps GDN checkpoints after."""
    marks = MessageMarks(vision_end=9, im_start=1, system=2, user=3)
    #         0  1  2   3   4  5  6  7  8  9  10  11 12 13  14 15
    ids = [1, 2, 50, 51, 1, 3, 8, 70, 9, 60, 61, 1, 4, 0] + [1, 3, 62]
    assert message_boundaries(ids, marks) == [4, 9, 14]      # system ends, the image ends, the last user message
    assert message_boundaries(ids, None) == []
    assert message_boundaries([5, 9, 6], MessageMarks(vision_end=9)) == [2]
    # a prefill of slots [10, 600) on pages of 16 with a grid of 256: the grid's 256 and 512, the marks' page
    # boundaries 32, 48 and 592; a mark whose boundary is where the step ends keeps the step's final state
    assert checkpoint_rows(10, 590, (16, 256), [40, 50, 600]) == (21, 37, 245, 501, 581)
    assert checkpoint_rows(10, 598, (16, 256), [610]) == (245, 501)
    assert checkpoint_rows(10, 590, (16, None), [40]) == ()
