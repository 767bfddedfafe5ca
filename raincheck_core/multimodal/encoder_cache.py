"""The vision tower's outputs by input content: an image sent again, in any session, is not encoded again.

The key is a hash of what the tower would read: the kind, the patch grid and the preprocessed pixels
(so the image's content and every processor setting that changes them); an image or video sent as bytes
(or a PIL image) is also named by a hash of those and the processor's settings, so that a repeat skips
decoding and preprocessing as well. An entry holds the merged
embeddings and DeepStack features, and the selection signals when they were computed (ViT attention
received, last-block features: what selectors that score without the query read). Least recently used
entries go first when the byte budget is exceeded. Sessions encode outside the engine lock, so the
cache has a lock of its own.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from ..inputs import VisualInput

MAX_ALIASES = 65536     # input hashes kept (32 bytes each); an entry whose alias went is found by its pixels


@dataclass(frozen=True)
class EncoderCacheStats:
    entries: int
    bytes: int
    hits: int
    misses: int


def pixels_key(kind: str, grid: torch.Tensor, pixels: torch.Tensor) -> bytes:
    """16 bytes naming one visual's tower input (`grid` [3], `pixels` its patches)."""
    h = hashlib.blake2b(f"{kind}:{grid.tolist()}:{pixels.dtype}".encode(), digest_size=16)
    h.update(pixels.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def _size(v: VisualInput) -> int:
    tensors = [v.embeddings, *v.deepstack]
    if v.vision_features is not None:
        tensors.append(v.vision_features)
    tensors += list((v.attention_received or {}).values())
    return sum(t.numel() * t.element_size() for t in tensors)


class EncoderCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[bytes, VisualInput] = OrderedDict()
        self.aliases: OrderedDict[bytes, bytes] = OrderedDict()    # input bytes' hash -> entry key
        self.bytes = 0
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def get(self, key: bytes, signals: bool) -> VisualInput | None:
        """The cached outputs (with the selection signals only if `signals`), or None."""
        with self._lock:
            v = self.entries.get(key)
            if v is None or (signals and v.attention_received is None):
                self.misses += 1
                return None
            self.entries.move_to_end(key)
            self.hits += 1
        return v if signals else replace(v, vision_features=None, attention_received=None)

    def find(self, raws: list[bytes | None], signals: bool) -> list[VisualInput] | None:
        """Every visual named by its input's hash `raws`, or None unless all are cached (then the caller
        preprocesses them all; `get` counts the hits and misses)."""
        with self._lock:
            keys = [self.aliases.get(r) if r is not None else None for r in raws]
            found = [self.entries.get(k) if k is not None else None for k in keys]
            if any(v is None or (signals and v.attention_received is None) for v in found):
                return None
            for k in keys:
                self.entries.move_to_end(k)
            self.hits += len(found)
        return [v if signals else replace(v, vision_features=None, attention_received=None) for v in found]

    def alias(self, raw: bytes, key: bytes) -> None:
        with self._lock:
            self.aliases[raw] = key
            self.aliases.move_to_end(raw)
            while len(self.aliases) > MAX_ALIASES:
                self.aliases.popitem(last=False)

    def put(self, key: bytes, visual: VisualInput) -> None:
        size = _size(visual)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self.bytes -= _size(old)
            self.entries[key] = visual
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, dropped = self.entries.popitem(last=False)
                self.bytes -= _size(dropped)

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self.aliases.clear()
            self.bytes = 0

    def stats(self) -> EncoderCacheStats:
        with self._lock:
            return EncoderCacheStats(len(self.entries), self.bytes, self.hits, self.misses)
