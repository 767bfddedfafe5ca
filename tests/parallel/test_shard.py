"""Which part of each head set, width and vocabulary a rank holds (no processes)."""

from __future__ import annotations

import pytest

from raincheck_core.config import EngineConfig, ModelConfig
from raincheck_core.errors import InvalidInputError
from raincheck_core.parallel import Shard
from raincheck_core.parallel.shard import rank_config
from tests import tiny


def test_even_blocks_and_their_errors():
    assert [Shard(r, 4).even(8, "heads") for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(InvalidInputError, match=r"heads \(6\) must be divisible by tensor_parallel_size \(4\)"):
        Shard(0, 4).even(6, "heads")


def test_blocks_of_an_odd_count_cover_it_once():
    blocks = [Shard(r, 2).block(7) for r in range(2)]
    assert blocks == [range(0, 4), range(4, 7)]
    assert [Shard(r, 4).block(7) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]


def test_kv_heads_split_or_replicated_to_the_ranks_whose_queries_read_them():
    assert [Shard(r, 2).kv_heads(4) for r in range(2)] == [range(0, 2), range(2, 4)]
    # 2 KV heads over 4 ranks: query blocks 0-1 read head 0, 2-3 head 1 (GQA groups of 4 query heads of 8)
    assert [Shard(r, 4).kv_heads(2) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    with pytest.raises(InvalidInputError):
        Shard(0, 4).kv_heads(3)


def test_a_rank_config_holds_the_rank_heads_only():
    cfg = ModelConfig.from_dict(tiny.build_config("qwen3_5").to_dict())
    local = rank_config(cfg, Shard(1, 2))
    assert (local.num_heads, local.num_kv_heads) == (cfg.num_heads // 2, cfg.num_kv_heads // 2)
    assert (local.linear_num_key_heads, local.linear_num_value_heads) == (1, 2)
    assert (local.vocab_size, local.hidden_size) == (cfg.vocab_size, cfg.hidden_size)
    assert rank_config(cfg, Shard(0, 1)) is cfg


def test_tensor_parallel_size_defaults_to_one_or_the_environment(monkeypatch):
    assert EngineConfig().tensor_parallel_size == 1
    monkeypatch.setenv("RAINCHECK_TENSOR_PARALLEL_SIZE", "2")
    assert EngineConfig().tensor_parallel_size == 2
    with pytest.raises(InvalidInputError):
        EngineConfig(tensor_parallel_size=0)

