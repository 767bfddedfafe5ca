"""transformers' own forward on the same inputs the engine sees: the reference for logit matching."""

from __future__ import annotations

import torch

from raincheck_core import VisualInput
from tests import tiny


def mm_token_types(ids: torch.Tensor, text_mask: torch.Tensor | None = None) -> torch.Tensor:
    types = torch.zeros_like(ids, dtype=torch.int32)
    types[ids == tiny.IMAGE_TOKEN] = 1
    types[ids == tiny.VIDEO_TOKEN] = 2
    if text_mask is not None:
        types[text_mask] = 0
    return types


def hf_positions(model, ids: torch.Tensor, visuals: list[VisualInput],
                 text_mask: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' get_rope_index for one sequence: `[3, T]`. `text_mask` marks tokens that are text
    whatever their id (generated tokens: a random model may well sample a placeholder id)."""
    images = [v.grid_thw for v in visuals if v.kind == "image"]
    videos = [v.grid_thw for v in visuals if v.kind == "video"]
    pos, _ = model.model.get_rope_index(
        ids[None], mm_token_types(ids, text_mask)[None],
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor(videos) if videos else None,
    )
    return pos[:, 0]


def hf_logits(model, ids: torch.Tensor, visuals: list[VisualInput] | None = None,
              text_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits `[T, vocab]` of transformers' text decoder with the visual embeddings scattered in."""
    visuals = visuals or []
    lm = model.model.language_model
    with torch.no_grad():
        embeds = lm.embed_tokens(ids).clone()
        vis_mask = mm_token_types(ids, text_mask) > 0
        if visuals:
            embeds[vis_mask] = torch.cat([v.embeddings for v in visuals])
        kwargs = {}
        if visuals and visuals[0].deepstack:
            levels = zip(*[v.deepstack for v in visuals], strict=True)
            kwargs = dict(visual_pos_masks=vis_mask[None], deepstack_visual_embeds=[torch.cat(lv) for lv in levels])
        pos = hf_positions(model, ids, visuals, text_mask)
        h = lm(inputs_embeds=embeds[None], position_ids=pos[:, None], use_cache=False, **kwargs).last_hidden_state
        return model.lm_head(h)[0].float()


def random_visual(kind: str, grid: tuple[int, int, int], hidden: int, levels: int, seed: int) -> VisualInput:
    g = torch.Generator().manual_seed(seed)
    n = grid[0] * grid[1] * grid[2] // 4
    return VisualInput(kind, torch.randn(n, hidden, generator=g), grid,
                       [torch.randn(n, hidden, generator=g) for _ in range(levels)])


def image_tokens(grid: tuple[int, int, int]) -> list[int]:
    n = grid[0] * grid[1] * grid[2] // 4
    return [tiny.VISION_START] + [tiny.IMAGE_TOKEN] * n + [tiny.VISION_END]


def video_tokens(grid: tuple[int, int, int], stamp_tokens: list[int]) -> list[int]:
    """Per temporal patch: a timestamp text token, then that frame's tokens, as the processor lays them out."""
    per_frame = grid[1] * grid[2] // 4
    out: list[int] = []
    for f in range(grid[0]):
        out += [stamp_tokens[f % len(stamp_tokens)], tiny.VISION_START] + [tiny.VIDEO_TOKEN] * per_frame
        out += [tiny.VISION_END]
    return out
