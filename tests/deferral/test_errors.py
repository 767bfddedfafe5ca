"""Bad deferral input gets a clear typed error and leaks nothing."""

from __future__ import annotations

import pytest

from raincheck_core import Engine, InvalidInputError, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from tests.deferral.helpers import image_prompt


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(retention=0.0), "retention"), (dict(retention=1.5), "retention"),
    (dict(selector="magic"), "unknown selector"), (dict(chunk_size=32), "chunk_size"),
    (dict(policy="lazy"), "unknown policy"), (dict(guard=-1), "guard"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        DeferralConfig(**{"policy": "raincheck", **kwargs})


def test_explicit_selection_out_of_range_leaks_nothing(tiny_checkpoints):
    engine = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1])
    free_pages, free_slots = engine.pool_stats().free_pages, engine.gdn.free_slots
    cfg = DeferralConfig("raincheck", tpot_slo=None, selector="explicit",
                         selector_options={"indices": [0, 1, 2, 3, 4, 5, 6, 99]})
    session = engine.open_session(deferral=cfg)
    with pytest.raises(InvalidInputError, match=r"out of range|outside"):
        session.turn(image_prompt(engine))
    assert engine.pool_stats().free_pages == free_pages
    assert engine.gdn.free_slots == free_slots - 1            # only the session's own state slot
    assert session.pending_deferred == 0 and session.cached_tokens == 0
    # the session still works with a valid override
    end = session.turn(image_prompt(engine), SamplingParams(max_new_tokens=2),
                       deferral=DeferralConfig("raincheck", tpot_slo=None, selector="uniform")).result()
    assert end.metrics.deferred_tokens == 16
    session.close()
    assert engine.pool_stats().free_pages == free_pages and engine.gdn.free_slots == free_slots


@pytest.mark.parametrize("selector", ["mmtok", "hiprune", "visionzip", "divprune", "query_topk", "random"])
def test_every_selector_runs_through_the_vision_tower(tiny_checkpoints, tmp_path, selector):
    """Selectors that need ViT attention or features get them from the tower (no fallback)."""
    import shutil

    from raincheck_core import Message
    from raincheck_core.pruning import base
    from tests.multimodal.mm_helpers import QWEN_TEMPLATE, png, save_tokenizer

    folder = shutil.copytree(tiny_checkpoints["qwen3_vl"][1], tmp_path / "ckpt")
    save_tokenizer(folder, QWEN_TEMPLATE)
    engine = Engine.from_pretrained(folder)
    seen = []
    original = base.Selector.select

    def spy(self, ctx, keep):
        seen.append((ctx.vision_features is not None, ctx.attention_received is not None))
        out = original(self, ctx, keep)
        seen.append(self.fallback_used)
        return out

    base.Selector.select = spy
    try:
        cfg = DeferralConfig("raincheck", tpot_slo=None, selector=selector, guard=0, chunk_size=7)
        session = engine.open_session(deferral=cfg)
        end = session.turn(Message("what is this ?", images=[png(96, 64)]), SamplingParams(max_new_tokens=3)).result()
    finally:
        base.Selector.select = original
    assert end.metrics.deferred_tokens > 0
    has_features, has_attention = seen[0]
    assert has_features == has_attention == (selector in ("mmtok", "hiprune", "visionzip"))
    if selector in ("mmtok", "hiprune", "visionzip"):
        assert seen[1] is None          # the real signals were used, no proxy
    session.close()
