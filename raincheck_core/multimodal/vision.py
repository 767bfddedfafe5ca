"""The checkpoint's vision tower, run through transformers' own module (Qwen3-VL / Qwen3.5).

Images go through transformers' Qwen2-VL image processor (the PIL backend: torchvision is not a dependency).
Videos use the same processor for rescale/normalize/patchify, with the resize and temporal pairing of
transformers' `Qwen3VLVideoProcessor` done here (that class needs torchvision). Frames arrive already
sampled; their timestamps come from `fps` (see `video_timestamps`).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from ..errors import CheckpointError, InvalidInputError, UnsupportedModelError
from ..inputs import VisualInput
from ..pruning.vit_attention import install_attention_capture, merge_group_mean, record_attention_received
from .encoder_cache import EncoderCache, pixels_key

ImageLike = Image.Image | bytes | bytearray | str | Path

# model_type -> (module, config class, vision model class)
_TOWERS = {
    "qwen3_vl": ("qwen3_vl", "Qwen3VLVisionConfig", "Qwen3VLVisionModel"),
    "qwen3_5": ("qwen3_5", "Qwen3_5VisionConfig", "Qwen3_5VisionModel"),
    "qwen3_vl_moe": ("qwen3_vl_moe", "Qwen3VLMoeVisionConfig", "Qwen3VLMoeVisionModel"),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeVisionConfig", "Qwen3_5MoeVisionModel"),
}
# Where checkpoints keep the tower: transformers' save_pretrained layout first, then the older hub one.
VISION_PREFIXES = ("model.visual.", "visual.")
# Qwen3-VL / Qwen3.5 processor defaults (their preprocessor_config.json / video_preprocessor_config.json).
IMAGE_PIXELS = (65536, 16777216)
VIDEO_PIXELS = (4096, 25165824)
# The largest image or frame decoded, read from its header before decoding (a 231 KiB PNG can claim
# 9000x9000 px, 243 MB decoded): Qwen3-VL's own max_pixels, to which anything larger is downscaled anyway.
MAX_DECODE_PIXELS = IMAGE_PIXELS[1]
# What images are decoded from: the common web formats, not every format Pillow knows (its EPS plugin
# runs Ghostscript, for one).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
_MEAN_STD = [0.5, 0.5, 0.5]


@dataclass
class VideoSettings:
    min_pixels: int = VIDEO_PIXELS[0]   # over all frames, like transformers' video smart_resize
    max_pixels: int = VIDEO_PIXELS[1]
    max_frames: int = 768
    fps: float = 2.0                    # assumed rate of the frames a caller sends (qwen-vl-utils' default)
    image_mean: tuple[float, ...] = tuple(_MEAN_STD)
    image_std: tuple[float, ...] = tuple(_MEAN_STD)
    resample: int = Image.Resampling.BICUBIC


class VisionEncoder:
    """Turns images / videos into `VisualInput`s: merged visual tokens (+ DeepStack features for Qwen3-VL)."""

    def __init__(self, model: torch.nn.Module, image_processor, video: VideoSettings, *, merge: int,
                 patch_size: int, temporal_patch_size: int):
        self.model = model
        self.image_processor = image_processor
        self.video = video
        self.merge = merge
        self.patch_size = patch_size
        self.temporal_patch_size = temporal_patch_size
        self.deepstack_levels = len(getattr(model.config, "deepstack_visual_indexes", None) or [])
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        # now, before sessions share the tower across threads (vit_attention: Concurrency)
        install_attention_capture(model)
        self.cache: EncoderCache | None = None     # outputs by input content (the engine sets it)

    @classmethod
    def from_checkpoint(
        cls,
        folder: Path | None,
        hf_config: dict,
        weights: Mapping[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        video_max_pixels: int | None = None,
    ) -> VisionEncoder:
        """Build transformers' vision model from `hf_config["vision_config"]` and load `model.visual.*`."""
        model_type = hf_config.get("model_type")
        if model_type not in _TOWERS or "vision_config" not in hf_config:
            raise UnsupportedModelError(f"no vision tower for model_type {model_type!r}")
        model = _build_tower(model_type, dict(hf_config["vision_config"]), weights, device, dtype)
        vc = model.config
        image_processor = _image_processor(folder, vc, min_pixels, max_pixels)
        video = _video_settings(folder, video_max_pixels)
        return cls(model, image_processor, video, merge=vc.spatial_merge_size, patch_size=vc.patch_size,
                   temporal_patch_size=vc.temporal_patch_size)

    # -- images -----------------------------------------------------------------------------------------

    def preprocess_images(self, images: Sequence[ImageLike], *, min_pixels: int | None = None,
                          max_pixels: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(pixel_values [patches, C*T*p*p], image_grid_thw [n, 3])`, as transformers' processor gives."""
        pil = [load_image(img, i) for i, img in enumerate(images)]
        kwargs = {}
        if min_pixels is not None or max_pixels is not None:
            size = self.image_processor.size
            kwargs["size"] = {"shortest_edge": min_pixels or size.shortest_edge,
                              "longest_edge": max_pixels or size.longest_edge}
        try:
            out = self.image_processor(images=pil, return_tensors="pt", **kwargs)
        except ValueError as e:  # e.g. an aspect ratio over 200
            raise InvalidInputError(f"cannot preprocess image: {e}") from e
        return out["pixel_values"], out["image_grid_thw"]

    def encode_images(self, images: Sequence[ImageLike], *, min_pixels: int | None = None,
                      max_pixels: int | None = None, signals: bool = False) -> list[VisualInput]:
        """One `VisualInput` per image (all images run through the tower in one batch)."""
        if not images:
            return []
        settings = f"image:{min_pixels}:{max_pixels}:{self.image_processor.to_json_string()}"
        raws = [raw_key(img, settings) for img in images]
        if self.cache is not None and (found := self.cache.find(raws, signals)) is not None:
            return found
        pixels, grids = self.preprocess_images(images, min_pixels=min_pixels, max_pixels=max_pixels)
        return self._remember(raws, self._encode_cached(pixels, grids, "image", signals))

    # -- videos -----------------------------------------------------------------------------------------

    def preprocess_video(self, frames: Sequence[ImageLike], *, max_pixels: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(pixel_values_videos, video_grid_thw [1, 3])` for one video given as sampled frames."""
        if not frames:
            raise InvalidInputError("a video needs at least one frame")
        if len(frames) > self.video.max_frames:
            raise InvalidInputError(
                f"video has {len(frames)} frames, at most {self.video.max_frames} are accepted: sample fewer"
            )
        pil = [_to_rgb(load_image(f, i, what="video frame")) for i, f in enumerate(frames)]
        if len({im.size for im in pil}) != 1:
            raise InvalidInputError(f"video frames differ in size: {sorted({im.size for im in pil})}")
        tp = self.temporal_patch_size
        pil += [pil[-1]] * (-len(pil) % tp)  # transformers pads with the last frame
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        width, height = pil[0].size
        try:
            h, w = smart_resize(len(pil), height, width, temporal_factor=tp,
                                factor=self.patch_size * self.merge, min_pixels=self.video.min_pixels,
                                max_pixels=max_pixels or self.video.max_pixels)
        except ValueError as e:
            raise InvalidInputError(f"cannot preprocess video: {e}") from e
        pil = [im.resize((w, h), resample=self.video.resample) for im in pil]
        # The image processor duplicates each frame over the temporal axis; keep one copy per frame and pair
        # consecutive frames, giving transformers' video layout (gt, gh/m, gw/m, m, m, C, T, p, p).
        out = self.image_processor(images=pil, do_resize=False, image_mean=list(self.video.image_mean),
                                   image_std=list(self.video.image_std), return_tensors="pt")
        p, gh, gw = self.patch_size, h // self.patch_size, w // self.patch_size
        per_frame = out["pixel_values"].view(len(pil), gh * gw, 3, tp, p * p)[:, :, :, 0]
        gt = len(pil) // tp
        pixels = per_frame.view(gt, tp, gh * gw, 3, p * p).permute(0, 2, 3, 1, 4).reshape(gt * gh * gw, -1)
        return pixels.contiguous(), torch.tensor([[gt, gh, gw]])

    def encode_video(self, frames: Sequence[ImageLike], *, max_pixels: int | None = None,
                     signals: bool = False) -> VisualInput:
        settings = f"video:{max_pixels}:{self.video}:{self.image_processor.to_json_string()}"
        keys = [raw_key(frame, settings) for frame in frames]
        raws = [None if None in keys else b"".join(keys)]
        if self.cache is not None and (found := self.cache.find(raws, signals)) is not None:
            return found[0]
        pixels, grid = self.preprocess_video(frames, max_pixels=max_pixels)
        return self._remember(raws, self._encode_cached(pixels, grid, "video", signals))[0]

    def _remember(self, raws: list[bytes | None], visuals: list[VisualInput]) -> list[VisualInput]:
        """Name each visual's cache entry by its input's bytes too (a repeat skips decoding and preprocessing)."""
        if self.cache is not None:
            for raw, v in zip(raws, visuals, strict=True):
                if raw is not None:
                    self.cache.alias(raw, v.content_hash)
        return visuals

    def video_timestamps(self, num_frames: int, fps: float | None = None) -> list[float]:
        """Seconds per temporal patch, as transformers' Qwen3VLProcessor writes them (`<{t:.1f} seconds>`).

        Frame i is at i / fps; frames are padded to a multiple of the temporal patch size with the last one,
        and each temporal patch gets the mean time of its first and last frame."""
        fps = fps or self.video.fps
        tp = self.temporal_patch_size
        idx = list(range(num_frames)) + [num_frames - 1] * (-num_frames % tp)
        secs = [i / fps for i in idx]
        return [(secs[i] + secs[i + tp - 1]) / 2 for i in range(0, len(secs), tp)]

    # -- tower ------------------------------------------------------------------------------------------

    def _encode_cached(self, pixels: torch.Tensor, grids: torch.Tensor, kind: str, signals: bool
                       ) -> list[VisualInput]:
        """`_encode` for the visuals the encoder cache does not hold (in one batch); each output carries its
        input's content hash (the prefix cache's key for its rows)."""
        parts = torch.split(pixels, grids.prod(-1).tolist())
        keys = [pixels_key(kind, g, p) for g, p in zip(grids, parts, strict=True)]
        out = [self.cache.get(k, signals) if self.cache is not None else None for k in keys]
        todo = [i for i, v in enumerate(out) if v is None]
        if todo:
            fresh = self._encode(torch.cat([parts[i] for i in todo]), grids[todo], kind, signals)
            for i, v in zip(todo, fresh, strict=True):
                v.content_hash = keys[i]
                out[i] = v
                if self.cache is not None:
                    self.cache.put(keys[i], v)
        return out

    @torch.inference_mode()
    def _encode(self, pixels: torch.Tensor, grids: torch.Tensor, kind: str, signals: bool = False
                ) -> list[VisualInput]:
        """`signals`: also return what attention- and feature-based selectors read (ViT attention
        received, last-block features); it costs two extra attention passes, so only on request."""
        sizes = (grids.prod(-1) // self.merge**2).tolist()
        with record_attention_received(self.model) if signals else nullcontext({}) as scores:
            out = self.model(pixels.to(self.device, self.dtype), grid_thw=grids.to(self.device), return_dict=True)
        embeds = torch.split(out.pooler_output, sizes)
        levels = [torch.split(f, sizes) for f in (getattr(out, "deepstack_features", None) or [])]
        features = per_item_scores = None
        if signals:
            features = torch.split(merge_group_mean(out.last_hidden_state.float(), self.merge), sizes)
            per_item_scores = {name: torch.split(v, sizes) for name, v in scores.items()}
        return [
            VisualInput(kind, embeds[i], tuple(int(x) for x in grids[i].tolist()), [level[i] for level in levels],
                        vision_features=features[i] if features is not None else None,
                        attention_received={n: v[i] for n, v in per_item_scores.items()} if per_item_scores else None)
            for i in range(len(sizes))
        ]


def raw_key(obj: ImageLike, settings: str) -> bytes | None:
    """16 bytes naming an image given as bytes or a PIL image, under `settings` (the processor's and the
    call's); None for a path (its file may change)."""
    if isinstance(obj, (bytes, bytearray)):
        data = bytes(obj)
    elif isinstance(obj, Image.Image):
        data = f"{obj.mode}:{obj.size}".encode() + obj.tobytes()
    else:
        return None
    return hashlib.blake2b(settings.encode() + data, digest_size=16).digest()


def load_image(obj: ImageLike, index: int = 0, *, what: str = "image",
               max_pixels: int = MAX_DECODE_PIXELS) -> Image.Image:
    """A loaded PIL image from a PIL image, encoded bytes or a file path; InvalidInputError otherwise,
    and for one whose header says it has more than `max_pixels` pixels (checked before decoding)."""
    if isinstance(obj, Image.Image):
        return obj
    if isinstance(obj, (bytes, bytearray)):
        source, label = io.BytesIO(obj), f"{what} {index} ({len(obj)} bytes)"
    elif isinstance(obj, (str, Path)):
        if not Path(obj).is_file():
            raise InvalidInputError(f"{what} {index}: no such file {str(obj)[:200]!r}")
        source, label = obj, f"{what} {index}"
    else:
        raise InvalidInputError(
            f"{what} {index} is a {type(obj).__name__}; expected a PIL image, bytes or a path"
        )
    with _decoding(label):
        img = Image.open(source, formats=IMAGE_FORMATS)   # lazy: reads the header only
    width, height = img.size
    if width * height > max_pixels:
        side = math.isqrt(max_pixels)
        raise InvalidInputError(f"{label} is {width}x{height} pixels; at most {max_pixels} pixels ({side}x{side}) "
                                "are accepted")
    with _decoding(label):
        img.load()  # decode now so truncated data fails here
    return img


@contextmanager
def _decoding(label: str) -> Iterator[None]:
    try:
        yield
    except (OSError, Image.DecompressionBombError, ValueError) as e:
        raise InvalidInputError(f"{label} could not be decoded as an image ({', '.join(IMAGE_FORMATS)}): "
                                f"{str(e)[:200]}") from e


def _to_rgb(img: Image.Image) -> Image.Image:
    # Same as transformers' convert_to_rgb: transparency is composited onto white.
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


def _build_tower(model_type: str, vision_config: dict, weights: Mapping[str, torch.Tensor],
                 device: torch.device | str, dtype: torch.dtype) -> torch.nn.Module:
    import importlib

    from transformers.initialization import no_init_weights

    module_name, config_name, model_name = _TOWERS[model_type]
    mod = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    cfg_mod = importlib.import_module(f"transformers.models.{module_name}.configuration_{module_name}")
    for key in ("model_type", "dtype", "torch_dtype", "architectures", "transformers_version"):
        vision_config.pop(key, None)  # old checkpoints write the parent's model_type here
    config = getattr(cfg_mod, config_name)(**vision_config)

    prefix = next((p for p in VISION_PREFIXES if any(k.startswith(p) for k in weights)), VISION_PREFIXES[0])
    state = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    # Skip random init (weights are loaded right after) and allocate directly on the target device.
    with no_init_weights(), torch.device(device):
        model = getattr(mod, model_name)._from_config(config, dtype=dtype)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise CheckpointError(
            f"vision tower ({model_name}) weights do not match the checkpoint (prefix {prefix!r})",
            missing=[prefix + k for k in missing], unexpected=[prefix + k for k in unexpected],
        )
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:  # shape mismatches
        raise CheckpointError(f"vision tower weights have wrong shapes: {e}") from e
    return model.eval().requires_grad_(False)


def _image_processor(folder: Path | None, vc, min_pixels: int | None, max_pixels: int | None):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    overrides = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
    if folder is not None and (Path(folder) / "preprocessor_config.json").is_file():
        from transformers import AutoImageProcessor

        proc = AutoImageProcessor.from_pretrained(str(folder), **overrides)
        if proc.patch_size != vc.patch_size or proc.merge_size != vc.spatial_merge_size:
            raise CheckpointError(
                f"preprocessor_config.json (patch {proc.patch_size}, merge {proc.merge_size}) disagrees "
                f"with the vision config (patch {vc.patch_size}, merge {vc.spatial_merge_size})"
            )
        return proc
    return Qwen2VLImageProcessorPil(
        patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size,
        merge_size=vc.spatial_merge_size, image_mean=_MEAN_STD, image_std=_MEAN_STD,
        min_pixels=overrides.get("min_pixels", IMAGE_PIXELS[0]),
        max_pixels=overrides.get("max_pixels", IMAGE_PIXELS[1]),
    )


def _video_settings(folder: Path | None, max_pixels: int | None) -> VideoSettings:
    settings = VideoSettings()
    path = Path(folder) / "video_preprocessor_config.json" if folder is not None else None
    if path is not None and path.is_file():
        raw = json.loads(path.read_text())
        size = raw.get("size") or {}
        settings.min_pixels = int(size.get("shortest_edge", raw.get("min_pixels", settings.min_pixels)))
        settings.max_pixels = int(size.get("longest_edge", raw.get("max_pixels", settings.max_pixels)))
        settings.max_frames = int(raw.get("max_frames", settings.max_frames))
        settings.fps = float(raw.get("fps") or settings.fps)
        settings.image_mean = tuple(raw.get("image_mean", settings.image_mean))
        settings.image_std = tuple(raw.get("image_std", settings.image_std))
        settings.resample = int(raw.get("resample", settings.resample))
    if max_pixels is not None:
        settings.max_pixels = max_pixels
    if not (math.isfinite(settings.fps) and settings.fps > 0):
        raise CheckpointError(f"video fps must be positive, got {settings.fps}")
    return settings
