"""The encoder cache: a repeated image or video is not run through the tower again, and gets the same
outputs; other content or other processor settings miss; the byte budget holds."""

from __future__ import annotations

import pytest
import torch

from raincheck_core.multimodal.encoder_cache import EncoderCache
from tests.multimodal.mm_helpers import encoder, png


@pytest.fixture(scope="module")
def plain():
    return encoder("qwen3_vl")


def _cached(**kw):
    vision = encoder("qwen3_vl", **kw)
    vision.cache = EncoderCache(1 << 30)
    return vision


def _calls(vision) -> list[int]:
    """How many visuals each run of the tower took."""
    calls = []
    vision.model.register_forward_pre_hook(lambda m, args, kw: calls.append(len(kw["grid_thw"])), with_kwargs=True)
    return calls


def test_a_repeated_image_is_not_encoded_again(plain):
    vision = _cached()
    calls = _calls(vision)
    red, green = png(), png(color="green")
    (a,) = vision.encode_images([red])
    b = vision.encode_images([red, green])
    assert calls == [1, 1]                 # the second call ran the tower on the green image only
    stats = vision.cache.stats()
    assert (stats.hits, stats.misses, stats.entries) == (1, 2, 2)
    assert torch.equal(b[0].embeddings, a.embeddings)
    assert b[0].content_hash == a.content_hash != b[1].content_hash
    (ref,) = plain.encode_images([green])
    assert float((b[1].embeddings - ref.embeddings).abs().max()) <= 1e-5
    for got, want in zip(b[1].deepstack, ref.deepstack, strict=True):
        assert float((got - want).abs().max()) <= 1e-5


def test_processor_settings_and_signals_are_part_of_the_key():
    vision = _cached()
    (a,) = vision.encode_images([png()])
    (b,) = vision.encode_images([png()], max_pixels=32 * 32)     # resized otherwise: other pixels
    assert a.content_hash != b.content_hash
    (c,) = vision.encode_images([png()], signals=True)           # the entry has no signals: encoded again
    assert c.attention_received is not None and vision.cache.stats().hits == 0
    (d,) = vision.encode_images([png()], signals=True)
    (e,) = vision.encode_images([png()])
    assert vision.cache.stats().hits == 2
    assert d.attention_received is not None and e.attention_received is None


def test_a_repeated_video_is_not_encoded_again():
    vision = _cached()
    calls = _calls(vision)
    frames = [png(color=c) for c in ("red", "green", "red", "blue")]
    a = vision.encode_video(frames)
    b = vision.encode_video(frames)
    assert calls == [1] and torch.equal(a.embeddings, b.embeddings) and a.content_hash == b.content_hash


def test_the_byte_budget_holds():
    vision = _cached()
    vision.encode_images([png()])
    one = vision.cache.stats().bytes
    vision.cache = EncoderCache(one + one // 2)
    for color in ("red", "green", "blue"):
        vision.encode_images([png(color=color)])
        assert vision.cache.stats().bytes <= one + one // 2
    assert vision.cache.stats().entries == 1


def test_the_same_bytes_skip_decoding_and_preprocessing():
    vision = _cached()
    preprocessed = []
    preprocess = vision.preprocess_images
    vision.preprocess_images = lambda images, **kw: preprocessed.append(len(images)) or preprocess(images, **kw)
    red = png()
    (a,) = vision.encode_images([red])
    (b,) = vision.encode_images([bytes(red)])
    assert preprocessed == [1] and b.content_hash == a.content_hash
    vision.encode_images([red], max_pixels=32 * 32)     # other settings: preprocessed again
    assert preprocessed == [1, 1]
