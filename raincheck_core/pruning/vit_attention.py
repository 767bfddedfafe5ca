"""Attention-received scores from a transformers Qwen3-VL / Qwen3.5 vision tower (docs/selectors.md §1.3).

The tower runs SDPA / FlashAttention, which never materialise attention probabilities, so a forward
pre-hook on each chosen block's attention module takes that module's input (hidden states, cu_seqlens,
RoPE cos/sin), recomputes the post-RoPE q, k and softmax(q kᵀ / sqrt(d_h)) in fp32, in query chunks and
only within each image's / frame's own cu_seqlens block (the published HiPrune port ignores the
blocks). The hook returns nothing, so the tower's output is unchanged. Per patch j of a block:
s[j] = mean over heads and queries of A[i, j]; per merged token, the mean over its merge group
(Qwen3-VL puts a group's merge**2 patches next to each other, in merged raster order).

Concurrency: the tower is shared by every session, and sessions encode their images on their own threads
at the same time. So the hooks are installed once per tower (`install_attention_capture`, which
`VisionEncoder` calls before the tower is shared) and never added or removed afterwards; each is
stateless and records only for the forward whose thread / asyncio context has an active
`record_attention_received`. A forward from another thread, or one that did not ask for scores, passes
through untouched.
"""

from __future__ import annotations

import inspect
import itertools
import threading
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import InvalidInputError


def default_layers(vision_model: nn.Module) -> dict[str, int]:
    """{"middle": block (depth+1)//2 (1-indexed; HiPrune's object layer), "last": the last block}."""
    depth = len(vision_model.blocks)
    return {"middle": (depth + 1) // 2 - 1, "last": depth - 1}


def merge_group_mean(x: Tensor, merge: int) -> Tensor:
    """Average each run of merge**2 consecutive patch rows: patch level [N_p, ...] -> token level [N, ...]."""
    return x.reshape(x.shape[0] // (merge * merge), merge * merge, *x.shape[1:]).mean(dim=1)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # transformers' apply_rotary_pos_emb_vision (rotate-half), kept in fp32
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    x1, x2 = x.float().chunk(2, dim=-1)
    return x.float() * cos + torch.cat([-x2, x1], dim=-1) * sin


def received_attention(q: Tensor, k: Tensor, cu_seqlens: Tensor, scaling: float, chunk: int = 512) -> Tensor:
    """Mean attention each patch receives within its cu_seqlens block; q, k: [N_p, heads, d_h], post-RoPE."""
    q, k = q.float().transpose(0, 1), k.float().transpose(0, 1)  # [heads, N_p, d_h]
    out = torch.empty(q.shape[1], dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    for start, end in itertools.pairwise(bounds):
        keys = k[:, start:end].transpose(1, 2)
        acc = torch.zeros(end - start, dtype=torch.float32, device=q.device)
        for row in range(start, end, chunk):  # never hold heads x N_p x N_p
            probs = torch.softmax(q[:, row:min(row + chunk, end)] @ keys * scaling, dim=-1)
            acc += probs.sum(dim=(0, 1))
        out[start:end] = acc / (q.shape[0] * (end - start))
    return out


@dataclass
class _Recording:
    """One caller's capture: which attention modules to score (by module), under which layer names."""

    names: dict[nn.Module, list[str]]
    sink: dict[str, Tensor]
    merge: int
    chunk: int


# The active capture of the running thread / asyncio task; None: the tower's hooks do nothing.
_RECORDING: ContextVar[_Recording | None] = ContextVar("raincheck_vit_recording", default=None)
_INSTALLED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_INSTALL_LOCK = threading.Lock()


def _score_hook(attn: nn.Module, args: tuple, kwargs: dict) -> None:
    recording = _RECORDING.get()
    if recording is None or attn not in recording.names:
        return
    bound = inspect.signature(attn.forward).bind(*args, **kwargs).arguments
    hidden, cu_seqlens = bound["hidden_states"], bound["cu_seqlens"]
    cos, sin = bound["position_embeddings"]
    with torch.no_grad():
        n = hidden.shape[0]
        q, k, _ = attn.qkv(hidden).reshape(n, 3, attn.num_heads, -1).unbind(1)
        s = received_attention(_rope(q, cos, sin), _rope(k, cos, sin), cu_seqlens, attn.scaling, recording.chunk)
    s = merge_group_mean(s, recording.merge)
    sink = recording.sink
    for name in recording.names[attn]:
        # several tower calls while recording (images, then videos): scores follow the encoding order
        sink[name] = torch.cat([sink[name], s]) if name in sink else s


def install_attention_capture(vision_model: nn.Module) -> None:
    """Put the (stateless) scoring hook on every block's attention, once per tower. Call it before the
    tower is shared between threads: adding a hook while another thread runs a forward is a race."""
    with _INSTALL_LOCK:
        if vision_model in _INSTALLED:
            return
        for block in vision_model.blocks:
            block.attn.register_forward_pre_hook(_score_hook, with_kwargs=True)
        _INSTALLED.add(vision_model)


@contextmanager
def record_attention_received(vision_model: nn.Module, layers: Mapping[str, int] | None = None,
                              chunk: int = 512) -> Iterator[dict[str, Tensor]]:
    """While active, every tower forward *of this thread / asyncio context* fills the yielded dict: layer
    name -> one score per merged token, concatenated over the encoded items (split by t*h*w // merge**2
    per item). Block indices are 0-based (negative ones count from the end). Forwards of other threads
    record nothing here (nor into their own dict unless they record too)."""
    blocks = vision_model.blocks
    layers = default_layers(vision_model) if layers is None else layers
    names: dict[nn.Module, list[str]] = {}
    for name, index in layers.items():
        if not -len(blocks) <= index < len(blocks):
            raise InvalidInputError(f"ViT layer {name!r}: block {index} out of range, the tower has "
                                    f"{len(blocks)} blocks")
        names.setdefault(blocks[index].attn, []).append(name)
    install_attention_capture(vision_model)
    sink: dict[str, Tensor] = {}
    token = _RECORDING.set(_Recording(names, sink, vision_model.spatial_merge_size, chunk))
    try:
        yield sink
    finally:
        _RECORDING.reset(token)


def attention_received_scores(vision_model: nn.Module, pixel_values: Tensor, grid_thw: Tensor,
                              layers: Mapping[str, int] | None = None, chunk: int = 512) -> dict[str, Tensor]:
    """Run the tower once and return {layer name: [N] attention-received score per merged token}."""
    with torch.no_grad(), record_attention_received(vision_model, layers, chunk) as scores:
        vision_model(pixel_values, grid_thw=grid_thw)
    return scores
