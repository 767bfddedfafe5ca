"""compute_positions against transformers' get_rope_index (Qwen3-VL and Qwen3.5 share it)."""

from __future__ import annotations

import pytest
import torch

from raincheck_core.errors import InvalidInputError
from raincheck_core.inputs import VisualInput
from raincheck_core.multimodal import compute_positions
from tests.multimodal.mm_helpers import IMAGE, VE, VIDEO, VS, model

MERGE = 2


def visual(kind: str, t: int, h: int, w: int) -> VisualInput:
    n = t * h * w // MERGE**2
    return VisualInput(kind, torch.zeros(n, 8), (t, h, w))


def image_tokens(h: int, w: int) -> list[int]:
    return [VS] + [IMAGE] * (h * w // MERGE**2) + [VE]


def video_tokens(t: int, h: int, w: int, stamp_len: int = 3) -> list[int]:
    out = [VS]  # transformers' template wraps the whole video in vision_start/end as well
    for i in range(t):
        out += [10 + i] * stamp_len + [VS] + [VIDEO] * (h * w // MERGE**2) + [VE]
    return [*out, VE]


def reference(family: str, ids: list[int], visuals: list[VisualInput]) -> tuple[torch.Tensor, int]:
    ids_t = torch.tensor([ids])
    types = torch.zeros_like(ids_t, dtype=torch.int32)
    types[ids_t == IMAGE] = 1
    types[ids_t == VIDEO] = 2
    grids = {k: torch.tensor([v.grid_thw for v in visuals if v.kind == k]) for k in ("image", "video")}
    pos, delta = model(family).model.get_rope_index(
        ids_t, types, grids["image"] if len(grids["image"]) else None,
        grids["video"] if len(grids["video"]) else None,
    )
    return pos[:, 0], int(delta) + len(ids)


CASES = {
    "text": ([1, 2, 3, 4, 5], []),
    "one_image": ([1, 2, 3, *image_tokens(4, 6), 4, 5, 6], [visual("image", 1, 4, 6)]),
    "tall_image": ([7, *image_tokens(8, 4), 8], [visual("image", 1, 8, 4)]),
    "two_images": ([1, *image_tokens(4, 6), 2, 3, *image_tokens(6, 2), 4], [visual("image", 1, 4, 6),
                                                                           visual("image", 1, 6, 2)]),
    "video": ([1, 2, *video_tokens(2, 4, 6), 3, 4], [visual("video", 2, 4, 6)]),
    "image_then_video": ([1, *image_tokens(4, 4), 2, *video_tokens(3, 2, 4), 5],
                         [visual("image", 1, 4, 4), visual("video", 3, 2, 4)]),
}


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_get_rope_index(family, case):
    ids, visuals = CASES[case]
    layout = compute_positions(ids, visuals, image_token_id=IMAGE, video_token_id=VIDEO, merge=MERGE)
    ref, next_pos = reference(family, ids, visuals)
    assert torch.equal(layout.positions, ref)
    assert layout.next_position == next_pos  # = max + 1 = position of the first generated token
    for span, v in zip(layout.spans, visuals, strict=True):
        assert span.kind == v.kind and len(span.token_indices) == v.num_tokens(MERGE)
        token = IMAGE if v.kind == "image" else VIDEO
        assert all(ids[i] == token for i in span.token_indices.tolist())


@pytest.mark.parametrize("case", ["one_image", "video", "image_then_video"])
def test_start_offset_continues_a_session(case):
    ids, visuals = CASES[case]
    prefix = [9] * 11
    full = compute_positions(prefix + ids, visuals, image_token_id=IMAGE, video_token_id=VIDEO, merge=MERGE)
    later = compute_positions(ids, visuals, image_token_id=IMAGE, video_token_id=VIDEO, merge=MERGE, start=11)
    assert torch.equal(later.positions, full.positions[:, 11:])
    assert later.next_position == full.next_position
    ref, next_pos = reference("qwen3_vl", prefix + ids, visuals)
    assert torch.equal(later.positions, ref[:, 11:]) and later.next_position == next_pos
    assert [s.token_indices.tolist() for s in later.spans] == [
        (s.token_indices - 11).tolist() for s in full.spans]


def test_empty_and_tensor_input():
    empty = compute_positions([], [], image_token_id=IMAGE, video_token_id=VIDEO, merge=MERGE, start=5)
    assert empty.positions.shape == (3, 0) and empty.next_position == 5
    ids, visuals = CASES["one_image"]
    a = compute_positions(torch.tensor(ids), visuals, image_token_id=IMAGE, video_token_id=VIDEO, merge=MERGE)
    assert a.positions.dtype == torch.long and a.positions.shape == (3, len(ids))


def _err(ids, visuals):
    with pytest.raises(InvalidInputError) as e:
        compute_positions(ids, visuals, image_token_id=IMAGE, video_token_id=VIDEO, merge=MERGE)
    return str(e.value)


def test_validation_messages():
    assert "prompt has 6 image tokens but no image was given" in _err(CASES["one_image"][0], [])
    assert "no image tokens" in _err([1, 2], [visual("image", 1, 4, 6)])
    assert "need 4" in _err(CASES["one_image"][0], [visual("image", 1, 4, 4)])
    # Right total, wrong split: two images whose runs do not match their grids.
    ids = [1, *image_tokens(4, 4), 2, *image_tokens(4, 8), 3]  # runs of 4 and 8
    assert "run of 4" in _err(ids, [visual("image", 1, 4, 8), visual("image", 1, 4, 4)])
    # Adjacent images merge into one run (transformers would misplace them too).
    assert "run of 10" in _err([1] + [IMAGE] * 10 + [2], [visual("image", 1, 4, 4), visual("image", 1, 4, 6)])
    # Kind order.
    ids = [1, *video_tokens(2, 2, 4), *image_tokens(4, 4), 2]
    assert "prompt order" in _err(ids, [visual("image", 1, 4, 4), visual("video", 2, 2, 4)])
    # A video's temporal patches interrupted by an image.
    ids = [1, *video_tokens(1, 2, 4), *image_tokens(4, 4), *video_tokens(1, 2, 4), 2]
    assert "before the image tokens" in _err(ids, [visual("video", 2, 2, 4), visual("image", 1, 4, 4)])
    assert "temporal patch 0 of video 0" in _err([1, *video_tokens(2, 4, 4), 2], [visual("video", 4, 2, 4)])
    assert "divisible" in _err([1, IMAGE, 2], [VisualInput("image", torch.zeros(1, 8), (1, 3, 2))])
