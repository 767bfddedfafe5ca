"""A rank group's collectives after this process left the group (its engine closed by another thread, as a
decode worker does when a rank dies): a typed `RankFailedError`, which the services map to UNAVAILABLE,
not torch's bare ValueError."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from raincheck_core.errors import RankFailedError
from raincheck_core.parallel.group import RankGroup, collective


@pytest.fixture
def left_group() -> RankGroup:
    if dist.is_initialized():
        pytest.skip("this process is a rank of a group")
    return RankGroup(0, 2)


@pytest.mark.parametrize("call", [
    lambda g: g.all_reduce(torch.zeros(2)),
    lambda g: g.all_gather(torch.zeros(2), 0),
    lambda g: g.check_same(7, "the step's plan"),
    lambda g: g.shared(lambda: 1.0)(),
    lambda g: g.broadcast_object({"a": 1}),
    lambda g: g.gather_object(1),
])
def test_a_collective_after_leaving_the_group_is_a_rank_failure(left_group, call):
    with pytest.raises(RankFailedError, match="left the group"):
        call(left_group)


def test_a_communication_failure_is_a_rank_failure_and_a_callers_mistake_is_not(tmp_path):
    """Inside a live group, a ValueError is the caller's (bad arguments), not the ranks': it passes through."""
    with pytest.raises(RankFailedError, match="a check failed: connection reset"), collective("a check"):
        raise RuntimeError("connection reset by peer")
    if dist.is_initialized():
        pytest.skip("this process is a rank of a group")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="bad argument"), collective("a check"):
            raise ValueError("bad argument")
        t = torch.ones(2)
        RankGroup(0, 1).all_reduce(t)      # the live group still works
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
