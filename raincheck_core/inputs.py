"""What a turn feeds the engine: token ids with visual placeholders, plus the visual tokens themselves.

`Message` is the chat-level input (text + images/videos); the multimodal processor turns it into a
`Prompt`, the token-level form the engine runs. Callers that run their own vision encoder (tests, an
encoder on another machine) build a `Prompt` directly with precomputed `VisualInput`s.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

import torch

from .errors import InvalidInputError

VisualKind = Literal["image", "video"]


@dataclass
class VisualInput:
    """One image or one video as LLM visual tokens (after the vision merger).

    `grid_thw` is in vision patches before the spatial merge, as transformers' `image_grid_thw`:
    the span has `t * h * w // merge**2` tokens, row-major over the merged grid, frames in time order.
    `deepstack` holds one `[N, hidden]` tensor per DeepStack level (Qwen3-VL), empty otherwise.
    `vision_features` (`[N, d_vision]`, last ViT block averaged per merge group) and
    `attention_received` (per named ViT layer, a length-N score) feed the selectors that use them;
    without them those selectors fall back to embedding-based proxies (see raincheck_core.pruning).
    `content_hash`: a strong hash of what the tokens were made from (the vision encoder sets it from the
    preprocessed pixels and the processor's settings); without it `digest()` hashes the tokens themselves.
    """

    kind: VisualKind
    embeddings: torch.Tensor
    grid_thw: tuple[int, int, int]
    deepstack: list[torch.Tensor] = field(default_factory=list)
    vision_features: torch.Tensor | None = None
    attention_received: dict[str, torch.Tensor] | None = None
    content_hash: bytes | None = None

    def digest(self) -> bytes:
        """16 bytes naming this visual's tokens (the prefix cache's key for its rows)."""
        if self.content_hash is None:
            h = hashlib.blake2b(self.kind.encode() + str(self.grid_thw).encode(), digest_size=16)
            for t in [self.embeddings, *self.deepstack]:
                h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            self.content_hash = h.digest()
        return self.content_hash

    def num_tokens(self, merge: int) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (merge * merge)

    def validate(self, hidden: int, merge: int, deepstack_levels: int) -> None:
        t, h, w = self.grid_thw
        if min(t, h, w) <= 0 or h % merge or w % merge:
            raise InvalidInputError(
                f"{self.kind} grid {self.grid_thw} must be positive with h, w divisible by the merge size {merge}"
            )
        n = self.num_tokens(merge)
        if self.embeddings.dim() != 2 or tuple(self.embeddings.shape) != (n, hidden):
            raise InvalidInputError(
                f"{self.kind} embeddings have shape {tuple(self.embeddings.shape)}, expected ({n}, {hidden}) "
                f"for grid {self.grid_thw}"
            )
        if len(self.deepstack) not in (0, deepstack_levels):
            raise InvalidInputError(
                f"{self.kind} has {len(self.deepstack)} DeepStack levels, the model uses {deepstack_levels}"
            )
        for level in self.deepstack:
            if tuple(level.shape) != (n, hidden):
                raise InvalidInputError(f"DeepStack feature shape {tuple(level.shape)}, expected ({n}, {hidden})")


@dataclass
class Prompt:
    """Token ids of one turn's new input, with one placeholder id per visual token, and the visuals in order."""

    token_ids: list[int]
    visuals: list[VisualInput] = field(default_factory=list)


@dataclass(frozen=True)
class RenderOptions:
    """How a message is rendered into its prompt (None, empty: the checkpoint's defaults): extra variables of
    the chat template (e.g. `{"enable_thinking": False}`), and its visuals' preprocessing: the pixel range an
    image is resized into, the rate its videos' frames were sampled at. `ChatFormatter` checks them."""

    template_kwargs: dict = field(default_factory=dict)
    min_pixels: int | None = None
    max_pixels: int | None = None
    fps: float | None = None


@dataclass
class Message:
    """One user message: text plus images (PIL images, encoded bytes or file paths) and videos (lists of frames)."""

    text: str
    images: list[object] = field(default_factory=list)
    videos: list[list[object]] = field(default_factory=list)
    role: str = "user"
    render: RenderOptions = field(default_factory=RenderOptions)
