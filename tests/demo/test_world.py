"""The demo world and its token layout: deterministic, and laid out exactly as the engine lays out a turn."""

from __future__ import annotations

import random

import torch

from raincheck_core import Message
from raincheck_core.models.demo import batch as B
from raincheck_core.models.demo import data
from raincheck_core.models.demo import tokenizer as tk
from raincheck_core.models.demo.config import image_processor
from raincheck_core.models.demo.world import CELL, KINDS, TRAINED_KINDS, make_dialogue


def test_dialogues_are_seeded_and_cover_every_kind():
    a = [make_dialogue(random.Random(3)) for _ in range(2)]
    assert a[0] == a[1]
    rng = random.Random(0)
    dialogues = [make_dialogue(rng) for _ in range(200)]
    assert {q.kind for d in dialogues for q in d.questions} == set(TRAINED_KINDS)
    counting = make_dialogue(rng, kinds=KINDS, first={"count": 1.0}, later={"count": 1.0})
    assert {q.kind for q in counting.questions} == {"count"}
    assert all(3 <= len(d.questions) <= 4 for d in dialogues)
    d = dialogues[0]
    assert d.scene.image().size == (12 * CELL, 12 * CELL)
    lists = [q for d in dialogues for q in d.questions if q.kind == "list"]
    assert all(len(q.answer.split()) == 36 for q in lists)
    assert all(q.answer.split()[:4] == ["one", *q.answer.split()[1:3], "two"] for q in lists)


def test_later_turns_ask_about_other_cells():
    rng = random.Random(1)
    for _ in range(50):
        d = make_dialogue(rng, kinds=("colour", "shape", "relation"))
        first = set(d.questions[0].cells)
        for q in d.questions[1:]:
            assert not first & set(q.cells)


def test_every_word_is_in_the_vocabulary():
    rng = random.Random(2)
    fmt = data.formatter()
    words = set(tk.VOCAB) - set(tk.SPECIALS)
    for _ in range(50):
        d = make_dialogue(rng)
        for q in d.questions:
            for text in (q.text, q.answer):
                tokens = fmt.tokenizer.convert_ids_to_tokens(fmt.encode(text))
                assert len(tokens) == len(text.split()) and set(tokens) <= words   # one token per word
            assert fmt.decode(fmt.encode(q.answer)) == q.answer


def test_layout_is_the_engine_turn_layout():
    """Turn 1 equals the formatter's prompt (placeholders expanded); later turns follow the kept <|im_end|>."""
    fmt = data.formatter()
    d = make_dialogue(random.Random(4), turns=3)
    lay = data.layout(fmt, d)
    text = fmt.render_turn(Message(d.questions[0].text, images=[b""]), first_turn=True)
    first = fmt.encode(text.replace("<|image_pad|>", "<|image_pad|>" * 144))
    assert lay.ids[:len(first)].tolist() == first
    assert (lay.ids == tk.IMAGE_PAD).sum() == 144 and len(lay.visual_rows) == 144
    start, end = lay.answers[0]
    assert start == len(first) and lay.ids[end - 1] == tk.IM_END
    second = fmt.encode(fmt.render_turn(Message(d.questions[1].text), first_turn=False))
    assert lay.ids[end:end + len(second)].tolist() == second
    # 3-D positions: the image spans max(12, 12) positions, text continues after it
    p0 = int(lay.positions[0, lay.visual_rows[0]])
    assert lay.positions[:, lay.visual_rows[13]].tolist() == [p0, p0 + 1, p0 + 1]
    assert int(lay.positions[0, lay.visual_rows[-1] + 1]) == p0 + 12


def test_training_pixels_equal_the_image_processor():
    scene = make_dialogue(random.Random(5)).scene
    out = image_processor()(images=[scene.image()], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [B.grid_thw(scene)]
    assert torch.equal(B.pixels(scene), out["pixel_values"])


def test_curriculum_and_dropout_keep_needed_cells_and_positions():
    fmt = data.formatter()
    rng = random.Random(6)
    lay = data.layout(fmt, make_dialogue(rng))
    needed = set(lay.visual_rows[lay.needed].tolist())
    early = B.choose_rows(lay, 0.0, B.Views(), rng)
    assert needed <= set(early.tolist())
    assert len(early) < len(lay.ids)
    late = B.choose_rows(lay, 0.99, B.Views(dropout=0.0, deferred_order=1.0), rng)
    assert sorted(late.tolist()) == list(range(len(lay.ids)))   # all rows, deferred ones moved
    cut = lay.answers[0][0]
    first_input = late[:cut]
    assert (first_input < cut).all() and first_input.tolist() != sorted(first_input.tolist())
