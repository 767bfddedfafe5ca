"""The demo world: grids of coloured shapes, rendered with Pillow, and multi-turn dialogues about them.

One grid cell is 32×32 px: exactly one LLM visual token after the vision tower's 16-px patches and 2×2
merge, so a 12×12 grid (384×384 px) becomes 144 visual tokens and a 16×16 grid (512×512) 256. Every cell
holds one object. Questions name cells by row and column (1-based, row 1 at the top), so each answer
needs known cells (`Question.cells`): the evidence a pruned prefill may have dropped. Later turns ask
about cells away from the ones earlier turns used, so a first-turn selection is no guide to them.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, field

from PIL import Image, ImageDraw

CELL = 32
COLOURS = {"red": (220, 40, 40), "green": (40, 165, 60), "blue": (40, 80, 225), "yellow": (235, 200, 30),
           "purple": (150, 60, 190), "orange": (245, 135, 25)}
SHAPES = ("square", "circle", "triangle", "diamond", "cross", "ring")
DIRECTIONS = {"left": (0, -1), "right": (0, 1), "above": (-1, 0), "below": (1, 0)}
KINDS = ("colour", "shape", "relation", "count", "list")
TRAINED_KINDS = ("colour", "shape", "relation", "list")    # counting did not learn in the training budget
BACKGROUND = (245, 245, 240)
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
           "thirteen", "fourteen", "fifteen", "sixteen")   # words: Qwen's pre-tokenizer splits digits
QUESTION_WORDS = ("what", "colour", "shape", "is", "the", "object", "in", "row", "column", "of", "how", "many",
                  "objects", "are", "list", "?", ".", *DIRECTIONS)
Cell = tuple[int, int]   # (row, column), 0-based


@dataclass(frozen=True)
class Scene:
    rows: int
    cols: int
    objects: tuple[tuple[tuple[str, str], ...], ...]   # objects[r][c] = (colour, shape)

    def name(self, r: int, c: int) -> str:
        colour, shape = self.objects[r][c]
        return f"{colour} {shape}"

    def image(self) -> Image.Image:
        img = Image.new("RGB", (self.cols * CELL, self.rows * CELL), BACKGROUND)
        draw = ImageDraw.Draw(img)
        for r in range(self.rows):
            for c in range(self.cols):
                colour, shape = self.objects[r][c]
                _draw_shape(draw, c * CELL, r * CELL, shape, COLOURS[colour])
        return img

    def png(self) -> bytes:
        buf = io.BytesIO()
        self.image().save(buf, format="PNG")
        return buf.getvalue()


@dataclass(frozen=True)
class Question:
    kind: str
    text: str
    answer: str
    cells: tuple[Cell, ...]            # the cells whose objects the answer depends on


@dataclass
class Dialogue:
    scene: Scene
    questions: list[Question] = field(default_factory=list)


def _draw_shape(draw: ImageDraw.ImageDraw, x: int, y: int, shape: str, rgb: tuple[int, int, int]) -> None:
    m = 4
    x0, y0, x1, y1 = x + m, y + m, x + CELL - m - 1, y + CELL - m - 1
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    if shape == "square":
        draw.rectangle([x0 + 1, y0 + 1, x1 - 1, y1 - 1], fill=rgb)
    elif shape == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=rgb)
    elif shape == "ring":
        draw.ellipse([x0, y0, x1, y1], outline=rgb, width=5)
    elif shape == "triangle":
        draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=rgb)
    elif shape == "diamond":
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=rgb)
    elif shape == "cross":
        w = 4
        draw.rectangle([cx - w, y0, cx + w, y1], fill=rgb)
        draw.rectangle([x0, cy - w, x1, cy + w], fill=rgb)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def random_scene(rng: random.Random, rows: int = 12, cols: int = 12) -> Scene:
    objects = tuple(tuple((rng.choice(list(COLOURS)), rng.choice(SHAPES)) for _ in range(cols)) for _ in range(rows))
    return Scene(rows, cols, objects)


# -- questions ------------------------------------------------------------------------------------------------

def _at(r: int, c: int) -> str:
    return f"in row {NUMBERS[r + 1]} column {NUMBERS[c + 1]}"


def ask(scene: Scene, kind: str, rng: random.Random, cell: Cell, line: str = "row") -> Question:
    """A question of `kind` about `cell` (for count/list: the row, or with line="column" the column, through it)."""
    r, c = cell
    colour, shape = scene.objects[r][c]
    if kind == "colour":
        return Question(kind, f"what colour is the object {_at(r, c)} ?", colour, (cell,))
    if kind == "shape":
        return Question(kind, f"what shape is the object {_at(r, c)} ?", shape, (cell,))
    if kind == "relation":
        options = [d for d, (dr, dc) in DIRECTIONS.items() if 0 <= r + dr < scene.rows and 0 <= c + dc < scene.cols]
        d = rng.choice(options)
        dr, dc = DIRECTIONS[d]
        target = (r + dr, c + dc)
        return Question(kind, f"what is {d} of the object {_at(r, c)} ?", scene.name(*target), (target,))
    cells = [(r, j) for j in range(scene.cols)] if line == "row" else [(i, c) for i in range(scene.rows)]
    index = NUMBERS[r + 1 if line == "row" else c + 1]
    if kind == "count":
        n = sum(scene.objects[i][j][0] == colour for i, j in cells)
        return Question(kind, f"how many {colour} objects are in {line} {index} ?", NUMBERS[n], tuple(cells))
    if kind == "list":
        answer = " ".join(f"{NUMBERS[k + 1]} {scene.name(i, j)}" for k, (i, j) in enumerate(cells))
        return Question(kind, f"list the objects in {line} {index} .", answer, tuple(cells))
    raise ValueError(f"unknown question kind {kind!r}")


FIRST_TURN = {"colour": 0.2, "shape": 0.2, "relation": 0.2, "count": 0.1, "list": 0.3}
LATER_TURNS = {"colour": 0.25, "shape": 0.25, "relation": 0.25, "count": 0.1, "list": 0.15}   # renormalised


def _far(cell: Cell, used: list[Cell], line: str | None, min_gap: int) -> bool:
    """Away from every cell used so far; a whole row (column) must be away in rows (columns)."""
    r, c = cell
    if line == "row":
        return all(abs(r - ur) >= min_gap for ur, _ in used)
    if line == "column":
        return all(abs(c - uc) >= min_gap for _, uc in used)
    return all(max(abs(r - ur), abs(c - uc)) >= min_gap for ur, uc in used)


def make_dialogue(rng: random.Random, rows: int = 12, cols: int = 12, turns: int | None = None,
                  kinds: tuple[str, ...] = TRAINED_KINDS, first: dict[str, float] | None = None,
                  later: dict[str, float] | None = None, min_gap: int = 3) -> Dialogue:
    """A scene and 3–4 questions; turn 2+ target cells at least `min_gap` rows/columns from earlier ones."""
    scene = random_scene(rng, rows, cols)
    dialogue = Dialogue(scene)
    used: list[Cell] = []
    n_turns = turns or rng.choice((3, 4))
    for t in range(n_turns):
        weights = {k: w for k, w in (first or FIRST_TURN if t == 0 else later or LATER_TURNS).items() if k in kinds}
        kind = rng.choices(list(weights), list(weights.values()))[0]
        line = rng.choice(("row", "column")) if kind in ("count", "list") else None
        for _ in range(100):
            cell = (rng.randrange(rows), rng.randrange(cols))
            if _far(cell, used, line, min_gap):
                break
        question = ask(scene, kind, rng, cell, line or "row")
        dialogue.questions.append(question)
        used.extend(question.cells)
    return dialogue


def vocabulary() -> list[str]:
    """Every word questions and answers use, in a fixed order."""
    return [*QUESTION_WORDS, *COLOURS, *SHAPES, *NUMBERS]


def answer_starts() -> list[str]:
    """Words that can open an answer (no space before them)."""
    return [*COLOURS, *SHAPES, *NUMBERS]
