"""A request's sampling fields (OpenAI's and the declared extras) as the gRPC SamplingOptions, and its render
fields (vLLM's chat_template_kwargs, mm_processor_kwargs) as RenderOptions; the values themselves are the
engine's to judge (its InvalidInputError comes back as a 400)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from raincheck_client._gen import chat_pb2

from .errors import HttpError

_SCALARS = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "min_p", "min_tokens")
# vLLM's "off" values that the engine would refuse as out of range
_OFF = {"top_k": -1}
# mm_processor_kwargs this server takes, with their type
_PROCESSOR = {"min_pixels": int, "max_pixels": int, "fps": float}


def sampling_options(r: BaseModel, max_tokens: int | None, logprobs: bool, top_logprobs: int
                     ) -> chat_pb2.SamplingOptions:
    options = chat_pb2.SamplingOptions(max_new_tokens=max_tokens, ignore_eos=r.ignore_eos,
                                       logprobs=logprobs, top_logprobs=top_logprobs,
                                       stop_token_ids=r.stop_token_ids or [])
    for name in _SCALARS:
        value = getattr(r, name)
        if value is not None and value != _OFF.get(name):
            setattr(options, name, value)
    options.logit_bias.update(logit_bias(r.logit_bias or {}))
    if not r.skip_special_tokens:
        options.skip_special_tokens = False
        options.spaces_between_special_tokens = r.spaces_between_special_tokens
    return options


def render_options(r: BaseModel) -> chat_pb2.RenderOptions | None:
    """The request's chat_template_kwargs and mm_processor_kwargs (None: it sets neither). 400 naming an
    mm_processor_kwargs key this server does not take, or a value of the wrong type."""
    kwargs, processor = r.chat_template_kwargs or {}, r.mm_processor_kwargs or {}
    if not kwargs and not processor:
        return None
    render = chat_pb2.RenderOptions(template_kwargs_json=json.dumps(kwargs, sort_keys=True) if kwargs else "")
    for name, value in processor.items():
        kind = _PROCESSOR.get(name)
        if kind is None:
            raise HttpError.unsupported(f"mm_processor_kwargs.{name} is not supported: only "
                                        f"{', '.join(_PROCESSOR)} are", param=f"mm_processor_kwargs.{name}")
        if not _is(value, kind):
            raise HttpError.invalid(f"mm_processor_kwargs.{name} is a {kind.__name__}; got {value!r}",
                                    param=f"mm_processor_kwargs.{name}")
        setattr(render, name, value)
    return render


def _is(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, int) and -2**31 <= value < 2**31
    return isinstance(value, int | float)


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
