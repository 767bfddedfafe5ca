"""A hand-off's payload and result as every rank's part of them, and back.

Ranks started by the caller each ship their own heads to their peer in a receiving group of the same
size. An engine that started its own ranks ships whole heads instead: rank 0 gathers the ranks' parts
and merges them (`merge_payloads`, `merge_results`), and a receiving engine of any tensor_parallel_size
takes each rank's part (`payload_part`, `result_part`), so a TP = 2 decode worker may hand off to a
deferred worker at TP = 1 or 2. What is split: the K/V heads (a rank's `Shard.kv_heads`: replicated
heads appear in several parts, all equal), the GDN recurrent state's value heads, and the GDN conv
history's channels, which are [q | k | v] over all heads in the whole layout and each rank's own
[q | k | v] blocks in its part (as layers/gdn.py holds them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

import torch

from ..config import ModelConfig
from ..deferral.handoff import ResidualPayload, ResidualResult
from .shard import Shard

T = TypeVar("T", ResidualPayload, ResidualResult)


def _conv_channels(cfg: ModelConfig, shard: Shard) -> list[range]:
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    keys, values = shard.even(hk, "the GDN key heads"), shard.even(cfg.linear_num_value_heads, "the GDN value heads")
    return [range(keys.start * dk, keys.stop * dk), range((hk + keys.start) * dk, (hk + keys.stop) * dk),
            range(2 * hk * dk + values.start * dv, 2 * hk * dk + values.stop * dv)]


def _ranges(cfg: ModelConfig, shard: Shard) -> dict[str, list[range]]:
    """The rank's blocks along each split dim: K/V heads, GDN value heads, conv channels."""
    out = {"kv": [shard.kv_heads(cfg.num_kv_heads)]}
    if cfg.linear_num_value_heads:
        out["ssm"] = [shard.even(cfg.linear_num_value_heads, "the GDN value heads")]
        out["conv"] = _conv_channels(cfg, shard)
    return out


def _take(t: torch.Tensor | None, ranges: list[range] | None, dim: int) -> torch.Tensor | None:
    if t is None or ranges is None:
        return t
    index = torch.cat([torch.arange(r.start, r.stop) for r in ranges]).to(t.device)
    return t.index_select(dim, index)


def _place(parts: Sequence[torch.Tensor | None], ranges: Sequence[list[range] | None], dim: int,
           size: int) -> torch.Tensor | None:
    """The whole tensor along `dim` (`size` long) from each rank's part holding its `ranges` there."""
    if parts[0] is None:
        return None
    shape = list(parts[0].shape)
    shape[dim] = size
    out = parts[0].new_empty(shape)
    for part, rs in zip(parts, ranges, strict=True):
        index = torch.cat([torch.arange(r.start, r.stop) for r in rs])
        out.index_copy_(dim, index, part)
    return out


# (field, the _ranges key, dim) of the split tensors
_PAYLOAD = (("context_k", "kv", 2), ("context_v", "kv", 2), ("prefix_ssm", "ssm", 1), ("prefix_conv", "conv", 2))
_RESULT = (("k", "kv", 2), ("v", "kv", 2), ("ssm", "ssm", 1), ("conv", "conv", 2))


def _full_sizes(cfg: ModelConfig) -> dict[str, int]:
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    return {"kv": cfg.num_kv_heads, "ssm": hv,
            "conv": 2 * hk * cfg.linear_key_head_dim + hv * cfg.linear_value_head_dim}


def _part(whole: T, fields: tuple, cfg: ModelConfig, shard: Shard) -> T:
    rs = _ranges(cfg, shard)
    return dataclasses.replace(whole, **{f: _take(getattr(whole, f), rs.get(key), dim) for f, key, dim in fields})


def _merge(parts: Sequence[T], fields: tuple, cfg: ModelConfig) -> T:
    world = len(parts)
    rs = [_ranges(cfg, Shard(r, world)) for r in range(world)]
    sizes = _full_sizes(cfg)
    return dataclasses.replace(parts[0], **{
        f: _place([getattr(p, f) for p in parts], [r.get(key) for r in rs], dim, sizes[key])
        for f, key, dim in fields})


def payload_part(payload: ResidualPayload, cfg: ModelConfig, shard: Shard) -> ResidualPayload:
    """The part of a whole-heads payload a rank of a `shard.world`-rank engine prefills on."""
    return _part(payload, _PAYLOAD, cfg, shard)


def merge_payloads(parts: Sequence[ResidualPayload], cfg: ModelConfig) -> ResidualPayload:
    """The whole-heads payload from every rank's part, in rank order."""
    return _merge(parts, _PAYLOAD, cfg)


def result_part(result: ResidualResult, cfg: ModelConfig, shard: Shard) -> ResidualResult:
    """The part of a whole-heads result a rank joins."""
    return _part(result, _RESULT, cfg, shard)


def merge_results(parts: Sequence[ResidualResult], cfg: ModelConfig) -> ResidualResult:
    """The whole-heads result from every rank's part, in rank order."""
    return _merge(parts, _RESULT, cfg)


def to_cpu(obj: T) -> T:
    """`obj` with its tensors on the CPU (what is gathered and shipped)."""
    def cpu(v: object) -> object:
        if isinstance(v, torch.Tensor):
            return v.cpu()
        if isinstance(v, list):
            return [cpu(x) for x in v]
        return v
    return dataclasses.replace(obj, **{f.name: cpu(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
