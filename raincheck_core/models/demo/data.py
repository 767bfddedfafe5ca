"""Dialogues as the engine lays them out: one token sequence with 3-D positions and answer labels.

Turns are rendered with the engine's own `ChatFormatter` (the checkpoint's chat template), the image
placeholder is expanded to one `<|image_pad|>` per grid cell, and every answer is followed by `<|im_end|>`,
which the engine keeps and prefills at the start of the next turn. So the sequence equals what a
`full` session holds after the last answer, and its positions are the engine's (`compute_positions`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...inputs import Message, VisualInput
from ...multimodal.chat import ChatFormatter
from ...multimodal.positions import compute_positions
from . import tokenizer as tk
from .world import COLOURS, SHAPES, Dialogue, Question


@dataclass
class Layout:
    ids: torch.Tensor              # long [T]
    positions: torch.Tensor        # long [3, T]
    visual_rows: torch.Tensor      # long [N]: rows of the image tokens, row-major over the grid
    answers: list[tuple[int, int]]  # per turn, [start, end) rows of the answer tokens (incl. <|im_end|>)
    needed: torch.Tensor           # long: indices into visual_rows of every cell some answer needs
    pointers: torch.Tensor         # long [P, 2]: (row, cell) where the row predicts that cell's colour or shape

    @property
    def label_mask(self) -> torch.Tensor:
        """bool [T]: rows whose next token is an answer token (the rows the loss is taken at)."""
        mask = torch.zeros(len(self.ids), dtype=torch.bool)
        for start, end in self.answers:
            mask[start - 1:end - 1] = True
        return mask


def formatter() -> ChatFormatter:
    return ChatFormatter(tk.build_tokenizer(), tk.CHAT_TEMPLATE)


def layout(fmt: ChatFormatter, dialogue: Dialogue) -> Layout:
    """The token layout of `dialogue` with its reference answers."""
    scene = dialogue.scene
    n = scene.rows * scene.cols
    pad = tk.VOCAB["<|image_pad|>"]
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    pointers: list[tuple[int, int]] = []
    for t, q in enumerate(dialogue.questions):
        message = Message(q.text, images=[b""] if t == 0 else [])
        text = fmt.render_turn(message, first_turn=t == 0)
        ids += fmt.encode(text.replace("<|image_pad|>", "<|image_pad|>" * n))
        answer = fmt.encode(q.answer) + [tk.IM_END]
        spans.append((len(ids), len(ids) + len(answer)))
        pointers += [(row, r * scene.cols + c) for row, (r, c) in _attribute_rows(fmt, q, answer, len(ids))]
        ids += answer
    grid = VisualInput("image", torch.empty(n, 0), (1, 2 * scene.rows, 2 * scene.cols))
    pos = compute_positions(ids, [grid], image_token_id=pad, video_token_id=tk.VIDEO_PAD, merge=2)
    needed = sorted({r * scene.cols + c for q in dialogue.questions for r, c in q.cells})
    return Layout(torch.tensor(ids), pos.positions, pos.spans[0].token_indices, spans,
                  torch.tensor(needed, dtype=torch.long), torch.tensor(pointers, dtype=torch.long).view(-1, 2))


def _attribute_rows(fmt: ChatFormatter, q: Question, answer: list[int], start: int) -> list[tuple[int, int]]:
    """(row, cell) for each answer token that names one cell's colour or shape: the k-th colour and the k-th
    shape word of an answer name `q.cells[k]`; the row predicting a token is the one before it."""
    if q.kind not in ("colour", "shape", "relation", "list"):
        return []
    out, seen = [], {"colour": 0, "shape": 0}
    for i, token in enumerate(fmt.tokenizer.convert_ids_to_tokens(answer)):
        word = token.removeprefix(tk.SPACE)
        kind = "colour" if word in COLOURS else "shape" if word in SHAPES else None
        if kind is not None:
            r, c = q.cells[seen[kind]]
            out.append((start + i - 1, (r, c)))
            seen[kind] += 1
    return out
