"""A step's staged host-to-device copies (ops/uploads.py) on the CPU twin: the tensors a step puts come out
as they went in, in one copy per staging block, the queued device work runs after that copy, a read before
it sees the poison the twin fills its buffers with, and a kept step's tensors outlive the next step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raincheck_core.ops.uploads import Uploads, put_together


def _inputs() -> list[np.ndarray | torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        np.arange(7, dtype=np.int64),
        np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32),
        np.array([True, False, True, True]),
        torch.randn(5, 3, generator=g),
        torch.arange(4).expand(3, -1),           # a view with a zero stride (a positions tensor's)
        torch.arange(12).view(3, 4).t(),         # not contiguous
        np.zeros(0, dtype=np.int64),
        np.array(9),                             # 0-d
        torch.randint(0, 5, (2, 1, 3), generator=g, dtype=torch.int32),
    ]


def _equal(a: np.ndarray | torch.Tensor, b: torch.Tensor) -> bool:
    a = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_staged_tensors_arrive_as_put_in_one_copy():
    up = Uploads("cpu").begin()
    xs = _inputs()
    out = [up.put(x) for x in xs]
    assert up.copies == 0 and up.staged == len(xs) - 1         # the empty one: nothing to stage
    up.send()
    assert up.copies == 1 and up.bytes > 0
    assert all(_equal(x, t) for x, t in zip(xs, out, strict=True))
    # each a view into the one device buffer, aligned for any dtype
    assert len({t.untyped_storage().data_ptr() for t in out if t.numel()}) == 1
    assert all(t.data_ptr() % 64 == 0 for t in out if t.numel())


def test_a_read_before_the_copy_sees_the_poison():
    up = Uploads("cpu").begin()
    ints, floats = up.put(np.arange(4)), up.put(np.ones(3, dtype=np.float32))
    assert (ints == -1).all() and floats.isnan().all()
    up.send()
    assert torch.equal(ints, torch.arange(4)) and (floats == 1).all()
    up.begin()          # the next step, where the last one's values lie: never seen before its copy
    again, more = up.put(np.arange(10, 14)), up.put(np.arange(100, dtype=np.int32))
    assert (again == -1).all() and (more == -1).all()
    up.send()
    assert torch.equal(again, torch.arange(10, 14)) and torch.equal(more, torch.arange(100, dtype=torch.int32))


def test_queued_work_runs_after_the_copy_in_order():
    table = torch.full((8,), -1)
    seen = []
    up = Uploads("cpu").begin()
    at, values = up.put(np.array([1, 5])), up.put(np.array([10, 50]))
    up.then(lambda: table.index_copy_(0, at, values))
    up.then(lambda: seen.append(table.clone()))
    assert (table == -1).all() and not seen         # nothing ran before the copy
    up.send()
    assert table.tolist() == [-1, 10, -1, -1, -1, 50, -1, -1] and torch.equal(seen[0], table)
    up.send()                                       # a second send does nothing
    assert up.copies == 1 and len(seen) == 1


def test_after_the_copy_puts_are_copies_of_their_own():
    up = Uploads("cpu").begin()
    up.put(np.arange(3))
    up.send()
    late = up.put(np.arange(5, dtype=np.int32))
    assert torch.equal(late, torch.arange(5, dtype=torch.int32)) and up.copies == 2
    ran = []
    up.then(lambda: ran.append(1))                  # not open: at once
    assert ran == [1]


def test_a_step_past_the_buffer_takes_a_block_more_then_one_again():
    up = Uploads("cpu", capacity=256)
    up.begin()
    xs = [np.arange(20), np.arange(30), np.arange(40)]      # 160 + 240 + 320 bytes
    out = [up.put(x) for x in xs]
    up.send()
    assert up.copies == 3 and all(_equal(x, t) for x, t in zip(xs, out, strict=True))
    up.begin()
    out = [up.put(x) for x in xs]
    up.send()
    assert up.copies == 1 and all(_equal(x, t) for x, t in zip(xs, out, strict=True))


def test_a_kept_step_outlives_the_next_one_and_others_do_not():
    up = Uploads("cpu").begin()
    kept = up.put(np.arange(6))
    up.send()
    up.keep()
    up.begin()
    other = up.put(np.arange(100, 106))
    up.send()
    assert torch.equal(kept, torch.arange(6)) and torch.equal(other, torch.arange(100, 106))
    up.begin()                                      # `other`'s step's buffers are written again
    up.put(np.arange(200, 206))
    assert not torch.equal(other, torch.arange(100, 106))
    assert torch.equal(kept, torch.arange(6))


def test_parts_put_together_come_back_as_views_of_one_staged_tensor():
    up = Uploads("cpu").begin()
    parts = [torch.arange(5), torch.arange(6).view(2, 3), torch.zeros(0, dtype=torch.long), torch.tensor([7])]
    out = put_together(up.put, parts)
    assert up.staged == 1
    up.send()
    assert all(_equal(p, t) for p, t in zip(parts, out, strict=True))
    direct = put_together(lambda t: t.clone(), parts)        # any `put`: one call
    assert all(_equal(p, t) for p, t in zip(parts, direct, strict=True))
    with pytest.raises(ValueError, match="one dtype"):
        put_together(up.put, [torch.arange(2), torch.arange(2, dtype=torch.int32)])
