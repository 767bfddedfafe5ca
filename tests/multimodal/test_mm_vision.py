"""VisionEncoder against transformers' own get_image_features / get_video_features on tiny models."""

from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image

from raincheck_core.errors import CheckpointError, InvalidInputError
from raincheck_core.multimodal import VisionEncoder, load_image
from raincheck_core.multimodal.vision import IMAGE_FORMATS
from tests.multimodal.mm_helpers import encoder, huge_png, model, png, tiny


def hf_processor(**kw):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                    min_pixels=32 * 32, max_pixels=64 * 96, **kw)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_images_match_get_image_features(family, tmp_path):
    enc = encoder(family)
    path = tmp_path / "b.png"
    path.write_bytes(png(64, 64, "green"))
    images = [png(), path, Image.open(io.BytesIO(png(96, 64, "blue")))]
    visuals = enc.encode_images(images)
    # Reference: transformers' processor + the VLM's own feature path, on the same decoded images.
    decoded = [Image.open(io.BytesIO(png())), Image.open(path), Image.open(io.BytesIO(png(96, 64, "blue")))]
    inputs = hf_processor()(images=decoded, return_tensors="pt")
    pixels, grids = enc.preprocess_images(images)
    assert torch.equal(pixels, inputs["pixel_values"]) and torch.equal(grids, inputs["image_grid_thw"])
    with torch.no_grad():
        ref = model(family).model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    assert [v.grid_thw for v in visuals] == [(1, 4, 6), (1, 4, 4), (1, 4, 6)]
    levels = 2 if family == "qwen3_vl" else 0
    assert enc.deepstack_levels == levels
    for i, v in enumerate(visuals):
        v.validate(hidden=64, merge=2, deepstack_levels=levels)
        assert (v.embeddings - ref.pooler_output[i]).abs().max() <= 1e-5
        assert len(v.deepstack) == levels
        for got, want in zip(v.deepstack, getattr(ref, "deepstack_features", []), strict=True):
            assert (got - want[i]).abs().max() <= 1e-5


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_video_matches_get_video_features(family):
    enc = encoder(family)
    frames = [png(color=c) for c in ("red", "green", "blue")]  # odd: the last frame is repeated
    video = enc.encode_video(frames)
    assert video.kind == "video" and video.grid_thw == (2, 4, 6)
    pixels, grid = enc.preprocess_video(frames)
    # Frame layout: temporal slot k of patch j holds frame 2j+k, as an image's pixels hold its one frame.
    img_pixels, _ = enc.preprocess_images([frames[0], frames[1], frames[2]])
    p2 = 16 * 16
    per_img = img_pixels.view(3, 24, 3, 2, p2)
    per_vid = pixels.view(2, 24, 3, 2, p2)
    assert torch.equal(per_vid[0, :, :, 0], per_img[0, :, :, 0])
    assert torch.equal(per_vid[0, :, :, 1], per_img[1, :, :, 0])
    assert torch.equal(per_vid[1, :, :, 0], per_img[2, :, :, 0])
    assert torch.equal(per_vid[1, :, :, 1], per_img[2, :, :, 0])
    with torch.no_grad():
        ref = model(family).model.get_video_features(pixels, grid)
    assert (video.embeddings - ref.pooler_output[0]).abs().max() <= 1e-5
    for got, want in zip(video.deepstack, getattr(ref, "deepstack_features", []), strict=True):
        assert (got - want[0]).abs().max() <= 1e-5
    assert enc.video_timestamps(3) == [0.25, 1.0]


