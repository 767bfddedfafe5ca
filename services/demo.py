"""`raincheck demo`: a scripted two-turn image chat, printing each turn's tokens, TTFT and TPOT.

Until the project's demo model ships, the default is a randomly initialised Qwen3.5-architecture
checkpoint: its answers are noise (and it has no tokenizer, so ids are printed), its timings are real.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

from PIL import Image, ImageDraw

from raincheck_core import Engine, Prompt, SamplingParams


def _scene(size: int = 384) -> bytes:
    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    for i, colour in enumerate(["red", "green", "blue", "orange"]):
        x = 40 + 80 * i
        draw.ellipse([x, 60 + 50 * i, x + 60, 120 + 50 * i], fill=colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def run_demo(model: str | None, max_new_tokens: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            from raincheck_core.models.random_init import save_random_checkpoint

            print("No demo model yet: using a RANDOM Qwen3.5-architecture model (answers are noise).")
            model = str(save_random_checkpoint(Path(tmp) / "random", "qwen3_5", "bench"))
        engine = Engine.from_pretrained(model)
        cfg = engine.model_config
        visual = engine.vision.encode_images([_scene()])[0]
        n = visual.num_tokens(cfg.spatial_merge_size)
        image = [cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id]
        turns = [Prompt([11, 12, *image, 13, 14, 15], [visual]), Prompt([16, 17, 18])]
        session = engine.open_session()
        sampling = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        for i, prompt in enumerate(turns, 1):
            end = session.turn(prompt, sampling).result()
            m = end.metrics
            print(f"turn {i}: {m.prompt_tokens} new input tokens ({n if i == 1 else 0} visual), "
                  f"TTFT {1e3 * m.ttft_s:.1f} ms, TPOT {1e3 * m.tpot_s:.1f} ms, E2E {1e3 * m.e2e_s:.0f} ms")
            print(f"  tokens: {end.token_ids}")
        session.close()
