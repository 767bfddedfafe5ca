"""The demo world: grids of coloured shapes, rendered with Pillow, and multi-turn dialogues about them.

One grid cell is 32×32 px: exactly one LLM visual token after the vision tower's 16-px patches and 2×2
merge, so a 12×12 grid (384×384 px) becomes 144 visual tokens and a 16×16 grid (512×512) 256. Every cell
holds one object. Questions name cells by row and column (1-based, row 1 at the top), so each answer
needs known cells (`Question.cells`): the evidence a pruned prefill may have dropped. Later turns ask
about cells away from the ones earlier turns used, so a first-turn selection is no guide to them.

Three families of dialogues (`FAMILIES`, `make`):
- single: one image with the first question (`make_dialogue`, the v1 benchmark's dialogues);
- multi: 1–3 images arriving at any turn, the first possibly after a text-only turn; questions name the
  image ("in image two , what colour is ...") and text-only turns ask about images sent before;
- video: a clip of 2–4 frames in which a few cells change from frame to frame; questions name the frame
  ("in frame three , ...") or ask what changed in a cell between two frames. Each frame is sent as
  `HOLD` = 2 identical video frames: the processor's temporal patch of 2 pairs consecutive frames into
  one grid step, so one world frame is exactly one grid step (and its own `<t seconds>` block).
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, field

from PIL import Image, ImageDraw

from raincheck_core.inputs import Message

CELL = 32
COLOURS = {"red": (220, 40, 40), "green": (40, 165, 60), "blue": (40, 80, 225), "yellow": (235, 200, 30),
           "purple": (150, 60, 190), "orange": (245, 135, 25)}
SHAPES = ("square", "circle", "triangle", "diamond", "cross", "ring")
DIRECTIONS = {"left": (0, -1), "right": (0, 1), "above": (-1, 0), "below": (1, 0)}
KINDS = ("colour", "shape", "relation", "count", "list", "change", "text")
TRAINED_KINDS = ("colour", "shape", "relation", "list")    # counting did not learn in the training budget
FAMILIES = ("single", "multi", "video")
HOLD = 2            # video frames per world frame: the processor's temporal patch size
BACKGROUND = (245, 245, 240)
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
           "thirteen", "fourteen", "fifteen", "sixteen")   # words: Qwen's pre-tokenizer splits digits
QUESTION_WORDS = ("what", "colour", "shape", "is", "the", "object", "in", "row", "column", "of", "how", "many",
                  "objects", "are", "list", "?", ".", *DIRECTIONS, "image", "frame", ",", "changed", "between",
                  "and", "became", "number", "comes", "after")
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
    visual: int = 0                    # which of the dialogue's visuals (in arrival order) they are in
    frames: tuple[int, ...] = ()       # a video's frame of each cell (empty: frame 0 / an image)


@dataclass(frozen=True)
class Visual:
    """An image (one scene) or a video (its frames, in order), sent with the user message of `turn`."""

    kind: str                          # "image" or "video"
    frames: tuple[Scene, ...]
    turn: int

    @property
    def scene(self) -> Scene:
        return self.frames[0]

    @property
    def cells(self) -> int:
        """Visual tokens per frame (one per cell)."""
        return self.scene.rows * self.scene.cols

    def token(self, cell: Cell, frame: int = 0) -> int:
        """Index of a cell's visual token among this visual's tokens (frame-major, then row-major)."""
        return frame * self.cells + cell[0] * self.scene.cols + cell[1]

    def media(self) -> bytes | list[bytes]:
        """What a client sends: PNG bytes of an image, or a video's frames, each `HOLD` times."""
        if self.kind == "image":
            return self.scene.png()
        return [png for scene in self.frames for png in [scene.png()] * HOLD]


