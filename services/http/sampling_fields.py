"""A request's sampling fields (OpenAI's and the declared extras) as the gRPC SamplingOptions; the
values themselves are the engine's to judge (its InvalidInputError comes back as a 400)."""

from __future__ import annotations

from pydantic import BaseModel

from raincheck_client._gen import chat_pb2

from .errors import HttpError

_SCALARS = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "min_p", "min_tokens")


def sampling_options(r: BaseModel, max_tokens: int | None, logprobs: bool, top_logprobs: int
                     ) -> chat_pb2.SamplingOptions:
    options = chat_pb2.SamplingOptions(max_new_tokens=max_tokens, ignore_eos=r.ignore_eos,
                                       logprobs=logprobs, top_logprobs=top_logprobs,
                                       stop_token_ids=r.stop_token_ids or [])
    for name in _SCALARS:
        if getattr(r, name) is not None:
            setattr(options, name, getattr(r, name))
    options.logit_bias.update(logit_bias(r.logit_bias or {}))
    return options


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """A request's stop strings (OpenAI's `stop`, SGLang's `sampling_params.stop`): one string, a list of
    them, or none."""
    if not stop:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's (and SGLang's) logit_bias keys are token ids written as strings."""
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise HttpError.invalid(f"logit_bias keys are token ids, got {key!r}", param="logit_bias") from None
    return out
