from __future__ import annotations

import torch

from raincheck_core.sampling import Sampler, SamplingParams


def test_greedy_takes_argmax():
    logits = torch.tensor([0.1, 3.0, 2.0])
    assert Sampler(SamplingParams())(logits) == 1


def test_seed_makes_sampling_reproducible():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=7)
    s1, s2 = Sampler(params), Sampler(params)
    assert [s1(logits) for _ in range(20)] == [s2(logits) for _ in range(20)]


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([5.0, 4.9, 0.0, -1.0, -2.0])
    k = Sampler(SamplingParams(temperature=2.0, top_k=2, seed=0))
    assert {k(logits) for _ in range(200)} <= {0, 1}
    p = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=0))
    assert {p(logits) for _ in range(200)} == {0}     # token 0 alone holds over half the mass