@dataclass
class Dialogue:
    visuals: list[Visual]
    questions: list[Question] = field(default_factory=list)
    family: str = "single"

    @property
    def scene(self) -> Scene:
        """The first visual's (first) scene: the only one in the single-image family."""
        return self.visuals[0].scene

    def arriving(self, turn: int) -> list[Visual]:
        return [v for v in self.visuals if v.turn == turn]

    def message(self, turn: int) -> Message:
        """The user message of `turn` as a client sends it: the question and the visuals arriving with it."""
        new = self.arriving(turn)
        return Message(self.questions[turn].text, images=[v.media() for v in new if v.kind == "image"],
                       videos=[v.media() for v in new if v.kind == "video"])

    def evidence(self, question: Question) -> list[int]:
        """Indices, among all the dialogue's visual tokens in prompt order, of the cells `question` needs."""
        offset = sum(len(v.frames) * v.cells for v in self.visuals[:question.visual])
        visual = self.visuals[question.visual]
        frames = question.frames or (0,) * len(question.cells)
        return [offset + visual.token(cell, f) for cell, f in zip(question.cells, frames, strict=True)]


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
    dialogue = Dialogue([Visual("image", (scene,), 0)])
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


def _pick(rng: random.Random, weights: dict[str, float], kinds: tuple[str, ...]) -> str:
    allowed = {k: w for k, w in weights.items() if k in kinds}
    return rng.choices(list(allowed), list(allowed.values()))[0]


def _far_cell(rng: random.Random, scene: Scene, used: list[Cell], line: str | None, min_gap: int,
              among: list[Cell] | None = None) -> Cell:
    """A cell away from `used`, from `among` if one of those is; any cell when none is far enough."""
    cells = [(r, c) for r in range(scene.rows) for c in range(scene.cols)]
    far = [cell for cell in cells if _far(cell, used, line, min_gap)]
    preferred = [cell for cell in far if cell in (among or cells)]
    return rng.choice(preferred or far or cells)


def text_question(rng: random.Random) -> Question:
    """A question that needs no image: what a chat may ask before (or between) its images."""
    n = rng.randrange(1, len(NUMBERS) - 1)
    return Question("text", f"what number comes after {NUMBERS[n]} ?", NUMBERS[n + 1], ())


def _arrivals(rng: random.Random, n_turns: int, n_visuals: int, text_first: float) -> list[int]:
    """Turns the visuals arrive with: the first at turn 0, or at turn 1 after a text-only turn."""
    first = 1 if rng.random() < text_first and n_turns > 1 else 0
    return [first, *sorted(rng.sample(range(first + 1, n_turns), min(n_visuals, n_turns - first) - 1))]


def make_multi_dialogue(rng: random.Random, sizes: tuple[int, int] = (10, 12), turns: int | None = None,
                        images: int | None = None, kinds: tuple[str, ...] = TRAINED_KINDS, min_gap: int = 3,
                        text_first: float = 0.25, new_image_question: float = 0.7,
                        first: dict[str, float] | None = None, later: dict[str, float] | None = None) -> Dialogue:
    """1–3 images (rows and columns in `sizes`) arriving at any turn; every question names its image.

    A turn that brings an image asks about it with probability `new_image_question`, else about an image
    sent before; a turn before any image is a text question. Questions about one image target cells at
    least `min_gap` rows/columns from the cells asked about that image before."""
    n_turns = turns or rng.choice((4, 5))
    n_images = images or rng.choice((1, 2, 3))
    arrivals = _arrivals(rng, n_turns, n_images, text_first)
    visuals = [Visual("image", (random_scene(rng, rng.randint(*sizes), rng.randint(*sizes)),), t) for t in arrivals]
    dialogue = Dialogue(visuals, family="multi")
    used: dict[int, list[Cell]] = {i: [] for i in range(len(visuals))}
    for t in range(n_turns):
        sent = [i for i, v in enumerate(visuals) if v.turn <= t]
        if not sent:
            dialogue.questions.append(text_question(rng))
            continue
        new = [i for i in sent if visuals[i].turn == t]
        i = new[0] if new and rng.random() < new_image_question else rng.choice(sent)
        scene = visuals[i].scene
        kind = _pick(rng, (first or FIRST_TURN) if not used[i] else (later or LATER_TURNS), kinds)
        line = rng.choice(("row", "column")) if kind in ("count", "list") else None
        q = ask(scene, kind, rng, _far_cell(rng, scene, used[i], line, min_gap), line or "row")
        dialogue.questions.append(Question(q.kind, f"in image {NUMBERS[i + 1]} , {q.text}", q.answer, q.cells, i))
        used[i].extend(q.cells)
    return dialogue


VIDEO_KINDS = ("colour", "shape", "relation", "list", "change")
VIDEO_FIRST = {"colour": 0.15, "shape": 0.15, "relation": 0.15, "list": 0.3, "change": 0.25}
VIDEO_LATER = {"colour": 0.2, "shape": 0.2, "relation": 0.2, "list": 0.1, "change": 0.3}


