"""What a turn yields: token events as they are sampled, then one end event with the turn's metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TurnMetrics:
    prompt_tokens: int                 # this turn's input rows run now (I0), cached ones included
    generated_tokens: int
    ttft_s: float                      # turn submitted -> first token sampled
    tpot_s: float                      # mean time per output token after the first
    e2e_s: float                       # turn submitted -> last token sampled
    queue_s: float = 0.0               # waiting before the first row of the turn ran
    deferred_tokens: int = 0           # visual tokens of this turn's input deferred (D)
    deferred_pending: int = 0          # of those, still not prefilled when the answer ended
    tpot_restoring_s: float | None = None   # mean time per token over steps that carried a deferred chunk
    barrier_wait_s: float = 0.0        # this turn waited for the previous turn's recovery to complete
    previous_recovery_s: float | None = None  # the previous turn's post-answer completion time
    cached_prompt_tokens: int = 0      # of prompt_tokens, rows served from the prefix cache (not prefilled)
    previous_pending: int = 0          # earlier turns' deferred tokens still pending when this turn was
                                       # admitted (a bounded barrier): restored during and after its answer
    drafts_proposed: int = 0           # speculative decoding: draft tokens verified over the turn
    drafts_accepted: int = 0           # … and of them, accepted (each one a token without a step of its own)


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str                          # the new text this token completes ("" without a tokenizer)
    index: int                         # 0-based position among this turn's generated tokens
    logits: torch.Tensor | None = field(default=None, repr=False)   # [vocab] fp32 with return_logits
    logprob: float | None = None       # with SamplingParams.logprobs: log softmax of the model's logits
    top_logprobs: tuple[tuple[int, float], ...] = ()   # (token id, logprob), most likely first
    choice: int = 0                    # which answer of an `n > 1` turn (SamplingParams.n)


@dataclass(frozen=True)
class TurnEnd:
    finish_reason: str                 # "stop" | "length" | "cancelled"
    token_ids: list[int]
    text: str
    metrics: TurnMetrics
    choice: int = 0                    # which answer of an `n > 1` turn


TurnEvent = TokenEvent | TurnEnd
