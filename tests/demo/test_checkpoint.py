"""The shipped checkpoints load in transformers and in the engine, and both give the same logits.

v1 (`models/demo`) was trained with the vocabulary before issue 17, v2 (`models/demo-v2`) with today's
(`raincheck_demo.tokenizer`): token ids are read from each folder's own config."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from raincheck_core import Message, SamplingParams
from raincheck_demo import tokenizer as tk
from raincheck_demo.world import make_dialogue, make_video_dialogue

from .helpers import FOLDER, V2, engine, needs_checkpoint, needs_v2

BOTH = pytest.mark.parametrize("folder", [pytest.param(FOLDER, id="v1", marks=needs_checkpoint),
                                          pytest.param(V2, id="v2", marks=needs_v2)])


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _mm_types(ids: torch.Tensor, folder: Path) -> torch.Tensor:
    config = _config(folder)
    return (ids == config["image_token_id"]).int() + 2 * (ids == config["video_token_id"]).int()


@BOTH
def test_logits_match_transformers_on_a_rendered_scene(folder):
    from PIL import Image
    from transformers import AutoImageProcessor, Qwen3_5ForConditionalGeneration

    hf = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    eng = engine(folder)
    dialogue = make_dialogue(random.Random(11))
    png = dialogue.scene.png()
    message = Message(dialogue.questions[0].text, images=[png])
    session = eng.open_session()
    first = next(iter(session.turn(message, SamplingParams(max_new_tokens=1), return_logits=True)))
    session.close()

    mc = eng.model_config
    prompt = eng.formatter.build_prompt(message, first_turn=True, vision=eng.vision, image_token_id=mc.image_token_id,
                                        video_token_id=mc.video_token_id, vision_start_id=mc.vision_start_token_id,
                                        vision_end_id=mc.vision_end_token_id)
    processor = AutoImageProcessor.from_pretrained(folder)
    pixels = processor(images=[dialogue.scene.image()], return_tensors="pt")
    assert pixels["image_grid_thw"].tolist() == [[1, 24, 24]]            # 12×12 cells = 144 visual tokens
    ids = torch.tensor(prompt.token_ids)[None]
    assert int((ids == mc.image_token_id).sum()) == 144
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                 mm_token_type_ids=_mm_types(ids, folder)).logits[0].float()
    assert float((first.logits - ref[-1]).abs().max()) <= 1e-4
    ours = eng.forward_logits(ids[0], visual=prompt.visuals)
    assert float((ours - ref).abs().max()) <= 1e-4
    # the same PNG bytes through PIL give the same pixels as the engine's vision encoder
    engine_pixels, _ = eng.vision.preprocess_images([png])
    assert torch.equal(engine_pixels, processor(images=[Image.open(__import__("io").BytesIO(png))],
                                                return_tensors="pt")["pixel_values"])


@BOTH
def test_folder_is_a_complete_hugging_face_checkpoint(folder):
    from transformers import AutoTokenizer

    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "preprocessor_config.json", "generation_config.json", "README.md"} <= names
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 30 * 2**20
    config = _config(folder)
    assert config["model_type"] == "qwen3_5"
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "what colour is the object in row 1 column 2 ?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|image_pad|>") == config["image_token_id"]
    assert tok.convert_tokens_to_ids("<|vision_start|>") == config["vision_start_token_id"]


@needs_v2
def test_v2_is_what_training_builds_today():
    """v2's vocabulary and vision tower are the training code's: the ids the world's layout uses, and
    at least two vision blocks (so HiPrune's middle and last layers differ)."""
    config = _config(V2)
    assert (config["image_token_id"], config["video_token_id"], config["vision_start_token_id"]) == \
        (tk.IMAGE_PAD, tk.VIDEO_PAD, tk.VISION_START)
    assert config["vision_config"]["depth"] >= 2


@needs_v2
def test_v2_ships_calibrated_hiprune_layers():
    """v2's selector options load, and with them HiPrune keeps rows of its own, not VisionZip's (issue 17:
    with the paper's default layers the two kept 98.5-99% of the same rows)."""
    from bench.quality_overlap import jaccard, kept_rows
    from raincheck_core.pruning.settings import load_selector_options

    options = load_selector_options(V2)
    layers = options["hiprune"]
    assert {layers["object_layer"], layers["deep_layer"]} == {"middle", "last"}
    message = make_dialogue(random.Random(3), 12, 12).message(0)
    kept = kept_rows(engine(V2), message, True, ("hiprune", "visionzip"), 0.3, options)
    assert jaccard(kept["hiprune"][0], kept["visionzip"][0]) <= 0.8


@needs_v2
def test_logits_match_transformers_on_a_video():
    """A video message (each world frame sent twice) through the engine's processor and tower, against
    transformers' own VLM given the same pixels: the temporal patches, timestamps and 3-D positions agree."""
    from transformers import Qwen3_5ForConditionalGeneration

    hf = Qwen3_5ForConditionalGeneration.from_pretrained(V2, dtype=torch.float32).eval()
    eng = engine(V2)
    dialogue = make_video_dialogue(random.Random(12), frames=3, text_first=0.0)
    message = dialogue.message(0)
    mc = eng.model_config
    prompt = eng.formatter.build_prompt(message, first_turn=True, vision=eng.vision, image_token_id=mc.image_token_id,
                                        video_token_id=mc.video_token_id, vision_start_id=mc.vision_start_token_id,
                                        vision_end_id=mc.vision_end_token_id)
    pixels, grid = eng.vision.preprocess_video(message.videos[0])
    assert grid.tolist() == [[3, 16, 16]]                                  # 3 frames of 8×8 cells
    ids = torch.tensor(prompt.token_ids)[None]
    assert int((ids == tk.VIDEO_PAD).sum()) == 3 * 64
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values_videos=pixels, video_grid_thw=grid,
                 mm_token_type_ids=_mm_types(ids, V2)).logits[0].float()
    ours = eng.forward_logits(ids[0], visual=prompt.visuals)
    assert float((ours - ref).abs().max()) <= 1e-4