def test_from_saved_folder_and_pixel_options(tmp_path):
    m = model("qwen3_vl")
    tiny.save_model(m, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "model.safetensors")
    enc = VisionEncoder.from_checkpoint(tmp_path, config, weights, "cpu", torch.float32)
    # No preprocessor files: the Qwen3-VL defaults (min 65536 px) upscale the small image.
    assert enc.image_processor.size.shortest_edge == 65536
    assert enc.encode_images([png()])[0].grid_thw == (1, 14, 20)
    assert enc.encode_images([png()], max_pixels=64 * 64, min_pixels=32 * 32)[0].grid_thw == (1, 2, 4)

    pre = {"size": {"longest_edge": 64 * 96, "shortest_edge": 1024}, "patch_size": 16,
           "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
           "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor"}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(pre))
    video_pre = {"size": {"longest_edge": 2 * 64 * 64, "shortest_edge": 1024}, "fps": 4, "max_frames": 4}
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(video_pre))
    enc = VisionEncoder.from_checkpoint(tmp_path, config, weights, "cpu", torch.float32)
    assert enc.encode_images([png()])[0].grid_thw == (1, 4, 6)
    assert enc.encode_video([png(), png()]).grid_thw == (1, 2, 4)  # at most 2 * 64x64 px over both frames
    assert enc.video_timestamps(2) == [0.125]
    small = VisionEncoder.from_checkpoint(tmp_path, config, weights, "cpu", torch.float32, max_pixels=64 * 64)
    assert small.encode_images([png()])[0].grid_thw == (1, 2, 4)  # the option overrides the folder's config
    with pytest.raises(InvalidInputError, match="at most 4"):
        enc.encode_video([png()] * 5)


def test_strict_weights():
    m = model("qwen3_vl")
    config = m.config.to_dict()
    weights = dict(m.state_dict())
    weights.pop("model.visual.merger.linear_fc2.bias")
    weights["model.visual.extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError) as e:
        VisionEncoder.from_checkpoint(None, config, weights, "cpu", torch.float32)
    assert e.value.missing == ["model.visual.merger.linear_fc2.bias"]
    assert e.value.unexpected == ["model.visual.extra.weight"]
    # Older hub layout: the tower under "visual." instead of "model.visual.".
    old = {k.removeprefix("model."): v for k, v in m.state_dict().items() if k.startswith("model.visual.")}
    enc = VisionEncoder.from_checkpoint(None, config, old, "cpu", torch.float32, min_pixels=1024,
                                        max_pixels=6144)
    assert enc.encode_images([png()])[0].grid_thw == (1, 4, 6)


def test_bad_inputs(tmp_path):
    enc = encoder("qwen3_5")
    with pytest.raises(InvalidInputError, match=r"image 1 \(9 bytes\) could not be decoded"):
        enc.encode_images([png(), b"not a png"])
    with pytest.raises(InvalidInputError, match="no such file"):
        enc.encode_images([tmp_path / "missing.png"])
    with pytest.raises(InvalidInputError, match="expected a PIL image"):
        enc.encode_images([42])
    with pytest.raises(InvalidInputError, match="could not be decoded"):
        enc.encode_images([png()[:60]])  # truncated PNG
    with pytest.raises(InvalidInputError, match="differ in size"):
        enc.encode_video([png(), png(64, 64)])
    assert enc.encode_images([]) == []


def test_oversized_images_are_refused_from_their_header():
    enc = encoder("qwen3_5")
    with pytest.raises(InvalidInputError, match=r"image 0 \(\d+ bytes\) is 9000x9000 pixels; at most 16777216"):
        enc.encode_images([huge_png()])
    with pytest.raises(InvalidInputError, match=r"video frame 1 \(\d+ bytes\) is 4200x4200 pixels"):
        enc.encode_video([png(), huge_png(4200, 4200)])
    assert load_image(huge_png(64, 64), max_pixels=64 * 64).size == (64, 64)
    with pytest.raises(InvalidInputError, match="is 64x65 pixels; at most 4096 pixels"):
        load_image(huge_png(64, 65), max_pixels=64 * 64)


def test_only_common_image_formats_are_decoded():
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(buf, format="PPM")
    with pytest.raises(InvalidInputError, match=r"could not be decoded as an image \(PNG, JPEG, WEBP"):
        load_image(buf.getvalue())
    for fmt in IMAGE_FORMATS:
        buf = io.BytesIO()
        Image.new("RGB", (8, 8), "red").save(buf, format=fmt)
        assert load_image(buf.getvalue()).size == (8, 8)
