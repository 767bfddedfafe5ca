"""Tensor and expert parallelism: the rank group (group.py) and which part of each weight a rank holds
(shard.py). At `tensor_parallel_size` 1 nothing here is used: the decoder is built as before."""

from .group import RankGroup, init_rank_group
from .shard import Shard

__all__ = ["RankGroup", "Shard", "init_rank_group"]
