"""The demo world and its token layout: deterministic, and laid out exactly as the engine lays out a turn."""

from __future__ import annotations

import itertools
import random

import torch

from raincheck_core import Message
from raincheck_core.multimodal.positions import compute_positions
from raincheck_demo import batch as B
from raincheck_demo import data
from raincheck_demo import tokenizer as tk
from raincheck_demo.config import image_processor
from raincheck_demo.world import (
    CELL,
    HOLD,
    KINDS,
    NUMBERS,
    TRAINED_KINDS,
    make_dialogue,
    make_multi_dialogue,
    make_video_dialogue,
)


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
    d = make_dialogue(random.Random(5))
    out = image_processor()(images=[d.scene.image()], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [list(data.grid_thw(d.visuals[0]))]
    assert torch.equal(B.visual_pixels(d.visuals[0]), out["pixel_values"])


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


def test_multi_image_dialogues_name_images_that_have_arrived():
    rng = random.Random(7)
    dialogues = [make_multi_dialogue(rng) for _ in range(200)]
    assert {len(d.visuals) for d in dialogues} == {1, 2, 3}
    assert any(d.visuals[0].turn == 1 for d in dialogues)        # a text-only turn before the first image
    asked_new = 0
    for d in dialogues:
        assert d.family == "multi" and all(v.kind == "image" for v in d.visuals)
        turns = [v.turn for v in d.visuals]
        assert turns == sorted(set(turns)) and turns[0] in (0, 1)
        for t, q in enumerate(d.questions):
            if not q.cells:
                assert q.kind == "text" and q.answer == NUMBERS[NUMBERS.index(q.text.split()[-2]) + 1]
                continue
            v = d.visuals[q.visual]
            assert v.turn <= t and q.text.startswith(f"in image {NUMBERS[q.visual + 1]} , ")
            asked_new += v.turn == t
            r, c = q.cells[0]
            if q.kind in ("colour", "shape"):
                assert q.answer in v.scene.objects[r][c]
        message = d.message(d.visuals[-1].turn)
        assert message.images == [d.visuals[-1].scene.png()] and not message.videos
    assert asked_new > 200


def test_video_frames_change_and_questions_need_the_frame():
    rng = random.Random(8)
    for _ in range(100):
        d = make_video_dialogue(rng)
        (v,) = d.visuals
        assert v.kind == "video" and 2 <= len(v.frames) <= 4
        changed = [sum(a != b for la, lb in zip(f.objects, g.objects, strict=True) for a, b in zip(la, lb, strict=True))
                   for f, g in itertools.pairwise(v.frames)]
        assert all(2 <= n <= 4 for n in changed)
        media = d.message(v.turn).videos[0]
        assert len(media) == HOLD * len(v.frames) and media[0] == media[1] == v.frames[0].png()
        for q in d.questions[v.turn:]:
            assert len(q.frames) == len(q.cells)
            if q.kind == "change":
                (r, c), (i, j) = q.cells[0], q.frames
                before, after = q.answer.split(" became ")
                assert before == v.frames[i].name(r, c) != after == v.frames[j].name(r, c)
            elif q.kind in ("colour", "shape"):
                (r, c), (f,) = q.cells[0], q.frames
                assert q.text.startswith(f"in frame {NUMBERS[f + 1]} , ") and q.answer in v.frames[f].objects[r][c]


def _vision_encoder():
    from transformers import Qwen3_5ForConditionalGeneration

    from raincheck_core.multimodal.vision import VideoSettings, VisionEncoder
    from raincheck_demo.config import model_config

    torch.manual_seed(0)
    tower = Qwen3_5ForConditionalGeneration(model_config()).model.visual.eval()
    return VisionEncoder(tower, image_processor(), VideoSettings(), merge=2, patch_size=16, temporal_patch_size=2)


def test_multi_image_and_video_layouts_are_the_engine_turn_layouts():
    """Every turn of the training layout equals what the engine builds from the client's message (real PNGs
    through the real processor), and positions continue from turn to turn as a session's do."""
    fmt = data.formatter()
    vision = _vision_encoder()
    rng = random.Random(9)
    for d in [make_multi_dialogue(rng, images=3, turns=5), make_video_dialogue(rng, frames=4)]:
        lay = data.layout(fmt, d)
        start, at = 0, 0
        for t in range(len(d.questions)):
            prompt = fmt.build_prompt(d.message(t), first_turn=t == 0, vision=vision, image_token_id=tk.IMAGE_PAD,
                                      video_token_id=tk.VIDEO_PAD, vision_start_id=tk.VISION_START,
                                      vision_end_id=tk.VISION_END)
            n = len(prompt.token_ids)
            assert lay.ids[at:at + n].tolist() == prompt.token_ids
            assert [v.grid_thw for v in prompt.visuals] == [data.grid_thw(v) for v in d.arriving(t)]
            pos = compute_positions(prompt.token_ids, prompt.visuals, image_token_id=tk.IMAGE_PAD,
                                    video_token_id=tk.VIDEO_PAD, merge=2, start=start)
            assert torch.equal(lay.positions[:, at:at + n], pos.positions)
            at, start = lay.answers[t][1], int(lay.positions[0, lay.answers[t][1] - 1]) + 1
        assert at == len(lay.ids)


def test_training_video_pixels_equal_the_engine_video_processor():
    d = make_video_dialogue(random.Random(10), frames=3)
    (v,) = d.visuals
    pixels, grid = _vision_encoder().preprocess_video(v.media())
    assert grid.tolist() == [list(data.grid_thw(v))]
    assert torch.equal(B.visual_pixels(v), pixels)


def test_evidence_and_pointers_name_the_asked_cells():
    fmt = data.formatter()
    d = make_multi_dialogue(random.Random(11), images=3, turns=5)
    lay = data.layout(fmt, d)
    sizes = [v.cells for v in d.visuals]
    assert [e - s for s, e in lay.visual_spans] == sizes and lay.arrivals == [v.turn for v in d.visuals]
    for q in d.questions:
        if q.cells:
            for i, (r, c) in zip(d.evidence(q), q.cells, strict=True):
                v = sum(i >= s for s, _ in lay.visual_spans) - 1
                assert v == q.visual and int(lay.ordinals[i]) == v
                assert i - lay.visual_spans[v][0] == r * d.visuals[v].scene.cols + c
    assert set(lay.pointers[:, 1].tolist()) <= set(lay.needed.tolist())


def test_raincheck_order_moves_each_visual_before_its_own_turn_answer():
    fmt = data.formatter()
    d = make_multi_dialogue(random.Random(12), images=2, turns=4, text_first=0.0)
    lay = data.layout(fmt, d)
    rows = B.choose_rows(lay, 0.99, B.Views(dropout=0.0, deferred_order=1.0, bands=0.0), random.Random(0))
    assert sorted(rows.tolist()) == list(range(len(lay.ids)))
    place = {int(r): i for i, r in enumerate(rows)}
    for (s, e), turn in zip(lay.visual_spans, lay.arrivals, strict=True):
        first_answer = lay.answers[turn][0]
        moved = [int(r) for r in lay.visual_rows[s:e] if place[int(r)] > place[first_answer - 1]]
        assert len(moved) == (e - s) - round(0.3 * (e - s))               # 70% deferred, after the prompt
        assert all(place[r] < place[first_answer] for r in moved)         # ... and before the answer


def test_list_answers_carry_the_length_of_their_line_in_any_row_order():
    fmt = data.formatter()
    rng = random.Random(5)
    d = make_multi_dialogue(rng, sizes=(5, 9), images=2, turns=5, first={"list": 1.0}, later={"list": 1.0})
    lay = data.layout(fmt, d)
    rows = B.choose_rows(lay, 0.99, B.Views(dropout=0.0, deferred_order=1.0), random.Random(0))
    batch = B.collate([d], [lay], [rows])
    for q, (s, e) in zip(d.questions, lay.answers, strict=True):
        at = torch.nonzero((rows >= s - 1) & (rows < e - 1)).flatten()
        expected = len(q.cells) if q.kind == "list" else -100
        assert (batch.lengths[0, at] == expected).all() and (batch.targets[0, at] >= 0).all()
    assert {q.kind for q in d.questions} >= {"list"}
    assert int((batch.lengths >= 0).sum()) == sum(e - s for q, (s, e) in zip(d.questions, lay.answers,
                                                                         strict=True) if q.kind == "list")
    line = next(q for q in d.questions if q.kind == "list")
    scene = d.visuals[line.visual].scene
    assert len(line.cells) in (scene.rows, scene.cols)


def test_banded_deferred_order_keeps_a_band_and_the_default_stream_is_unchanged():
    fmt = data.formatter()
    d = make_video_dialogue(random.Random(4), frames=3, turns=3)
    lay = data.layout(fmt, d)
    banded = B.choose_rows(lay, 0.99, B.Views(dropout=0.0, deferred_order=1.0, bands=1.0), random.Random(0))
    cut = lay.answers[d.visuals[0].turn][0]
    first = set(banded[:list(banded.tolist()).index(cut - 1)].tolist()) & set(lay.visual_rows.tolist())
    v = d.visuals[0]
    cells = {(i % v.cells) // v.scene.cols for i in range(len(lay.visual_rows)) if int(lay.visual_rows[i]) in first}
    columns = {(i % v.cells) % v.scene.cols for i in range(len(lay.visual_rows)) if int(lay.visual_rows[i]) in first}
    assert min(len(cells), len(columns)) == round(0.3 * 8)           # a band of rows or of columns, every frame
    assert len(first) == 3 * round(0.3 * 8) * 8
    # bands = 0 draws exactly what the recipe drew before the option existed (so older runs replay):
    # the dropout and order draws, then one sample of 30% kept cells per visual
    rng = random.Random(7)
    rows = B.choose_rows(lay, 0.99, B.Views(dropout=0.0, deferred_order=1.0, bands=0.0), rng)
    replay = random.Random(7)
    replay.random(), replay.random()
    s, e = lay.visual_spans[0]
    kept = set(replay.sample(range(s, e), round(0.3 * (e - s))))
    assert rng.getstate() == replay.getstate()
    cut = rows.tolist().index(cut - 1)
    shown = set(rows[:cut].tolist()) & set(lay.visual_rows.tolist())
    assert shown == {int(lay.visual_rows[i]) for i in kept}
