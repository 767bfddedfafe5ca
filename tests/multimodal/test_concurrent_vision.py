"""Sessions encode their images on their own threads, outside the engine lock, through one shared vision
tower: concurrent image turns with selectors that read ViT attention (mmtok, hiprune, visionzip) and
ones that do not (divprune) select and answer exactly as the same turns run one at a time."""

from __future__ import annotations

import random
import threading

from raincheck_core import DeferralConfig, Message, SamplingParams
from raincheck_demo.world import make_dialogue
from tests.demo.helpers import engine, needs_checkpoint

pytestmark = needs_checkpoint
SELECTORS = ("mmtok", "hiprune", "divprune", "visionzip")


def _turn(case: tuple[str, str, bytes]) -> tuple[list[list[int]], str]:
    """Selection (the positions of the first prefill's rows) and greedy answer of one image turn."""
    selector, question, image = case
    cfg = DeferralConfig("raincheck", tpot_slo=None, selector=selector, retention=0.3)
    session = engine().open_session(deferral=cfg)
    try:
        stream = session.turn(Message(question, images=[image]), SamplingParams(max_new_tokens=16))
        answer = stream.text()
        return stream.request.input.positions.tolist(), answer
    finally:
        session.close()


def test_concurrent_image_turns_match_sequential_ones():
    rng = random.Random(13)
    cases = []
    for i in range(8):
        d = make_dialogue(rng, turns=1)
        cases.append((SELECTORS[i % len(SELECTORS)], d.questions[0].text, d.scene.png()))
    alone = [_turn(case) for case in cases]

    start = threading.Barrier(len(cases))
    results: list = [None] * len(cases)

    def run(i: int) -> None:
        start.wait(timeout=60)
        try:
            results[i] = _turn(cases[i])
        except Exception as e:   # reported by the assert below, per turn
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    failed = {cases[i][0] + f"#{i}": repr(r) for i, r in enumerate(results) if isinstance(r, Exception)}
    assert not failed
    for i, (got, want) in enumerate(zip(results, alone, strict=True)):
        assert got[0] == want[0], f"turn {i} ({cases[i][0]}): a different selection under concurrency"
        assert got[1] == want[1], f"turn {i} ({cases[i][0]}): {got[1]!r} != {want[1]!r}"
