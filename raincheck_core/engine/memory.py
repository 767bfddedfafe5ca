"""What the engine reserves at start-up: the KV pool, the GDN state pool of a hybrid model, and the prefix
cache with its GDN checkpoints' slab, all allocated (and written) once, so serving moves no memory; and
where prefill steps must end for the prefix cache to serve them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.gdn_state import GDNStatePool
from ..cache.kv_pool import KVPool
from ..cache.prefix import PrefixCache
from ..config import EngineConfig, ModelConfig

MAX_DEFAULT_CHECKPOINT_BYTES = 256 << 20


@dataclass
class EngineMemory:
    kv: KVPool
    gdn: GDNStatePool | None
    prefix: PrefixCache | None
    # (page, every) for the scheduler: prefill steps end at the prompt's last page boundary, where a
    # repeat's hit ends, and at the one before its last message boundary, where a new question's does (the
    # same steps after it: the same answer); a hybrid model's prefills also keep GDN checkpoints inside
    # their steps at message boundaries and every `every` slots (None: no GDN layers); None: no prefix
    # cache, steps end anywhere
    align: tuple[int, int | None] | None


def reserve(cfg: ModelConfig, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> EngineMemory:
    kv = KVPool(cfg.num_attention_layers, config.num_pages, config.page_size, cfg.num_kv_heads, cfg.head_dim,
                dtype, device)
    gdn = None
    if cfg.num_gdn_layers:
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
            cfg.linear_num_value_heads * cfg.linear_value_head_dim
        gdn = GDNStatePool(config.max_gdn_slots, cfg.num_gdn_layers, conv_dim, cfg.linear_conv_kernel,
                           cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                           dtype, device)
    if not config.prefix_cache:
        return EngineMemory(kv, gdn, None, None)
    budget = config.gdn_checkpoint_bytes
    if budget is None:      # a quarter of the pool (K is half of it), at most the fixed default
        budget = min(MAX_DEFAULT_CHECKPOINT_BYTES, kv.k.nbytes // 2)
    prefix = PrefixCache(kv, config.prefix_cache_pages or config.num_pages // 2, budget, gdn)
    every = max(1, config.gdn_checkpoint_every // config.page_size) * config.page_size
    return EngineMemory(kv, gdn, prefix, (config.page_size, every if gdn is not None else None))
