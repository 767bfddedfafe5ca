"""A step's rows packed in plan order (engine/packing.py): a plain decode step, whose rows take the short way (one
answer run read off the segments), packs them as the segment-by-segment way does in a step that holds more."""

from __future__ import annotations

import pytest
import torch

from raincheck_core.engine.packing import pack_rows
from raincheck_core.engine.plan import Segment, StepPlan
from raincheck_core.ops.uploads import Uploads

HIDDEN = 8


def _decode(i: int) -> Segment:
    slot = torch.tensor([i])
    return Segment.decode(f"s{i}", token=3 * i + 1, position=10 + i, write=slot, read=slot, gdn_slot=None,
                          tracked=False)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("keep_hidden", [False, True])
def test_a_plain_decode_step_packs_its_rows_as_a_step_holding_more_does(staged, keep_hidden):
    embed = torch.nn.Embedding(64, HIDDEN)
    rows = [_decode(i) for i in range(5)]
    plain, more = StepPlan(rows), StepPlan([*rows, Segment.padding(2, torch.tensor([63]), None)])
    packed = []
    for plan in (plain, more):
        up = Uploads("cpu").begin() if staged else None
        packed.append(pack_rows(plan, embed, keep_hidden, uploads=up))
        if up is not None:
            up.send()       # the staged token ids, then the lookup into the packed rows
    a, b = packed
    with torch.no_grad():
        assert torch.equal(a.embeds, embed(torch.tensor([s.token for s in rows])))
    assert torch.equal(a.embeds, b.embeds[:5]) and torch.equal(b.embeds[5:], torch.zeros(2, HIDDEN))
    assert a.positions.tolist() == [[10, 11, 12, 13, 14]] * 3 and torch.equal(a.positions, b.positions[:, :5])
    assert a.starts == b.starts[:5] == [0, 1, 2, 3, 4] and a.logit_rows == b.logit_rows == [0, 1, 2, 3, 4]
    assert a.hidden_rows == b.hidden_rows == ([0, 1, 2, 3, 4] if keep_hidden else [])
    assert a.deepstack_rows is None and a.deepstack == []
