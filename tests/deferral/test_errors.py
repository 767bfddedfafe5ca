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
    cfg = DeferralConfig("raincheck", selector="explicit", selector_options={"indices": [0, 1, 2, 3, 4, 5, 6, 99]})
    session = engine.open_session(deferral=cfg)
    with pytest.raises(InvalidInputError, match=r"out of range|outside"):
        session.turn(image_prompt(engine))
    assert engine.pool_stats().free_pages == free_pages
    assert engine.gdn.free_slots == free_slots - 1            # only the session's own state slot
    assert session.pending_deferred == 0 and session.cached_tokens == 0
    # the session still works with a valid override
    end = session.turn(image_prompt(engine), SamplingParams(max_new_tokens=2),
                       deferral=DeferralConfig("raincheck", selector="uniform")).result()
    assert end.metrics.deferred_tokens == 16
    session.close()
    assert engine.pool_stats().free_pages == free_pages and engine.gdn.free_slots == free_slots
