"""A handful of held-out dialogues through the shipped model: `full` answers them; `hard` misses the answers
whose evidence its selection pruned and keeps the others; `raincheck` with the same selection gets the
pruned evidence back (item by item: its approximations may cost an item of a 12-item list now and then)."""

from __future__ import annotations

import random

import pytest

from raincheck_core import DeferralConfig, Message, SamplingParams
from raincheck_core.models.demo.world import Dialogue, make_dialogue
from raincheck_core.pruning import keep_count

from .helpers import engine, needs_checkpoint

pytestmark = needs_checkpoint
TEST_SEED = 424242          # never used in training (see raincheck_core.models.demo.train)


def dialogues(n: int = 4) -> list[Dialogue]:
    # later turns ask for two-word or list answers, so a pruned cell cannot be guessed by chance
    rng = random.Random(TEST_SEED)
    return [make_dialogue(rng, turns=3, later={"relation": 1.0, "list": 0.5}) for _ in range(n)]


def selection(d: Dialogue, retention: float = 0.3) -> list[int]:
    """Keep the first turn's evidence (and cells nobody asks about), prune every later turn's evidence."""
    n = d.scene.rows * d.scene.cols
    cols = d.scene.cols
    first = [r * cols + c for r, c in d.questions[0].cells]
    later = {r * cols + c for q in d.questions[1:] for r, c in q.cells}
    rest = [i for i in range(n) if i not in later and i not in first]
    return sorted((first + rest)[:keep_count(n, retention)])


def answers(d: Dialogue, policy: str, keep: list[int]) -> list[str]:
    eng = engine()
    cfg = DeferralConfig(policy, selector="explicit", selector_options={"indices": keep})
    session = eng.open_session(deferral=cfg)
    png = d.scene.png()
    out = [session.turn(Message(q.text, images=[png] if t == 0 else []),
                        SamplingParams(max_new_tokens=48)).text() for t, q in enumerate(d.questions)]
    session.close()
    return out


def items(answer: str, gold: str) -> float:
    return sum(a == b for a, b in zip(answer.split(), gold.split(), strict=False)) / len(gold.split())


@pytest.mark.parametrize("index", range(4))
def test_full_answers_hard_misses_pruned_evidence_raincheck_recovers(index):
    d = dialogues()[index]
    gold = [q.answer for q in d.questions]
    keep = selection(d)
    assert answers(d, "full", keep) == gold
    hard = answers(d, "hard", keep)
    assert hard[0] == gold[0]                                   # its evidence was kept
    assert all(h != g for h, g in zip(hard[1:], gold[1:], strict=True))   # evidence pruned: missed
    rc = answers(d, "raincheck", keep)
    assert rc[0] == gold[0]
    assert all(items(r, g) >= 0.9 > items(h, g) for r, h, g in zip(rc[1:], hard[1:], gold[1:], strict=True))
