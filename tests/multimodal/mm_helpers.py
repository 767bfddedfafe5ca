"""Shared helpers of the multimodal tests: tiny models, a PNG drawn with PIL, a tiny word-level tokenizer."""

from __future__ import annotations

import functools
import io
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from raincheck_core.multimodal.chat import chatml_template
from tests import tiny

torch.set_num_threads(2)

IMAGE, VIDEO, VS, VE = tiny.IMAGE_TOKEN, tiny.VIDEO_TOKEN, tiny.VISION_START, tiny.VISION_END
IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_id=VS, vision_end_id=VE)


@functools.cache
def model(family: str):
    return tiny.build_model(family)


def png(width: int = 96, height: int = 64, color: str = "red") -> bytes:
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    draw.rectangle([8, 8, width // 2, height // 2], fill=color)
    draw.ellipse([width // 2, height // 3, width - 4, height - 4], fill="blue")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def encoder(family: str, folder: Path | None = None, **kw):
    from raincheck_core.multimodal import VisionEncoder

    m = model(family)
    kw.setdefault("min_pixels", 32 * 32)
    kw.setdefault("max_pixels", 64 * 96)
    config, weights = m.config.to_dict(), m.state_dict()
    return VisionEncoder.from_checkpoint(folder, config, weights, "cpu", torch.float32, **kw)


SPECIALS = {"<|image_pad|>": IMAGE, "<|video_pad|>": VIDEO, "<|vision_start|>": VS, "<|vision_end|>": VE,
            "<|im_start|>": 155, "<|im_end|>": 156, "<|endoftext|>": 157}
WORDS = ["[UNK]", "user", "assistant", "system", "what", "is", "this", "?", "a", "red", "box", "and", "the",
         "blue", "one", "<", ">", ".", "seconds", "0", "1", "2", "5", "8", "you", "are", "helpful", "hi"]

# Qwen-VL style template (shape of Qwen2-VL's: default system prompt, visuals as typed content parts).
QWEN_TEMPLATE = chatml_template("you are helpful .")


def save_tokenizer(folder: Path, chat_template: str | None = None, generation_eos=None) -> Path:
    """A word-level tokenizer whose special ids fit the tiny models, saved as a transformers tokenizer."""
    import json

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)} | SPECIALS
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="[UNK]")
    if chat_template is not None:
        fast.chat_template = chat_template
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    if generation_eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return folder


def huge_png(width: int = 9000, height: int = 9000) -> bytes:
    """A genuine greyscale PNG of width x height px that compresses to a few hundred KiB (built row by row,
    so the test never holds the decoded image)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z = zlib.compressobj(9)
    row = bytes(width + 1)                # filter byte 0, then black pixels
    body = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")
