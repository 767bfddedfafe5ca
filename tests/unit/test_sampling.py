from __future__ import annotations

import math

import pytest
import torch

from raincheck_core.errors import InvalidInputError, SamplingError
from raincheck_core.sampling import Sampler, row_maxima
from raincheck_core.sampling_params import MIN_TEMPERATURE, MIN_TOP_P, SamplingParams


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


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(temperature=1e-40), "temperature must be 0 .greedy. or at least 1e-05, got 1e-40"),
    (dict(temperature=-1.0), "temperature must be 0"),
    (dict(temperature=math.nan), "temperature must be a finite number, got nan"),
    (dict(temperature=math.inf), "temperature must be a finite number, got inf"),
    (dict(temperature="0.7"), "temperature must be a finite number"),
    (dict(temperature=True), "temperature must be a finite number"),
    (dict(temperature=1.0, top_p=1e-300), r"top_p must be in \[1e-06, 1\], got 1e-300"),
    (dict(top_p=0.0), r"top_p must be in \[1e-06, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \[1e-06, 1\]"),
    (dict(top_p=-math.inf), "top_p must be a finite number"),
    (dict(top_p=math.nan), "top_p must be a finite number"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_k=2.5), "top_k must be an integer"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(max_new_tokens=8.0), "max_new_tokens must be an integer"),
    (dict(stop_token_ids=(3, -1)), "stop token ids must be >= 0"),
    (dict(n=0), r"n must be in \[1, 128\], got 0"),
    (dict(n=129), r"n must be in \[1, 128\], got 129"),
])
def test_unworkable_parameters_are_refused(kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        SamplingParams(**kwargs)


def test_smallest_accepted_values_sample_the_top_token():
    logits = torch.tensor([1e30, 3e30, -1e30, 2.9e30])      # huge logits, smallest temperature: no overflow
    for params in (SamplingParams(temperature=MIN_TEMPERATURE, seed=1),
                   SamplingParams(temperature=1.0, top_p=MIN_TOP_P, seed=1),
                   SamplingParams(temperature=1e30, top_p=MIN_TOP_P, seed=2**70),
                   SamplingParams(temperature=0.5, seed=-5)):
        sampler = Sampler(params)
        assert {sampler(logits) for _ in range(20)} == {1}
        assert sampler.fallback is None


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9, seed=0)])
def test_nan_logits_are_never_drawn(params):
    logits = torch.tensor([0.5, math.nan, 0.4, math.nan])
    sampler = Sampler(params)
    assert {sampler(logits) for _ in range(50)} <= {0, 2}
    assert sampler.fallback == "NaN logits left out"


def test_infinite_logits_fall_back_to_greedy():
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    assert sampler(torch.tensor([0.0, math.inf, 1.0, -math.inf])) == 1
    assert sampler.fallback == "+inf logits: greedy"
    assert sampler(torch.tensor([0.0, 2.0, -math.inf])) in (0, 1) and sampler.fallback is None


@pytest.mark.parametrize("logits", [[math.nan, math.nan], [-math.inf, -math.inf], [math.nan, -math.inf]])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=5, seed=0)])
def test_no_usable_logit_is_a_typed_error(logits, params):
    with pytest.raises(SamplingError, match="no usable logit"):
        Sampler(params)(torch.tensor(logits))


def test_a_steps_row_maxima_are_each_plain_greedy_draw():
    """One reduction over a step's logits gives what each row's own draw gives: the first largest logit
    on ties; a NaN or +inf row, a rule or logprobs send the row back to the sampler."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    logits[1, [3, 7]] = 9.0                     # a tie: the first index, as torch.argmax
    logits[2, 5] = float("nan")
    logits[3, 4] = float("inf")
    maxima = row_maxima(logits)
    plain = Sampler(SamplingParams())
    for row, maximum in zip(logits, maxima, strict=True):
        token = plain.from_maximum(maximum)
        assert token is None or token == plain(row)
    assert [plain.from_maximum(m) is None for m in maxima] == [False, False, True, True, False, False]
    assert maxima[1][1] == 3
    assert Sampler(SamplingParams(logprobs=True)).from_maximum(maxima[0]) is None
    assert Sampler(SamplingParams(repetition_penalty=1.2), context=[1]).from_maximum(maxima[0]) is None
    assert Sampler(SamplingParams(temperature=0.7)).from_maximum(maxima[0]) is None


def test_row_maxima_on_the_cpu_equal_torchs_reduction():
    """The CPU's vectorised path finds what torch's `max(dim=-1)` finds, bit for bit: first index on ties,
    NaN before anything, rows of -inf, several +inf, a strided view."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 300, generator=g).round(decimals=1)     # rounded: many ties
    logits[1, [4, 9]] = float("nan")
    logits[2] = float("-inf")
    logits[3, [2, 8]] = float("inf")
    logits[4, 5] = -0.0
    for case in (logits, logits[:, ::3], logits.t().contiguous().t(), logits.double()):
        values, indices = case.max(dim=-1)
        expected = list(zip(values.tolist(), indices.tolist(), strict=True))
        got = row_maxima(case)
        assert [i for _, i in got] == [i for _, i in expected]
        assert all(a == b or (math.isnan(a) and math.isnan(b)) for (a, _), (b, _) in zip(got, expected, strict=True))
