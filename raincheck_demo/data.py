"""Dialogues as the engine lays them out: one token sequence with 3-D positions and answer labels.

Each turn is rendered by the engine's own `ChatFormatter.build_prompt` (the checkpoint's chat template,
placeholders expanded to one `<|image_pad|>` per grid cell, a video's `<t seconds>` blocks per temporal
patch) through `GridOnly`, which stands in for the vision encoder and gives each visual its grid without
running a tower. Every answer is followed by `<|im_end|>`, which the engine keeps and prefills at the start
of the next turn. So the sequence equals what a `full` session holds after the last answer, and its
positions are the engine's (`compute_positions`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from raincheck_core.inputs import Message, VisualInput
from raincheck_core.multimodal.chat import ChatFormatter
from raincheck_core.multimodal.positions import compute_positions
from raincheck_core.multimodal.vision import VideoSettings, VisionEncoder

from . import tokenizer as tk
from .world import COLOURS, SHAPES, Dialogue, Question, Visual

MERGE, TEMPORAL = 2, 2


@dataclass
class Layout:
    ids: torch.Tensor              # long [T]
    positions: torch.Tensor        # long [3, T]
    visual_rows: torch.Tensor      # long [N]: rows of every visual token, in prompt order (visual, frame, row, column)
    answers: list[tuple[int, int]]  # per turn, [start, end) rows of the answer tokens (incl. <|im_end|>)
    needed: torch.Tensor           # long: indices into visual_rows of every cell some answer needs
    pointers: torch.Tensor         # long [P, 2]: (row, index into visual_rows) where the row names that cell
    visual_spans: list[tuple[int, int]]  # per visual, its [start, end) in visual_rows
    arrivals: list[int]            # per visual, the turn whose message carries it
    ordinals: torch.Tensor         # long [N]: the image's number (multi) or the frame's (video) of each visual token

    @property
    def label_mask(self) -> torch.Tensor:
        """bool [T]: rows whose next token is an answer token (the rows the loss is taken at)."""
        mask = torch.zeros(len(self.ids), dtype=torch.bool)
        for start, end in self.answers:
            mask[start - 1:end - 1] = True
        return mask


class GridOnly:
    """What `ChatFormatter.build_prompt` needs of a vision encoder to lay out a turn, without a tower: each
    `Visual`'s grid (embeddings are empty) and the video timestamps of the engine's own encoder."""

    merge, temporal_patch_size, video = MERGE, TEMPORAL, VideoSettings()
    video_timestamps = VisionEncoder.video_timestamps

    def encode_images(self, images: list[Visual], signals: bool = False) -> list[VisualInput]:
        return [VisualInput("image", torch.empty(v.cells, 0), grid_thw(v)) for v in images]

    def encode_video(self, frames: list[Visual], signals: bool = False) -> VisualInput:
        (v,) = set(frames)
        return VisualInput("video", torch.empty(len(v.frames) * v.cells, 0), grid_thw(v))


def grid_thw(v: Visual) -> tuple[int, int, int]:
    """The processor's grid: a video's world frames are one temporal patch each (`HOLD` video frames)."""
    return len(v.frames), MERGE * v.scene.rows, MERGE * v.scene.cols


def placeholder_message(dialogue: Dialogue, turn: int) -> Message:
    """`dialogue.message(turn)` with `Visual`s in place of the media: a video of `HOLD`·frames entries."""
    new = dialogue.arriving(turn)
    return Message(dialogue.questions[turn].text, images=[v for v in new if v.kind == "image"],
                   videos=[[v] * TEMPORAL * len(v.frames) for v in new if v.kind == "video"])


def formatter() -> ChatFormatter:
    return ChatFormatter(tk.build_tokenizer(), tk.CHAT_TEMPLATE)


def layout(fmt: ChatFormatter, dialogue: Dialogue) -> Layout:
    """The token layout of `dialogue` with its reference answers."""
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    pointers: list[tuple[int, int]] = []
    visuals: list[VisualInput] = []
    vision = GridOnly()
    for t, q in enumerate(dialogue.questions):
        prompt = fmt.build_prompt(placeholder_message(dialogue, t), first_turn=t == 0, vision=vision,
                                  image_token_id=tk.IMAGE_PAD, video_token_id=tk.VIDEO_PAD,
                                  vision_start_id=tk.VISION_START, vision_end_id=tk.VISION_END)
        ids += prompt.token_ids
        visuals += prompt.visuals
        answer = fmt.encode(q.answer) + [tk.IM_END]
        spans.append((len(ids), len(ids) + len(answer)))
        if q.cells:
            evidence = dialogue.evidence(q)
            pointers += [(row, evidence[k]) for row, k in _attribute_rows(fmt, q, answer, len(ids))]
        ids += answer
    pos = compute_positions(ids, visuals, image_token_id=tk.IMAGE_PAD, video_token_id=tk.VIDEO_PAD, merge=MERGE)
    visual_rows = torch.cat([s.token_indices for s in pos.spans])
    sizes = [len(v.frames) * v.cells for v in dialogue.visuals]
    starts = torch.tensor([0, *sizes]).cumsum(0).tolist()
    ordinals = torch.cat([torch.full((n,), i) if v.kind == "image"
                          else torch.arange(len(v.frames)).repeat_interleave(v.cells)
                          for i, (v, n) in enumerate(zip(dialogue.visuals, sizes, strict=True))])
    needed = sorted({i for q in dialogue.questions if q.cells for i in dialogue.evidence(q)})
    return Layout(torch.tensor(ids), pos.positions, visual_rows, spans, torch.tensor(needed, dtype=torch.long),
                  torch.tensor(pointers, dtype=torch.long).view(-1, 2), list(itertools.pairwise(starts)),
                  [v.turn for v in dialogue.visuals], ordinals)


def _attribute_rows(fmt: ChatFormatter, q: Question, answer: list[int], start: int) -> list[tuple[int, int]]:
    """(row, k) for each answer token that names the colour or shape of `q.cells[k]`: the k-th colour and
    the k-th shape word of an answer name `q.cells[k]`; the row predicting a token is the one before it."""
    if q.kind not in ("colour", "shape", "relation", "list", "change"):
        return []
    out, seen = [], {"colour": 0, "shape": 0}
    for i, token in enumerate(fmt.tokenizer.convert_ids_to_tokens(answer)):
        word = token.removeprefix(tk.SPACE)
        kind = "colour" if word in COLOURS else "shape" if word in SHAPES else None
        if kind is not None:
            out.append((start + i - 1, seen[kind]))
            seen[kind] += 1
    return out
