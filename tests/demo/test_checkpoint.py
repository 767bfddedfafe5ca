"""The shipped checkpoint loads in transformers and in the engine, and both give the same logits."""

from __future__ import annotations

import json
import random

import torch

from raincheck_core import Message, SamplingParams
from raincheck_core.models.demo import tokenizer as tk
from raincheck_core.models.demo.world import make_dialogue

from .helpers import FOLDER, engine, needs_checkpoint

pytestmark = needs_checkpoint


def _mm_types(ids: torch.Tensor) -> torch.Tensor:
    return ((ids == tk.IMAGE_PAD).int() + 2 * (ids == tk.VIDEO_PAD).int())


def test_logits_match_transformers_on_a_rendered_scene():
    from PIL import Image
    from transformers import AutoImageProcessor, Qwen3_5ForConditionalGeneration

    hf = Qwen3_5ForConditionalGeneration.from_pretrained(FOLDER, dtype=torch.float32).eval()
    eng = engine()
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
    processor = AutoImageProcessor.from_pretrained(FOLDER)
    pixels = processor(images=[dialogue.scene.image()], return_tensors="pt")
    assert pixels["image_grid_thw"].tolist() == [[1, 24, 24]]            # 12×12 cells = 144 visual tokens
    ids = torch.tensor(prompt.token_ids)[None]
    assert int((ids == tk.IMAGE_PAD).sum()) == 144
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                 mm_token_type_ids=_mm_types(ids)).logits[0].float()
    assert float((first.logits - ref[-1]).abs().max()) <= 1e-4
    ours = eng.forward_logits(ids[0], visual=prompt.visuals)
    assert float((ours - ref).abs().max()) <= 1e-4
    # the same PNG bytes through PIL give the same pixels as the engine's vision encoder
    engine_pixels, _ = eng.vision.preprocess_images([png])
    assert torch.equal(engine_pixels, processor(images=[Image.open(__import__("io").BytesIO(png))],
                                                return_tensors="pt")["pixel_values"])


def test_folder_is_a_complete_hugging_face_checkpoint():
    from transformers import AutoTokenizer

    names = {p.name for p in FOLDER.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "preprocessor_config.json", "generation_config.json", "README.md"} <= names
    assert sum(p.stat().st_size for p in FOLDER.iterdir()) <= 30 * 2**20
    config = json.loads((FOLDER / "config.json").read_text())
    assert config["model_type"] == "qwen3_5"
    assert (config["image_token_id"], config["vision_start_token_id"]) == (tk.IMAGE_PAD, tk.VISION_START)
    tok = AutoTokenizer.from_pretrained(FOLDER)
    text = tok.apply_chat_template([{"role": "user", "content": "what colour is the object in row 1 column 2 ?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|image_pad|>") == tk.IMAGE_PAD
