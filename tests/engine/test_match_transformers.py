"""Our decoders against transformers' own, on tiny random checkpoints saved and reloaded (fp32, ≤ 1e-4)."""

from __future__ import annotations

import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from tests.engine.reference import hf_logits, image_tokens, random_visual, video_tokens

FAMILIES = ["qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe"]
TOL = 1e-4


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    return {f: (hf, Engine.from_pretrained(folder)) for f, (hf, folder) in tiny_checkpoints.items()}


def _levels(engine: Engine) -> int:
    return engine.model_config.deepstack_levels


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_text_only(engines, family):
    hf, engine = engines[family]
    ids = torch.randint(0, 150, (37,), generator=torch.Generator().manual_seed(1))
    assert _max_diff(engine.forward_logits(ids), hf_logits(hf, ids)) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_one_image_with_3d_positions(engines, family):
    hf, engine = engines[family]
    grid = (1, 6, 8)
    visual = random_visual("image", grid, 64, _levels(engine), seed=2)
    ids = torch.tensor([5, 6, 7] + image_tokens(grid) + [8, 9, 10, 11])
    assert _max_diff(engine.forward_logits(ids, visual=[visual]), hf_logits(hf, ids, [visual])) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_two_images(engines, family):
    hf, engine = engines[family]
    g1, g2 = (1, 4, 6), (1, 8, 4)
    v1 = random_visual("image", g1, 64, _levels(engine), seed=3)
    v2 = random_visual("image", g2, 64, _levels(engine), seed=4)
    ids = torch.tensor([5] + image_tokens(g1) + [6, 7] + image_tokens(g2) + [8, 9])
    assert _max_diff(engine.forward_logits(ids, visual=[v1, v2]), hf_logits(hf, ids, [v1, v2])) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_video(engines, family):
    hf, engine = engines[family]
    grid = (3, 4, 4)
    visual = random_visual("video", grid, 64, _levels(engine), seed=5)
    ids = torch.tensor([5, 6] + video_tokens(grid, [40, 41, 42]) + [7, 8])
    assert _max_diff(engine.forward_logits(ids, visual=[visual]), hf_logits(hf, ids, [visual])) <= TOL


def _generated_mask(n: int, spans: list[tuple[int, int]]) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    for a, b in spans:
        mask[a:b] = True
    return mask


def _image_prompt(engine: Engine, seed: int) -> Prompt:
    grid = (1, 4, 6)
    visual = random_visual("image", grid, 64, _levels(engine), seed=seed)
    return Prompt([5, 6] + image_tokens(grid) + [7, 8, 9], [visual])


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_20_decode_steps(engines, family):
    hf, engine = engines[family]
    prompt = _image_prompt(engine, seed=6)
    session = engine.open_session()
    events = session.turn(prompt, SamplingParams(max_new_tokens=21, ignore_eos=True), return_logits=True).tokens()
    session.close()
    generated = [e.token_id for e in events]
    # the logits of step i come from the sequence prompt + generated[:i]
    ids = torch.tensor(prompt.token_ids + generated[:-1])
    ref = hf_logits(hf, ids, prompt.visuals, _generated_mask(len(ids), [(len(prompt.token_ids), len(ids))]))
    ref = ref[len(prompt.token_ids) - 1:]
    ours = torch.stack([e.logits for e in events])
    assert len(events) == 21
    assert _max_diff(ours, ref) <= TOL
    assert generated == ref.argmax(-1).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_three_turn_session_equals_one_forward(engines, family):
    hf, engine = engines[family]
    session = engine.open_session()
    turns = [_image_prompt(engine, seed=7), Prompt([11, 12, 13, 14]), _image_prompt(engine, seed=8)]
    conversation: list[int] = []
    visuals, step_logits, generated_spans = [], [], []
    last = -1
    for i, prompt in enumerate(turns):
        events = session.turn(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True), return_logits=True).tokens()
        start = len(conversation) + len(prompt.token_ids) + (1 if i else 0)   # + the previous answer's last token
        if i:
            generated_spans.append((len(conversation), len(conversation) + 1))
        conversation += ([last] if i else []) + prompt.token_ids
        generated_spans.append((len(conversation), len(conversation) + len(events) - 1))
        conversation += [e.token_id for e in events[:-1]]
        last = events[-1].token_id
        visuals += prompt.visuals
        step_logits.append((start, torch.stack([e.logits for e in events])))
    session.close()
    ref = hf_logits(hf, torch.tensor(conversation), visuals, _generated_mask(len(conversation), generated_spans))
    for start, ours in step_logits:
        assert _max_diff(ours, ref[start - 1:start - 1 + len(ours)]) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_equals_one_pass(tiny_checkpoints, family):
    _, folder = tiny_checkpoints[family]
    prompt = Prompt([5, 6] + image_tokens((1, 8, 8)) + list(range(20, 60)), [])
    engine_whole = Engine.from_pretrained(folder)
    prompt.visuals = [random_visual("image", (1, 8, 8), 64, _levels(engine_whole), seed=9)]
    engine_chunked = Engine.from_pretrained(folder, max_rows_per_step=7)
    results = []
    for engine in (engine_whole, engine_chunked):
        s = engine.open_session()
        results.append(torch.stack([e.logits for e in s.turn(
            prompt, SamplingParams(max_new_tokens=5, ignore_eos=True), return_logits=True).tokens()]))
        s.close()
    assert _max_diff(results[0], results[1]) <= TOL
