"""What a turn's sampling parameters do to its own row of logits before the draw.

Each turn's sampler owns one `LogitRules`, so a session's penalties, biases and `min_tokens` only ever
touch that session's row of a batched step. In order (OpenAI's and vLLM's meaning of each field):
`logit_bias` is added; `repetition_penalty` divides the positive logits and multiplies the negative ones
of every token seen in the turn's input or answer; `frequency_penalty` is subtracted once per time a token
was generated, `presence_penalty` once if it was; while fewer than `min_tokens` were generated, the stop
tokens cannot be drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .sampling_params import SamplingParams


class LogitRules:
    def __init__(self, params: SamplingParams, context: Sequence[int] = (), stop_ids: Sequence[int] = ()):
        self.params = params
        self.context = list(context)       # the turn's input tokens (the repetition penalty's "seen" set)
        self.stop_ids = sorted(stop_ids)
        self.generated = 0
        self._counts: torch.Tensor | None = None   # [vocab] times each token was generated
        self._seen: torch.Tensor | None = None     # [vocab] bool: in the context or generated

    @staticmethod
    def needed(params: SamplingParams) -> bool:
        return bool(params.logit_bias or params.presence_penalty or params.frequency_penalty
                    or params.repetition_penalty != 1.0 or params.min_tokens)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits [vocab]` fp32 with the rules applied (a new tensor)."""
        p = self.params
        out = logits.clone()
        vocab = out.numel()
        if self._counts is None:
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=out.device)
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=out.device)
            ids = torch.tensor([t for t in self.context if 0 <= t < vocab], dtype=torch.long, device=out.device)
            self._seen[ids] = True
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.long, device=out.device)
            bias = torch.tensor([b for t, b in p.logit_bias if t < vocab], dtype=out.dtype, device=out.device)
            out.index_add_(0, ids, bias)
        if p.repetition_penalty != 1.0:
            seen = out[self._seen]
            out[self._seen] = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        if p.frequency_penalty:
            out -= p.frequency_penalty * self._counts
        if p.presence_penalty:
            out -= p.presence_penalty * (self._counts > 0).to(out.dtype)
        if self.generated < p.min_tokens and self.stop_ids:
            ids = torch.tensor([t for t in self.stop_ids if t < vocab], dtype=torch.long, device=out.device)
            out[ids] = float("-inf")
        return out

    def record(self, token: int) -> None:
        """`token` was drawn."""
        self.generated += 1
        if self._counts is not None and 0 <= token < self._counts.numel():
            self._counts[token] += 1
            self._seen[token] = True


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log probability of `token` under `logits [vocab]` (the model's distribution, before any sampling
    rule), and the `top` most likely tokens with theirs."""
    logp = torch.log_softmax(logits.float().nan_to_num(nan=float("-inf")), dim=-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(logp, min(top, logp.numel()))
        alternatives = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return float(logp[token]), alternatives
