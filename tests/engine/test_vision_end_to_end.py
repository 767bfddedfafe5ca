"""A real PNG through the checkpoint's vision tower and processor, then the decoder: same logits as
transformers' own VLM forward on the same inputs."""

from __future__ import annotations

import shutil

import pytest
import torch

from raincheck_core import Engine, Message, SamplingParams
from tests.engine.reference import mm_token_types
from tests.multimodal.mm_helpers import QWEN_TEMPLATE, png, save_tokenizer


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe"])
def test_png_through_vision_tower_matches_transformers(tiny_checkpoints, tmp_path, family):
    hf, folder = tiny_checkpoints[family]
    folder = shutil.copytree(folder, tmp_path / "ckpt")
    save_tokenizer(folder, QWEN_TEMPLATE)
    engine = Engine.from_pretrained(folder)
    image = png(96, 64)
    message = Message("what is this ?", images=[image])
    session = engine.open_session()
    first = next(iter(session.turn(message, SamplingParams(max_new_tokens=1), return_logits=True)))
    session.close()

    cfg = engine.model_config
    prompt = engine.formatter.build_prompt(
        message, first_turn=True, vision=engine.vision, image_token_id=cfg.image_token_id,
        video_token_id=cfg.video_token_id, vision_start_id=cfg.vision_start_token_id,
        vision_end_id=cfg.vision_end_token_id)
    pixel_values, grid = engine.vision.preprocess_images([image])
    ids = torch.tensor(prompt.token_ids)[None]
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid,
                 mm_token_type_ids=mm_token_types(ids[0])[None]).logits[0, -1].float()
    assert int((ids == cfg.image_token_id).sum()) == grid.prod() // 4
    assert float((first.logits - ref).abs().max()) <= 1e-4
