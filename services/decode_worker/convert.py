"""Protobuf messages <-> engine objects, and engine errors -> gRPC status codes."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import grpc

from raincheck_client._gen import chat_pb2
from raincheck_core import (
    InvalidInputError,
    Message,
    OutOfPagesError,
    RaincheckError,
    RenderOptions,
    SamplingParams,
    SessionBusyError,
    SessionClosedError,
    TokenEvent,
    TurnEnd,
    TurnMetrics,
)
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.errors import RankFailedError

from ..common.grpc_util import MESSAGE_CHARS, shown
from ..common.recovery_modes import MODE_NAMES

_STATUS: list[tuple[type[RaincheckError], grpc.StatusCode]] = [
    (InvalidInputError, grpc.StatusCode.INVALID_ARGUMENT),
    (OutOfPagesError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (SessionBusyError, grpc.StatusCode.FAILED_PRECONDITION),
    (SessionClosedError, grpc.StatusCode.NOT_FOUND),
    # a tensor-parallel rank died: the worker cannot serve (it reports NOT_SERVING); another one can
    (RankFailedError, grpc.StatusCode.UNAVAILABLE),
]


def status_for(error: BaseException) -> grpc.StatusCode:
    for cls, code in _STATUS:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


def to_message(m: chat_pb2.UserMessage) -> Message:
    return Message(text=m.text, images=[bytes(i) for i in m.images],
                   videos=[[bytes(f) for f in v.frames] for v in m.videos], render=to_render(m.render))


def to_render(r: chat_pb2.RenderOptions) -> RenderOptions:
    """The message's render options (the formatter checks their values)."""
    kwargs = {}
    if r.template_kwargs_json:
        try:
            kwargs = json.loads(r.template_kwargs_json)
        except json.JSONDecodeError as e:
            raise InvalidInputError(f"chat_template_kwargs is not JSON: {e}") from None
    return RenderOptions(template_kwargs=kwargs, min_pixels=r.min_pixels if r.HasField("min_pixels") else None,
                         max_pixels=r.max_pixels if r.HasField("max_pixels") else None,
                         fps=r.fps if r.HasField("fps") else None)


_OPTIONAL = ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "min_p", "min_tokens", "n")


def to_sampling(o: chat_pb2.SamplingOptions, default_max_new_tokens: int) -> SamplingParams:
    kw = {name: getattr(o, name) for name in _OPTIONAL if o.HasField(name)}
    kw.setdefault("max_new_tokens", default_max_new_tokens)
    return SamplingParams(ignore_eos=o.ignore_eos, stop_token_ids=tuple(o.stop_token_ids),
                          logit_bias=tuple(sorted(o.logit_bias.items())), logprobs=o.logprobs,
                          top_logprobs=o.top_logprobs, grammar=o.grammar or None, **kw)


def token_delta(event: TokenEvent, decode: Callable[[list[int]], str] | None) -> chat_pb2.TokenDelta:
    """A TokenEvent as sent; with logprobs, the tokens decoded alone (`decode`: the checkpoint's)."""
    delta = chat_pb2.TokenDelta(token_id=event.token_id, text=event.text, index=event.index, choice=event.choice)
    if event.logprob is None:
        return delta
    piece = decode or (lambda ids: "")
    delta.logprob, delta.token = event.logprob, piece([event.token_id])
    delta.top_logprobs.extend(chat_pb2.TokenLogprob(token_id=t, logprob=lp, token=piece([t]))
                              for t, lp in event.top_logprobs)
    return delta


def to_deferral(s: chat_pb2.DeferralSettings, base: DeferralConfig) -> DeferralConfig:
    """`base` with the fields `s` sets (validated: InvalidInputError when out of range)."""
    kw = {name: getattr(s, name) for name in ("policy", "selector") if getattr(s, name)}
    kw |= {name: getattr(s, name) for name in ("retention", "chunk_size", "guard") if s.HasField(name)}
    if s.HasField("tpot_slo"):
        kw["tpot_slo"] = s.tpot_slo or None   # 0: no objective
    if s.HasField("barrier_timeout_s"):     # < 0: no bound (wait for the previous turn's rows)
        kw["barrier_timeout_s"] = s.barrier_timeout_s if s.barrier_timeout_s >= 0 else None
    if s.HasField("deterministic"):
        kw["deterministic"] = s.deterministic
    return dataclasses.replace(base, **kw) if kw else base


def from_deferral(cfg: DeferralConfig) -> chat_pb2.DeferralSettings:
    return chat_pb2.DeferralSettings(policy=cfg.policy, selector=cfg.selector, retention=cfg.retention,
                                     chunk_size=cfg.chunk_size, guard=cfg.guard, tpot_slo=cfg.tpot_slo or 0.0,
                                     barrier_timeout_s=-1.0 if cfg.barrier_timeout_s is None else cfg.barrier_timeout_s,
                                     deterministic=cfg.deterministic)


def to_mode(mode: int) -> str:
    """A RecoveryMode value's name; UNSPECIFIED is colocated."""
    if mode == chat_pb2.RECOVERY_MODE_UNSPECIFIED:
        return "colocated"
    if mode not in MODE_NAMES:
        raise InvalidInputError(f"unknown recovery mode {mode}")
    return MODE_NAMES[mode]


def metrics_event(turn_id: str, m: TurnMetrics, choice: int = 0) -> chat_pb2.ChatEvent:
    return chat_pb2.ChatEvent(turn_id=turn_id, metrics=chat_pb2.TurnMetrics(
        choice=choice,
        prompt_tokens=m.prompt_tokens, generated_tokens=m.generated_tokens, ttft_s=m.ttft_s, tpot_s=m.tpot_s,
        e2e_s=m.e2e_s, queue_s=m.queue_s, deferred_tokens=m.deferred_tokens, deferred_pending=m.deferred_pending,
        tpot_restoring_s=m.tpot_restoring_s, barrier_wait_s=m.barrier_wait_s,
        previous_recovery_s=m.previous_recovery_s, cached_prompt_tokens=m.cached_prompt_tokens,
        previous_pending=m.previous_pending, drafts_proposed=m.drafts_proposed, drafts_accepted=m.drafts_accepted,
    ))


def final_event(turn_id: str, end: TurnEnd) -> chat_pb2.ChatEvent:
    return chat_pb2.ChatEvent(turn_id=turn_id, final=chat_pb2.TurnFinal(
        finish_reason=end.finish_reason, token_ids=end.token_ids, text=end.text, choice=end.choice))


def progress_event(turn_id: str, pending: int, elapsed_s: float = 0.0) -> chat_pb2.ChatEvent:
    return chat_pb2.ChatEvent(turn_id=turn_id, recovery=chat_pb2.RecoveryProgress(
        pending_tokens=pending, complete=pending == 0, elapsed_s=elapsed_s))


def error_event(turn_id: str, error: BaseException) -> chat_pb2.ChatEvent:
    return chat_pb2.ChatEvent(turn_id=turn_id, error=chat_pb2.ErrorEvent(
        code=status_for(error).name, message=shown(str(error) or type(error).__name__, MESSAGE_CHARS)))
