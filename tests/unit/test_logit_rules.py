"""The per-turn logit rules (bias, penalties, min_p, min_tokens) and logprobs of the sampler."""

from __future__ import annotations

import pytest
import torch

from raincheck_core.errors import InvalidInputError
from raincheck_core.sampling import Sampler
from raincheck_core.sampling_params import SamplingParams


def test_logit_bias_moves_the_greedy_choice():
    logits = torch.tensor([3.0, 1.0, 0.0])
    assert Sampler(SamplingParams(logit_bias=((2, 5.0),)))(logits) == 2
    assert Sampler(SamplingParams(logit_bias=((0, -100.0),)))(logits) == 1


def test_frequency_and_presence_penalties_count_generated_tokens():
    logits = torch.tensor([2.0, 1.5, 0.0])
    plain = Sampler(SamplingParams())
    assert [plain(logits) for _ in range(3)] == [0, 0, 0]
    freq = Sampler(SamplingParams(frequency_penalty=0.3))
    # token 0 loses 0.3 per time drawn: 2.0, 1.7, 1.4 < 1.5
    assert [freq(logits) for _ in range(4)] == [0, 0, 1, 0]
    presence = Sampler(SamplingParams(presence_penalty=2.0))    # once per token, however often drawn
    assert [presence(torch.tensor([2.0, 1.5, 0.5])) for _ in range(4)] == [0, 1, 2, 0]


def test_repetition_penalty_covers_the_turn_input():
    logits = torch.tensor([2.0, 1.5, -1.0])
    assert Sampler(SamplingParams(repetition_penalty=2.0), context=[0])(logits) == 1   # 2.0 / 2 < 1.5
    assert Sampler(SamplingParams(repetition_penalty=2.0), context=[2])(logits) == 0


def test_min_tokens_holds_back_stop_tokens():
    logits = torch.tensor([0.0, 5.0, 1.0])     # token 1 is the stop token and the most likely
    s = Sampler(SamplingParams(min_tokens=2), stop_ids={1})
    assert [s(logits) for _ in range(3)] == [2, 2, 1]


def test_min_p_drops_unlikely_tokens():
    logits = torch.tensor([5.0, 4.9, 0.0, -1.0])
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.5, seed=0))
    assert {s(logits) for _ in range(200)} == {0, 1}


def test_logprobs_are_the_models_log_softmax_whatever_the_rules():
    logits = torch.randn(40, generator=torch.Generator().manual_seed(1))
    s = Sampler(SamplingParams(logprobs=True, top_logprobs=5, logit_bias=((7, 50.0),)))
    token = s(logits)
    want = torch.log_softmax(logits, -1)
    assert token == 7
    assert abs(s.logprob - float(want[7])) <= 1e-6
    values, ids = torch.topk(want, 5)
    assert [t for t, _ in s.top_logprobs] == ids.tolist()
    assert torch.allclose(torch.tensor([v for _, v in s.top_logprobs]), values, atol=1e-6)


def test_rules_leave_other_samplers_alone():
    logits = torch.tensor([2.0, 1.0])
    biased, plain = Sampler(SamplingParams(logit_bias=((1, 10.0),))), Sampler(SamplingParams())
    assert (biased(logits), plain(logits)) == (1, 0)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(min_tokens=300), r"min_tokens must be in \[0, max_new_tokens=256\]"),
    (dict(logit_bias=((3, 101.0),)), r"logit_bias values must be in \[-100, 100\]"),
    (dict(logit_bias=((-1, 1.0),)), "logit_bias token ids must be >= 0"),
    (dict(logprobs=True, top_logprobs=21), r"top_logprobs must be in \[0, 20\]"),
    (dict(top_logprobs=2), "top_logprobs needs logprobs"),
])
def test_bad_rules_are_refused(kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        SamplingParams(**kwargs)


def test_a_grammar_leaves_the_answers_end_to_itself():
    with pytest.raises(InvalidInputError, match="a grammar decides where the answer ends"):
        SamplingParams(grammar="{}", min_tokens=3)
    with pytest.raises(InvalidInputError, match="a grammar decides where the answer ends"):
        SamplingParams(grammar="{}", ignore_eos=True)
