"""Which part of each weight and head set a rank holds, Megatron-style.

Attention and GDN heads, MLP widths and the shared expert split evenly and contiguously (rank r holds
block r); KV heads, when fewer than the ranks, are replicated: each serves the `world / kv_heads` ranks
whose query heads read it. Experts (expert parallelism) and the vocabulary split into contiguous blocks
of `ceil(n / world)` (the last rank's shorter), so an odd expert count or vocabulary still splits and
the vocabulary-parallel logits gather in equal parts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import ModelConfig
from ..errors import InvalidInputError


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int

    def even(self, n: int, what: str) -> range:
        """This rank's block of `n` items that must split evenly (heads, widths)."""
        if n % self.world:
            raise InvalidInputError(f"{what} ({n}) must be divisible by tensor_parallel_size ({self.world})")
        size = n // self.world
        return range(self.rank * size, (self.rank + 1) * size)

    def block(self, n: int) -> range:
        """This rank's block of `n` items in blocks of `ceil(n / world)` (experts, vocabulary rows)."""
        size = -(-n // self.world)
        return range(min(n, self.rank * size), min(n, (self.rank + 1) * size))

    def kv_heads(self, n: int) -> range:
        """The KV heads this rank's query heads read: its even block, or one replicated head when the
        ranks outnumber the KV heads."""
        if n >= self.world:
            return self.even(n, "the number of KV heads")
        if self.world % n:
            raise InvalidInputError(f"tensor_parallel_size ({self.world}) must be a multiple of the KV heads ({n})")
        head = self.rank // (self.world // n)
        return range(head, head + 1)


def rank_config(cfg: ModelConfig, shard: Shard | None) -> ModelConfig:
    """`cfg` with the head counts one rank holds: what its KV pool, GDN state pool and runner are sized
    by. Every other field (vocabulary, widths, experts) stays the checkpoint's."""
    if shard is None or shard.world == 1:
        return cfg
    gdn = {}
    if cfg.linear_num_value_heads:
        gdn = dict(linear_num_key_heads=len(shard.even(cfg.linear_num_key_heads, "the GDN key heads")),
                   linear_num_value_heads=len(shard.even(cfg.linear_num_value_heads, "the GDN value heads")))
    return dataclasses.replace(cfg, num_heads=len(shard.even(cfg.num_heads, "the attention heads")),
                               num_kv_heads=len(shard.kv_heads(cfg.num_kv_heads)), **gdn)
