"""The common selector interface (docs/mechanism.md §2, docs/selectors.md §2).

A selector picks which visual tokens of ONE span (an image, or a video's tokens) go into the first
prefill; the others are deferred. It sees only what the engine has before the LLM prefill
(`SelectionContext`). Every selector returns exactly `keep` distinct indices in `[0, N)`, sorted in
source order, as a `torch.long` tensor on the embeddings' device, and is deterministic.

Missing signals: a selector whose signal is absent falls back to a documented substitute, records
the reason in `selector.fallback_used` (None when the real signal was used) and logs it once per
selector instance.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import InvalidInputError

logger = logging.getLogger(__name__)


@dataclass
class SelectionContext:
    """What the engine knows about one span before the LLM prefill.

    embeddings: [N, d] merged visual embeddings E (the LLM input rows).
    grid: merged grid (t, Hg, Wg), tokens row-major per frame, frames in time order; N = t * Hg * Wg.
    query: [m, d] `embed_tokens` rows of the current question (first user turn), or None.
    vision_features: [N, d_v] F, last-ViT-block hidden states averaged per merge group, or None.
    attention_received: per named ViT layer ("middle", "last"), a length-N attention-received score
        (docs/selectors.md §1.3; see `vit_attention`), or None.
    """

    embeddings: Tensor
    grid: tuple[int, int, int]
    query: Tensor | None = None
    vision_features: Tensor | None = None
    attention_received: dict[str, Tensor] | None = None

    def __post_init__(self) -> None:
        if self.embeddings.dim() != 2:
            shape = tuple(self.embeddings.shape)
            raise InvalidInputError(f"span embeddings must be [N, d], got shape {shape}")
        if len(self.grid) != 3 or min(self.grid) <= 0:
            raise InvalidInputError(f"merged grid must be three positive ints (t, Hg, Wg), got {self.grid}")
        t, h, w = self.grid
        if t * h * w != self.n:
            raise InvalidInputError(f"merged grid {self.grid} has {t * h * w} tokens, E has {self.n}")
        d = self.embeddings.shape[1]
        if self.query is not None and (self.query.dim() != 2 or self.query.shape[1] != d):
            raise InvalidInputError(f"query must be [m, {d}], got shape {tuple(self.query.shape)}")
        if self.vision_features is not None and (
            self.vision_features.dim() != 2 or self.vision_features.shape[0] != self.n
        ):
            raise InvalidInputError(
                f"vision_features must be [{self.n}, d_v], got shape {tuple(self.vision_features.shape)}"
            )
        for name, score in (self.attention_received or {}).items():
            if tuple(score.shape) != (self.n,):
                raise InvalidInputError(
                    f"attention_received[{name!r}] must have shape ({self.n},), got {tuple(score.shape)}"
                )

    @property
    def n(self) -> int:
        return self.embeddings.shape[0]

    @property
    def device(self) -> torch.device:
        return self.embeddings.device


def check_selection(indices: Tensor, n: int, keep: int, who: str) -> Tensor:
    """Validate a selection (1-D integers, `keep` of them, in range, distinct); return it sorted, long."""
    if not isinstance(indices, Tensor):
        raise InvalidInputError(f"{who}: indices must be a tensor or a sequence of ints")
    if indices.dim() != 1 or indices.dtype.is_floating_point or indices.dtype.is_complex:
        raise InvalidInputError(
            f"{who}: indices must be a 1-D integer tensor, got {indices.dtype} shape {tuple(indices.shape)}"
        )
    if indices.numel() != keep:
        raise InvalidInputError(f"{who}: returned {indices.numel()} indices, the budget is exactly {keep}")
    out = torch.sort(indices.long()).values
    if keep and (out[0] < 0 or out[-1] >= n):
        bad = out[(out < 0) | (out >= n)].tolist()
        raise InvalidInputError(f"{who}: indices {bad[:8]} are out of range [0, {n})")
    dup = out[1:][out[1:] == out[:-1]]
    if dup.numel():
        raise InvalidInputError(f"{who}: duplicate indices {dup.unique().tolist()[:8]}")
    return out


def top_indices(score: Tensor, k: int) -> Tensor:
    """The k highest scores' indices; ties go to the lowest index (stable sort on -score, in fp32)."""
    return torch.sort(score.float(), descending=True, stable=True).indices[:k]


class Selector(ABC):
    """Base class: `select` handles the budget edge cases and validates; subclasses implement `_select`."""

    name: str = ""

    def __init__(self) -> None:
        self.fallback_used: str | None = None
        self._logged: set[str] = set()

    def select(self, ctx: SelectionContext, keep: int) -> Tensor:
        """`keep` source-ordered distinct indices of the span (all if keep >= N, none if keep == 0)."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise InvalidInputError(f"keep must be a non-negative int, got {keep!r}")
        self.fallback_used = None
        n = ctx.n
        if keep >= n:
            return torch.arange(n, device=ctx.device)
        if keep == 0:
            return torch.empty(0, dtype=torch.long, device=ctx.device)
        return check_selection(self._select(ctx, keep), n, keep, f"selector {self.name!r}").to(ctx.device)

    @abstractmethod
    def _select(self, ctx: SelectionContext, keep: int) -> Tensor:
        """Pick exactly `keep` indices for 0 < keep < N."""

    def note_fallback(self, reason: str) -> None:
        """The selection falls back (a missing signal): recorded in `fallback_used`, logged once per reason."""
        self.fallback_used = reason if self.fallback_used is None else f"{self.fallback_used}; {reason}"
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("selector %s: %s", self.name, reason)


def attention_or_proxy(selector: Selector, ctx: SelectionContext, layer: str) -> Tensor:
    """The attention-received score of `layer`, or the L2 norm of E when the tower gave none.

    The norm proxy is the substitute of docs/selectors.md §1.3 (a per-token norm, there the mean
    key norm): tokens that receive much ViT attention tend to be high-norm ones. It is NOT validated
    and results obtained with it must be reported as a different method; `fallback_used` says so.
    """
    scores = ctx.attention_received or {}
    if layer in scores:
        return scores[layer].float()
    selector.note_fallback(f"no {layer!r} attention scores; using the L2 norm of the embeddings as a proxy")
    return ctx.embeddings.float().norm(dim=1)


def cosine_matrix(a: Tensor, b: Tensor, eps: float = 1e-8) -> Tensor:
    """Cosine similarities [len(a), len(b)] in fp32; all-zero rows give 0, not NaN."""
    a, b = a.float(), b.float()
    a = a / a.norm(dim=1, keepdim=True).clamp_min(eps)
    b = b / b.norm(dim=1, keepdim=True).clamp_min(eps)
    return a @ b.T
