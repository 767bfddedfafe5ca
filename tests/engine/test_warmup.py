"""Warm-up and calibration (raincheck_core/warmup.py): what a worker runs before it reports ready."""

from __future__ import annotations

from raincheck_core import Engine
from raincheck_core.deferral.policy import CHUNK_SIZES
from raincheck_core.warmup import BATCH_SIZES, warm_up


def test_calibration_measures_every_bucket_and_batch_size_and_leaves_the_engine_as_it_was(tiny_checkpoints):
    engine = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1])
    free = engine.pool_stats().free_pages
    assert engine.scheduler.cost.plain_s(1) is None and engine.scheduler.cost.chunk_cost() is None
    report = warm_up(engine)
    cost = engine.scheduler.cost
    assert report.chunk_buckets == len(CHUNK_SIZES) and cost.chunk_cost() is not None
    assert set(BATCH_SIZES) <= cost.batches_measured()
    assert not engine.sessions and engine.pool_stats().free_pages == free and not engine.has_work()


def test_without_calibration_one_plain_turn(tiny_checkpoints):
    engine = Engine.from_pretrained(tiny_checkpoints["qwen3_vl"][1])
    report = warm_up(engine, calibrate=False)
    assert report.steps >= 2 and report.chunk_buckets == 0
    assert engine.scheduler.cost.plain_s(1) is not None and not engine.sessions
