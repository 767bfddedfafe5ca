"""OpenAI's sampling fields for `Session.send(..., sampling=Sampling(...))`; None leaves a field off."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ._gen import chat_pb2


@dataclass(frozen=True)
class Sampling:
    presence_penalty: float | None = None     # [-2, 2]
    frequency_penalty: float | None = None    # [-2, 2]
    repetition_penalty: float | None = None   # > 0; 1 = none
    min_p: float | None = None                # [0, 1]
    min_tokens: int | None = None             # the stop tokens cannot end the answer before this many
    stop_token_ids: Sequence[int] = ()
    logit_bias: Mapping[int, float] = field(default_factory=dict)   # token id -> [-100, 100]
    logprobs: bool = False                    # each Token carries its logprob
    top_logprobs: int = 0                     # and the k most likely tokens' (0-20)
    grammar: str = ""                         # llguidance grammar text the answer must follow ("": none)
    n: int | None = None                      # answers sharing the prompt's prefill (events carry `choice`)

    def apply(self, options: chat_pb2.SamplingOptions) -> chat_pb2.SamplingOptions:
        """`options` with these fields set."""
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "n"):
            if getattr(self, name) is not None:
                setattr(options, name, getattr(self, name))
        options.stop_token_ids.extend(self.stop_token_ids)
        options.logit_bias.update(self.logit_bias)
        options.logprobs, options.top_logprobs, options.grammar = self.logprobs, self.top_logprobs, self.grammar
        return options
