"""bench/parallel.py on the random `bench` Qwen3.5 checkpoint: what it counts is what tensor parallelism
should move and hold (no timing is asserted)."""

from __future__ import annotations

import json

from bench import parallel
from raincheck_core.models.random_init import SIZES


def test_quick_json_counts_two_all_reduces_per_layer_and_a_halved_shard_per_process(capsys):
    parallel.main(["--quick", "--json"])
    res = json.loads(capsys.readouterr().out)
    (single,), ranks = res["tp"]["1"], res["tp"]["2"]
    hidden, layers, vocab = SIZES["bench"]["hidden"], SIZES["bench"]["layers"], SIZES["bench"]["vocab"]
    row = hidden * 4                                         # one fp32 hidden vector
    for r in ranks:
        # after every mixer and MLP, and the embedding; a decode step adds the plan digest (16 bytes)
        assert r["decode_bytes_per_step"]["all_reduce"] == (2 * layers + 1) * row + 16
        assert r["decode_bytes_per_step"]["all_gather"] == vocab // 2 * 4
        assert abs(r["param_mib"] - single["param_mib"] / 2) < 0.05 * single["param_mib"]
        assert r["load_anon_mib"] < 0.75 * single["load_anon_mib"]
        # never more than its shard while loading either (a whole tensor read before slicing would show)
        assert r["load_peak_anon_mib"] < 0.75 * single["load_peak_anon_mib"]
    assert single["decode_bytes_per_step"] == {"all_reduce": 0, "all_gather": 0}
    # as a user loads it (rank 0 starting the other rank): each process holds half the weights less
    (alone,), started = res["engine_started"]["1"], res["engine_started"]["2"]
    assert len(started) == 2 and "step_ms" in started[0]
    for process in started:
        assert process["anon_mib"] < alone["anon_mib"] - 0.4 * single["param_mib"]
