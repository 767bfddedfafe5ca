"""Recovery payloads as numpy arrays (what crosses Ray's object store): every dtype round-trips exactly,
read-only arrays included, and unknown dtypes are refused."""

from __future__ import annotations

import pytest
import torch

from raincheck_core.deferral.handoff import ResidualPayload, ResidualResult
from services.deferred_worker.wire import pack, unpack


def _payload(dtype: torch.dtype) -> ResidualPayload:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(as_dtype)

    return ResidualPayload(
        context_k=rand(2, 5, 2, 4), context_v=rand(2, 5, 2, 4), context_index=torch.tensor([0, 1, 2, 5, 6]),
        visible=7, prefix_conv=rand(3, 3, 8),
        prefix_ssm=rand(3, 2, 4, 4, as_dtype=torch.float32), embeds=rand(6, 8),
        positions=torch.arange(18).reshape(3, 6), deepstack_index=torch.tensor([1, 4]),
        deepstack=[rand(2, 8) for _ in range(3)], recovery=12, first=3,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip(dtype):
    payload = _payload(dtype)
    wire = pack(payload)
    for _, array in [wire["embeds"], *wire["deepstack"]]:
        array.flags.writeable = False           # as Ray's object store hands them out
    back = unpack(ResidualPayload, wire, torch.device("cpu"))
    assert (back.visible, back.recovery, back.first) == (7, 12, 3)
    for name in ("context_k", "context_v", "context_index", "prefix_conv", "prefix_ssm", "embeds", "positions",
                 "deepstack_index"):
        assert getattr(back, name).dtype == getattr(payload, name).dtype
        assert torch.equal(getattr(back, name), getattr(payload, name)), name
    assert all(torch.equal(a, b) for a, b in zip(back.deepstack, payload.deepstack, strict=True))
    back.embeds += 1                            # a writable copy
    assert back.nbytes() == payload.nbytes()


def test_missing_gdn_parts_and_bad_dtypes():
    result = ResidualResult(torch.ones(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), None, None)
    back = unpack(ResidualResult, pack(result), torch.device("cpu"))
    assert back.ssm is None and back.conv is None and torch.equal(back.k, result.k)
    wire = pack(result)
    wire["k"] = ("complex64", wire["k"][1])
    with pytest.raises(ValueError, match="unexpected tensor dtype"):
        unpack(ResidualResult, wire, torch.device("cpu"))
