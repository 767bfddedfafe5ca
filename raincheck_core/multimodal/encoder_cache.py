"""The vision tower's outputs by input content: an image sent again, in any session, is not encoded again.

The key is a hash of what the tower would read: the kind, the patch grid and the preprocessed pixels
(so the image's content and every processor setting that changes them). An entry holds the merged
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
            self.bytes = 0

    def stats(self) -> EncoderCacheStats:
        with self._lock:
            return EncoderCacheStats(len(self.entries), self.bytes, self.hits, self.misses)