def random_clip(rng: random.Random, rows: int, cols: int, frames: int, changes: tuple[int, int] = (2, 4)
                ) -> tuple[Scene, ...]:
    """A scene, then frames in which a few cells (`changes`) each get a different object."""
    clip = [random_scene(rng, rows, cols)]
    for _ in range(frames - 1):
        objects = [list(line) for line in clip[-1].objects]
        for r, c in rng.sample([(r, c) for r in range(rows) for c in range(cols)], rng.randint(*changes)):
            old = objects[r][c]
            while objects[r][c] == old:
                objects[r][c] = (rng.choice(list(COLOURS)), rng.choice(SHAPES))
        clip.append(Scene(rows, cols, tuple(tuple(line) for line in objects)))
    return tuple(clip)


def make_video_dialogue(rng: random.Random, sizes: tuple[int, int] = (8, 8), turns: int | None = None,
                        frames: int | None = None, kinds: tuple[str, ...] = VIDEO_KINDS, min_gap: int = 2,
                        text_first: float = 0.25, changed_cell: float = 0.5) -> Dialogue:
    """A clip of 2–4 frames (a video of 4–8 frames) and questions about one frame or a change.

    Frame questions ask about a cell that changes at some point in the clip with probability
    `changed_cell` (so the frame matters); change questions ("what changed in row r column c between frame
    i and frame j ?") about a cell whose object differs between the two frames: "red circle became blue
    square"."""
    n_turns = turns or rng.choice((3, 4))
    n_frames = frames or rng.choice((2, 3, 4))
    clip = random_clip(rng, rng.randint(*sizes), rng.randint(*sizes), n_frames)
    first = _arrivals(rng, n_turns, 1, text_first)[0]
    dialogue = Dialogue([Visual("video", clip, first)], family="video")
    scene = clip[0]
    cells = [(r, c) for r in range(scene.rows) for c in range(scene.cols)]
    changing = [cell for cell in cells if len({f.objects[cell[0]][cell[1]] for f in clip}) > 1]
    used: list[Cell] = []
    for t in range(n_turns):
        if t < first:
            dialogue.questions.append(text_question(rng))
            continue
        kind = _pick(rng, VIDEO_FIRST if t == first else VIDEO_LATER, kinds)
        if kind == "change":
            cell = rng.choice([c for c in changing if _far(c, used, None, min_gap)] or changing)
            r, c = cell
            pairs = [(i, j) for i in range(n_frames) for j in range(i + 1, n_frames)
                     if clip[i].objects[r][c] != clip[j].objects[r][c]]
            i, j = rng.choice(pairs)
            q = Question(kind, f"what changed {_at(r, c)} between frame {NUMBERS[i + 1]} and frame {NUMBERS[j + 1]} ?",
                         f"{clip[i].name(r, c)} became {clip[j].name(r, c)}", (cell, cell), 0, (i, j))
        else:
            f = rng.randrange(n_frames)
            line = rng.choice(("row", "column")) if kind == "list" else None
            among = changing if line is None and rng.random() < changed_cell else None
            base = ask(clip[f], kind, rng, _far_cell(rng, scene, used, line, min_gap, among), line or "row")
            q = Question(kind, f"in frame {NUMBERS[f + 1]} , {base.text}", base.answer, base.cells, 0,
                         (f,) * len(base.cells))
        dialogue.questions.append(q)
        used.extend(q.cells)
    return dialogue


def make(family: str, rng: random.Random) -> Dialogue:
    """A held-out-style dialogue of `family` (the benchmark's settings)."""
    if family == "single":
        return make_dialogue(rng)
    if family == "multi":
        return make_multi_dialogue(rng)
    if family == "video":
        return make_video_dialogue(rng)
    raise ValueError(f"unknown dialogue family {family!r}; expected one of {FAMILIES}")


def vocabulary() -> list[str]:
    """Every word questions and answers use, in a fixed order."""
    return [*QUESTION_WORDS, *COLOURS, *SHAPES, *NUMBERS]


def answer_starts() -> list[str]:
    """Words that can open an answer (no space before them)."""
    return [*COLOURS, *SHAPES, *NUMBERS]
