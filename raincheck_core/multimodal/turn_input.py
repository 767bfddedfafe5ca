"""A turn's new input as rows ready for the decoder: embeddings, 3-D positions, DeepStack features."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.prefix import ROW_KEY_WIDTH
from ..config import ModelConfig
from ..errors import InvalidInputError
from ..inputs import VisualInput
from ..models import DecoderLM
from ..multimodal.positions import PromptLayout, compute_positions


@dataclass
class TurnInput:
    token_ids: list[int]
    embeds: torch.Tensor                  # [T, hidden] in the model dtype
    positions: torch.Tensor               # [3, T]
    next_position: int                    # position of the first generated token
    layout: PromptLayout
    deepstack_index: torch.Tensor         # [V] row indices (within this input) of visual tokens
    deepstack: list[torch.Tensor]         # per level, [V, hidden]
    row_keys: torch.Tensor | None = None  # [T, ROW_KEY_WIDTH] what each row is (the prefix cache's key)

    def __len__(self) -> int:
        return len(self.token_ids)

    def subset(self, rows: torch.Tensor) -> TurnInput:
        """Rows `rows` (ascending) of this input, keeping their positions, with DeepStack re-indexed."""
        remap = torch.full((len(self),), -1, dtype=torch.long)
        remap[rows] = torch.arange(len(rows))
        ds_index = remap[self.deepstack_index.cpu()] if self.deepstack_index.numel() else self.deepstack_index
        present = ds_index >= 0
        device = self.embeds.device
        return TurnInput(
            token_ids=[self.token_ids[i] for i in rows.tolist()],
            embeds=self.embeds[rows.to(device)],
            positions=self.positions[:, rows.to(device)],
            next_position=self.next_position,
            layout=self.layout,
            deepstack_index=ds_index[present],
            deepstack=[level[present.to(level.device)] for level in self.deepstack],
            row_keys=self.row_keys[rows] if self.row_keys is not None else None,
        )


def build_turn_input(
    model: DecoderLM, cfg: ModelConfig, token_ids: list[int], visuals: list[VisualInput], start: int
) -> TurnInput:
    """Embed `token_ids`, scatter the visual embeddings over their placeholders, compute positions."""
    if not token_ids:
        raise InvalidInputError("the turn has no input tokens")
    bad = [t for t in token_ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise InvalidInputError(f"token ids out of range [0, {cfg.vocab_size}): {bad[:8]}")
    for v in visuals:
        v.validate(cfg.hidden_size, cfg.spatial_merge_size, cfg.deepstack_levels)
    layout = compute_positions(
        token_ids, visuals, image_token_id=_required(cfg.image_token_id, visuals),
        video_token_id=_required(cfg.video_token_id, visuals), merge=cfg.spatial_merge_size, start=start,
    )
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    with torch.no_grad():
        embeds = model.embed_tokens(ids)
    index_parts, level_parts = [], [[] for _ in range(cfg.deepstack_levels)]
    for span in layout.spans:
        visual = visuals[span.index]
        rows = span.token_indices.to(device)
        embeds[rows] = visual.embeddings.to(device=device, dtype=dtype)
        if cfg.deepstack_levels:
            if not visual.deepstack:
                raise InvalidInputError(
                    f"this model needs {cfg.deepstack_levels} DeepStack feature levels per visual token; "
                    f"the {visual.kind} has none"
                )
            index_parts.append(rows)
            for level, feats in zip(level_parts, visual.deepstack, strict=True):
                level.append(feats.to(device=device, dtype=dtype))
    deepstack_index = torch.cat(index_parts) if index_parts else torch.empty(0, dtype=torch.long)
    deepstack = [torch.cat(parts) for parts in level_parts] if index_parts else []
    return TurnInput(list(token_ids), embeds, layout.positions.to(device), layout.next_position, layout,
                     deepstack_index, deepstack, row_keys(token_ids, layout, visuals))


def row_keys(token_ids: list[int], layout: PromptLayout, visuals: list[VisualInput]) -> torch.Tensor:
    """Per row: token id, its 3 position ids, and for a visual row the visual's digest (two int64) and the
    row's index within the visual (cache/prefix.py)."""
    keys = torch.zeros(len(token_ids), ROW_KEY_WIDTH, dtype=torch.long)
    keys[:, 0] = torch.tensor(token_ids, dtype=torch.long)
    keys[:, 1:4] = layout.positions.cpu().T.long()
    for span in layout.spans:
        rows = span.token_indices.cpu()
        digest = torch.frombuffer(bytearray(visuals[span.index].digest()), dtype=torch.long)
        keys[rows, 4:6] = digest
        keys[rows, 6] = torch.arange(len(rows))
    return keys


def _required(token_id: int | None, visuals: list[VisualInput]) -> int:
    # Text-only checkpoints have no placeholder ids; -1 never matches a real token.
    if token_id is None:
        if visuals:
            raise InvalidInputError("this model has no vision input (no image/video token ids in its config)")
        return -1
    return token_id
