"""Training batches: pixels, which visual rows each example shows (curriculum, dropout, deferred order),
and one forward of transformers' Qwen3.5 VLM over the chosen rows with their original 3-D positions."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .data import Layout
from .world import Scene

PATCH, MERGE, TEMPORAL = 16, 2, 2


def pixels(scene: Scene) -> torch.Tensor:
    """The image processor's `pixel_values` for a rendered scene (no resize: cells are 32 px), built
    directly: rescale, normalise with mean = std = 0.5, duplicate the frame, 2×2-block-major patches."""
    x = torch.from_numpy(np.array(scene.image())).permute(2, 0, 1).float() / 255
    x = (x - 0.5) / 0.5
    c, h, w = x.shape
    gh, gw = h // PATCH, w // PATCH
    x = x[None].expand(TEMPORAL, -1, -1, -1)
    x = x.reshape(1, TEMPORAL, c, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    return x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gh * gw, c * TEMPORAL * PATCH * PATCH)


def grid_thw(scene: Scene) -> list[int]:
    return [1, scene.rows * CELL_PATCHES, scene.cols * CELL_PATCHES]


CELL_PATCHES = 2


@dataclass
class Views:
    """How each example shows its image: the fraction of the training run sets the curriculum."""

    curriculum: float = 0.4       # first part of training: the needed cells + a growing set of distractors
    start_distractors: int = 4
    dropout: float = 0.3          # afterwards: share of examples with a random part of the other cells dropped
    deferred_order: float = 0.15  # share of examples in the raincheck order I0 ‖ D ‖ answer (positions kept)


def choose_rows(lay: Layout, progress: float, views: Views, rng: random.Random) -> torch.Tensor:
    """The rows of `lay` this example shows, in processing order; text rows and needed cells always."""
    n = len(lay.visual_rows)
    others = [i for i in range(n) if i not in set(lay.needed.tolist())]
    shown = set(others)
    deferred: list[int] = []
    if progress < views.curriculum:
        k0 = min(views.start_distractors, len(others))
        k = round(k0 * (max(len(others), 1) / max(k0, 1)) ** (progress / views.curriculum))
        shown = set(rng.sample(others, k))
    elif rng.random() < views.dropout:
        shown = set(rng.sample(others, round(len(others) * rng.uniform(0.1, 0.9))))
    elif rng.random() < views.deferred_order / (1 - views.dropout):
        kept = set(rng.sample(range(n), round(0.3 * n)))
        deferred = [i for i in range(n) if i not in kept]
    visible = torch.ones(len(lay.ids), dtype=torch.bool)
    hidden = [i for i in others if i not in shown] + deferred
    visible[lay.visual_rows[hidden]] = False
    rows = torch.nonzero(visible).flatten()
    if not deferred:
        return rows
    cut = lay.answers[0][0]
    d_rows = lay.visual_rows[deferred]
    return torch.cat([rows[rows < cut], d_rows, rows[rows >= cut]])


@dataclass
class Batch:
    pixels: torch.Tensor       # [sum patches, 1536]
    grids: torch.Tensor        # [B, 3]
    flat_ids: torch.Tensor     # [sum T]: every example's full layout, concatenated
    flat_visual: torch.Tensor  # [sum N]: rows of image tokens in flat_ids, image order
    gather: torch.Tensor       # [B, T']: flat row per position (len(flat_ids) = padding)
    positions: torch.Tensor    # [3, B, T']
    mask: torch.Tensor         # [B, T'] 1 = real row
    targets: torch.Tensor      # [B, T'] next-token id at answer rows, -100 elsewhere


def collate(scenes: list[Scene], layouts: list[Layout], rows: list[torch.Tensor]) -> Batch:
    offsets, total = [], 0
    for lay in layouts:
        offsets.append(total)
        total += len(lay.ids)
    width = max(len(r) for r in rows)
    b = len(layouts)
    gather = torch.full((b, width), total, dtype=torch.long)
    positions = torch.zeros(3, b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.long)
    targets = torch.full((b, width), -100, dtype=torch.long)
    for i, (lay, r, off) in enumerate(zip(layouts, rows, offsets, strict=True)):
        gather[i, :len(r)] = r + off
        positions[:, i, :len(r)] = lay.positions[:, r]
        mask[i, :len(r)] = 1
        nxt = torch.full((len(lay.ids),), -100, dtype=torch.long)
        label = lay.label_mask
        nxt[label] = lay.ids[1:][label[:-1]]
        targets[i, :len(r)] = nxt[r]
    return Batch(torch.cat([pixels(s) for s in scenes]), torch.tensor([grid_thw(s) for s in scenes]),
                 torch.cat([lay.ids for lay in layouts]),
                 torch.cat([lay.visual_rows + off for lay, off in zip(layouts, offsets, strict=True)]),
                 gather, positions, mask, targets)


def forward(model, batch: Batch) -> torch.Tensor:
    """Logits [B, T', vocab] of transformers' VLM over each example's chosen rows."""
    visual = model.model.visual(batch.pixels, grid_thw=batch.grids).pooler_output
    lm = model.model.language_model
    flat = lm.embed_tokens(batch.flat_ids).index_put((batch.flat_visual,), visual)
    flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    hidden = lm(inputs_embeds=flat[batch.gather], attention_mask=batch.mask, position_ids=batch.positions)
    return model.lm_head(hidden.last_hidden_state)


def loss_fn(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=-100)
