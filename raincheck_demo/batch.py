"""Training batches: pixels, which visual rows each example shows (curriculum, dropout, deferred order),
and one forward of transformers' Qwen3.5 VLM over the chosen rows with their original 3-D positions."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from .data import MERGE, TEMPORAL, Layout, grid_thw
from .world import COLOURS, SHAPES, Dialogue, Scene, Visual

if TYPE_CHECKING:
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

PATCH = 16
COLOUR_INDEX = {c: i for i, c in enumerate(COLOURS)}
SHAPE_INDEX = {s: i for i, s in enumerate(SHAPES)}


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


def visual_pixels(v: Visual) -> torch.Tensor:
    """An image's pixels, or a video's: one temporal patch per world frame, whose `HOLD` = 2 identical
    video frames fill the patch's temporal axis exactly as an image's duplicated frame does."""
    return torch.cat([pixels(scene) for scene in v.frames])


@dataclass
class Views:
    """How each example shows its visuals: the fraction of the training run sets the curriculum."""

    curriculum: float = 0.4       # first part of training: the needed cells + a growing set of distractors
    start_distractors: int = 4
    dropout: float = 0.3          # afterwards: share of examples with a random part of the other cells dropped
    deferred_order: float = 0.35  # share of examples in the raincheck order I0 ‖ D ‖ answer (positions kept)
    bands: float = 0.5            # share of those whose I0 is a band of rows or columns (VisionZip keeps edge columns)


def choose_rows(lay: Layout, progress: float, views: Views, rng: random.Random) -> torch.Tensor:
    """The rows of `lay` this example shows, in processing order; text rows and needed cells always.
    In raincheck's order every visual's deferred part D comes right before the first answer token of the
    turn the visual arrived with (after the row that predicts it), positions kept."""
    n = len(lay.visual_rows)
    needed = set(lay.needed.tolist())
    others = [i for i in range(n) if i not in needed]
    shown = set(others)
    deferred: list[tuple[int, list[int]]] = []      # (row D goes before, D)
    if progress < views.curriculum:
        k0 = min(views.start_distractors, len(others))
        k = round(k0 * (max(len(others), 1) / max(k0, 1)) ** (progress / views.curriculum))
        shown = set(rng.sample(others, k))
    elif rng.random() < views.dropout:
        shown = set(rng.sample(others, round(len(others) * rng.uniform(0.1, 0.9))))
    elif rng.random() < views.deferred_order / (1 - views.dropout):
        for (s, e), turn in zip(lay.visual_spans, lay.arrivals, strict=True):
            band = views.bands > 0 and rng.random() < views.bands     # no draw at 0: the recipe's stream stays
            kept = _band(lay, s, e, rng) if band else set(rng.sample(range(s, e), round(0.3 * (e - s))))
            deferred.append((lay.answers[turn][0], [i for i in range(s, e) if i not in kept]))
    visible = torch.ones(len(lay.ids), dtype=torch.bool)
    hidden = [i for i in others if i not in shown] + [i for _, d in deferred for i in d]
    visible[lay.visual_rows[hidden]] = False
    rows = torch.nonzero(visible).flatten()
    if not deferred:
        return rows
    pieces, done = [], 0
    for cut, d in sorted(deferred, key=lambda x: x[0]):
        pieces += [rows[(rows >= done) & (rows < cut)], lay.visual_rows[d]]
        done = cut
    return torch.cat([*pieces, rows[rows >= done]])


def _band(lay: Layout, s: int, e: int, rng: random.Random) -> set[int]:
    """Indices in [s, e) of the visual's cells in a random band of rows or columns, ~30% of its extent (in
    every frame): a spatially clustered I0, as real selectors keep (VisionZip's scores, for one, favour
    some columns), where random cells would never show the model a region deferred as a whole."""
    coord = lay.positions[rng.choice((1, 2)), lay.visual_rows[s:e]].clone()
    frames = lay.ordinals[s:e]
    for f in frames.unique():           # each frame's positions start at the running position
        coord[frames == f] -= coord[frames == f].min()
    extent = int(coord.max()) + 1
    width = max(1, round(0.3 * extent))
    start = rng.randrange(extent - width + 1)
    return {s + i for i in torch.nonzero((coord >= start) & (coord < start + width)).flatten().tolist()}


@dataclass
class Batch:
    pixels: torch.Tensor       # [sum patches, 1536]
    grids: torch.Tensor        # [visuals, 3]
    flat_ids: torch.Tensor     # [sum T]: every example's full layout, concatenated
    flat_visual: torch.Tensor  # [sum N]: rows of visual tokens in flat_ids, in the tower's output order
    gather: torch.Tensor       # [B, T']: flat row per position (len(flat_ids) = padding)
    positions: torch.Tensor    # [3, B, T']
    mask: torch.Tensor         # [B, T'] 1 = real row
    targets: torch.Tensor      # [B, T'] next-token id at answer rows, -100 elsewhere
    content: torch.Tensor      # [sum N, 2]: colour and shape index of every visual token (tower order)
    cells: torch.Tensor        # [B, T', 3]: (row, column, image or frame number) at each visual row, -100 elsewhere
    pointers: torch.Tensor     # [P, 3]: (example, position, position of the cell its answer token names)
    lengths: torch.Tensor      # [B, T']: objects in the line a list answer names, at its rows; -100 elsewhere


def _cell_labels(dialogue: Dialogue, lay: Layout) -> torch.Tensor:
    """[N, 3]: row, column and image/frame number of every visual token of `dialogue`."""
    parts = []
    for v in dialogue.visuals:
        n = torch.arange(len(v.frames) * v.cells) % v.cells
        parts.append(torch.stack([n // v.scene.cols, n % v.scene.cols], dim=1))
    return torch.cat([torch.cat(parts), lay.ordinals[:, None]], dim=1)


def collate(dialogues: list[Dialogue], layouts: list[Layout], rows: list[torch.Tensor]) -> Batch:
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
    cells = torch.full((b, width, 3), -100, dtype=torch.long)
    lengths = torch.full((b, width), -100, dtype=torch.long)
    pointers: list[tuple[int, int, int]] = []
    for i, (lay, r, off, dialogue) in enumerate(zip(layouts, rows, offsets, dialogues, strict=True)):
        gather[i, :len(r)] = r + off
        positions[:, i, :len(r)] = lay.positions[:, r]
        mask[i, :len(r)] = 1
        nxt = torch.full((len(lay.ids),), -100, dtype=torch.long)
        label = lay.label_mask
        nxt[label] = lay.ids[1:][label[:-1]]
        targets[i, :len(r)] = nxt[r]
        where = torch.full((len(lay.ids), 3), -100, dtype=torch.long)
        where[lay.visual_rows] = _cell_labels(dialogue, lay)
        cells[i, :len(r)] = where[r]
        line = torch.full((len(lay.ids),), -100, dtype=torch.long)
        for q, (s, e) in zip(dialogue.questions, lay.answers, strict=True):
            if q.kind == "list":
                line[s - 1:e - 1] = len(q.cells)
        lengths[i, :len(r)] = line[r]
        at = torch.full((len(lay.ids),), -1, dtype=torch.long)
        at[r] = torch.arange(len(r))
        for row, cell in lay.pointers.tolist():
            pointers.append((i, int(at[row]), int(at[lay.visual_rows[cell]])))
    visuals = [v for d in dialogues for v in d.visuals]
    content = [[COLOUR_INDEX[col], SHAPE_INDEX[shp]] for v in visuals for scene in v.frames
               for line in scene.objects for col, shp in line]
    return Batch(torch.cat([visual_pixels(v) for v in visuals]), torch.tensor([grid_thw(v) for v in visuals]),
                 torch.cat([lay.ids for lay in layouts]),
                 torch.cat([lay.visual_rows + off for lay, off in zip(layouts, offsets, strict=True)]),
                 gather, positions, mask, targets, torch.tensor(content), cells,
                 torch.tensor(pointers, dtype=torch.long).view(-1, 3), lengths)


class Probes(torch.nn.Module):
    """Training-only read-outs and targets (discarded when the model is saved). Each gives the slow steps of
    the lookup its own signal, so that they learn in minutes rather than after a long plateau:
    - content: colour and shape of every cell, linearly from the vision tower's output;
    - position: row, column and image (or video frame) number of every shown cell, from the decoder's
      hidden state after `position_layer` (the tower has no position embedding: the decoder must get row
      and column from the 3-D M-RoPE positions, and which image or frame from what came before);
    - query: at each answer row naming a cell, that cell's row, column and image/frame number, from the
      input of the last attention layer (the question's cell must reach the row that looks it up);
    - pointer: that row's attention (head 0 of the last attention layer) on the cell;
    - extent: at each row predicting a list answer, the length of the listed row or column, from the input
      of the last attention layer (a list's last item is where the image ends, which nothing in the text
      says: without this signal the model learned every object of a list but not where to stop)."""

    def __init__(self, hidden: int, position_layer: int, max_cells: int = 16):
        super().__init__()
        self.position_layer = position_layer
        self.max_cells = max_cells
        self.content = torch.nn.Linear(hidden, len(COLOURS) + len(SHAPES))
        self.position = torch.nn.Linear(hidden, 3 * max_cells)
        self.query = torch.nn.Linear(hidden, 3 * max_cells)
        self.extent = torch.nn.Linear(hidden, max_cells + 1)

    def _cells(self, head: torch.nn.Linear, hidden: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
        logits = head(hidden).view(*hidden.shape[:-1], 3, self.max_cells)
        return F.cross_entropy(logits.reshape(-1, self.max_cells), cells.reshape(-1), ignore_index=-100)

    def losses(self, visual: torch.Tensor, hidden: tuple[torch.Tensor, ...], attention: torch.Tensor,
               batch: Batch) -> dict[str, torch.Tensor]:
        c = self.content(visual)
        b, row, cell = batch.pointers.unbind(1)
        listing = batch.lengths >= 0
        extent = F.cross_entropy(self.extent(hidden[-2][listing]), batch.lengths[listing], reduction="sum")
        return {
            "content": F.cross_entropy(c[:, :len(COLOURS)], batch.content[:, 0])
            + F.cross_entropy(c[:, len(COLOURS):], batch.content[:, 1]),
            "position": self._cells(self.position, hidden[self.position_layer + 1], batch.cells),
            "query": self._cells(self.query, hidden[-2][b, row], batch.cells[b, cell]),
            "pointer": -torch.log(attention[b, 0, row, cell] + 1e-6).mean(),
            "extent": extent / max(1, int(listing.sum())),    # a batch may hold no list question
        }


def patch_embed_as_matmul(vision: Qwen3_5VisionModel) -> None:
    """Training speed: the patch embedding's Conv3d (kernel = stride = the whole patch) as one matmul."""
    conv = vision.patch_embed.proj

    def forward(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(conv.weight.dtype), conv.weight.flatten(1), conv.bias)

    vision.patch_embed.forward = forward


def language_model(model: Qwen3_5ForConditionalGeneration, batch: Batch, probes: bool = False
                   ) -> tuple[torch.Tensor, BaseModelOutputWithPast]:
    """The visual embeddings and the output of transformers' text decoder over each example's chosen rows
    (`last_hidden_state` after the final norm: what the LM head reads); with `probes`, every layer's hidden
    states and attention probabilities too (the model must use eager attention then)."""
    visual = model.model.visual(batch.pixels, grid_thw=batch.grids).pooler_output
    lm = model.model.language_model
    flat = lm.embed_tokens(batch.flat_ids).index_put((batch.flat_visual,), visual)
    flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    return visual, lm(inputs_embeds=flat[batch.gather], attention_mask=batch.mask, position_ids=batch.positions,
                      output_hidden_states=probes, output_attentions=probes)


def forward(model: Qwen3_5ForConditionalGeneration, batch: Batch, probes: bool = False
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """Logits [B, T', vocab] of transformers' VLM over each example's chosen rows; with `probes`, also the
    visual embeddings, every layer's hidden states and the last attention layer's probabilities (the
    model must use eager attention then)."""
    visual, out = language_model(model, batch, probes)
    logits = model.lm_head(out.last_hidden_state)
    if not probes:
        return logits
    return logits, visual, out.hidden_states, out.attentions[-1]


def loss_fn(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=-100)
