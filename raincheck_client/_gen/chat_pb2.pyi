from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RecoveryMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECOVERY_MODE_UNSPECIFIED: _ClassVar[RecoveryMode]
    RECOVERY_MODE_COLOCATED: _ClassVar[RecoveryMode]
    RECOVERY_MODE_DISAGGREGATED: _ClassVar[RecoveryMode]

class SessionStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATUS_UNSPECIFIED: _ClassVar[SessionStatus]
    SESSION_STATUS_IDLE: _ClassVar[SessionStatus]
    SESSION_STATUS_STREAMING: _ClassVar[SessionStatus]
    SESSION_STATUS_RECOVERING: _ClassVar[SessionStatus]
    SESSION_STATUS_DETACHED: _ClassVar[SessionStatus]
RECOVERY_MODE_UNSPECIFIED: RecoveryMode
RECOVERY_MODE_COLOCATED: RecoveryMode
RECOVERY_MODE_DISAGGREGATED: RecoveryMode
SESSION_STATUS_UNSPECIFIED: SessionStatus
SESSION_STATUS_IDLE: SessionStatus
SESSION_STATUS_STREAMING: SessionStatus
SESSION_STATUS_RECOVERING: SessionStatus
SESSION_STATUS_DETACHED: SessionStatus

class DeferralSettings(_message.Message):
    __slots__ = ("policy", "selector", "retention", "chunk_size", "guard", "tpot_slo", "barrier_timeout_s", "deterministic")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SELECTOR_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    GUARD_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_FIELD_NUMBER: _ClassVar[int]
    BARRIER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    policy: str
    selector: str
    retention: float
    chunk_size: int
    guard: int
    tpot_slo: float
    barrier_timeout_s: float
    deterministic: bool
    def __init__(self, policy: _Optional[str] = ..., selector: _Optional[str] = ..., retention: _Optional[float] = ..., chunk_size: _Optional[int] = ..., guard: _Optional[int] = ..., tpot_slo: _Optional[float] = ..., barrier_timeout_s: _Optional[float] = ..., deterministic: _Optional[bool] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("model", "deferral", "recovery_mode")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEFERRAL_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_MODE_FIELD_NUMBER: _ClassVar[int]
    model: str
    deferral: DeferralSettings
    recovery_mode: RecoveryMode
    def __init__(self, model: _Optional[str] = ..., deferral: _Optional[_Union[DeferralSettings, _Mapping]] = ..., recovery_mode: _Optional[_Union[RecoveryMode, str]] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "model", "deferral", "recovery_mode", "status", "turns", "pending_deferred_tokens", "cached_tokens", "worker_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEFERRAL_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_MODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    PENDING_DEFERRED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    deferral: DeferralSettings
    recovery_mode: RecoveryMode
    status: SessionStatus
    turns: int
    pending_deferred_tokens: int
    cached_tokens: int
    worker_id: str
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., deferral: _Optional[_Union[DeferralSettings, _Mapping]] = ..., recovery_mode: _Optional[_Union[RecoveryMode, str]] = ..., status: _Optional[_Union[SessionStatus, str]] = ..., turns: _Optional[int] = ..., pending_deferred_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

class Video(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, frames: _Optional[_Iterable[bytes]] = ...) -> None: ...

class UserMessage(_message.Message):
    __slots__ = ("text", "images", "videos", "render")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    RENDER_FIELD_NUMBER: _ClassVar[int]
    text: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    videos: _containers.RepeatedCompositeFieldContainer[Video]
    render: RenderOptions
    def __init__(self, text: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ..., videos: _Optional[_Iterable[_Union[Video, _Mapping]]] = ..., render: _Optional[_Union[RenderOptions, _Mapping]] = ...) -> None: ...

class RenderOptions(_message.Message):
    __slots__ = ("template_kwargs_json", "min_pixels", "max_pixels", "fps")
    TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    template_kwargs_json: str
    min_pixels: int
    max_pixels: int
    fps: float
    def __init__(self, template_kwargs_json: _Optional[str] = ..., min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ..., fps: _Optional[float] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "stop_token_ids", "logit_bias", "logprobs", "top_logprobs", "grammar", "n", "skip_special_tokens", "spaces_between_special_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_new_tokens: int
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: bool
    top_logprobs: int
    grammar: str
    n: int
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., grammar: _Optional[str] = ..., n: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("session_id", "message", "sampling", "deferral", "follow_recovery")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEFERRAL_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_RECOVERY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    message: UserMessage
    sampling: SamplingOptions
    deferral: DeferralSettings
    follow_recovery: bool
    def __init__(self, session_id: _Optional[str] = ..., message: _Optional[_Union[UserMessage, _Mapping]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., deferral: _Optional[_Union[DeferralSettings, _Mapping]] = ..., follow_recovery: _Optional[bool] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_id", "text", "index", "logprob", "top_logprobs", "token", "choice")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    index: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    token: str
    choice: int
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., index: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., token: _Optional[str] = ..., choice: _Optional[int] = ...) -> None: ...

class TurnMetrics(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "ttft_s", "tpot_s", "e2e_s", "queue_s", "deferred_tokens", "deferred_pending", "tpot_restoring_s", "barrier_wait_s", "previous_recovery_s", "cached_prompt_tokens", "previous_pending", "drafts_proposed", "drafts_accepted", "choice")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_PENDING_FIELD_NUMBER: _ClassVar[int]
    TPOT_RESTORING_S_FIELD_NUMBER: _ClassVar[int]
    BARRIER_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_RECOVERY_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_PENDING_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float
    tpot_s: float
    e2e_s: float
    queue_s: float
    deferred_tokens: int
    deferred_pending: int
    tpot_restoring_s: float
    barrier_wait_s: float
    previous_recovery_s: float
    cached_prompt_tokens: int
    previous_pending: int
    drafts_proposed: int
    drafts_accepted: int
    choice: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., ttft_s: _Optional[float] = ..., tpot_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., deferred_tokens: _Optional[int] = ..., deferred_pending: _Optional[int] = ..., tpot_restoring_s: _Optional[float] = ..., barrier_wait_s: _Optional[float] = ..., previous_recovery_s: _Optional[float] = ..., cached_prompt_tokens: _Optional[int] = ..., previous_pending: _Optional[int] = ..., drafts_proposed: _Optional[int] = ..., drafts_accepted: _Optional[int] = ..., choice: _Optional[int] = ...) -> None: ...

class RecoveryProgress(_message.Message):
    __slots__ = ("pending_tokens", "complete", "elapsed_s")
    PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    pending_tokens: int
    complete: bool
    elapsed_s: float
    def __init__(self, pending_tokens: _Optional[int] = ..., complete: _Optional[bool] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class TurnFinal(_message.Message):
    __slots__ = ("finish_reason", "token_ids", "text", "choice")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    choice: int
    def __init__(self, finish_reason: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., choice: _Optional[int] = ...) -> None: ...

class ErrorEvent(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ChatEvent(_message.Message):
    __slots__ = ("turn_id", "token", "metrics", "recovery", "final", "error", "prompt")
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    turn_id: str
    token: TokenDelta
    metrics: TurnMetrics
    recovery: RecoveryProgress
    final: TurnFinal
    error: ErrorEvent
    prompt: PromptTokens
    def __init__(self, turn_id: _Optional[str] = ..., token: _Optional[_Union[TokenDelta, _Mapping]] = ..., metrics: _Optional[_Union[TurnMetrics, _Mapping]] = ..., recovery: _Optional[_Union[RecoveryProgress, _Mapping]] = ..., final: _Optional[_Union[TurnFinal, _Mapping]] = ..., error: _Optional[_Union[ErrorEvent, _Mapping]] = ..., prompt: _Optional[_Union[PromptTokens, _Mapping]] = ...) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("model", "text", "token_ids", "sampling", "echo", "prompt_logprobs", "messages_json", "tools_json", "continue_final_message", "images", "render", "add_generation_prompt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    RENDER_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingOptions
    echo: bool
    prompt_logprobs: int
    messages_json: str
    tools_json: str
    continue_final_message: bool
    images: _containers.RepeatedScalarFieldContainer[bytes]
    render: RenderOptions
    add_generation_prompt: bool
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., echo: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., messages_json: _Optional[str] = ..., tools_json: _Optional[str] = ..., continue_final_message: _Optional[bool] = ..., images: _Optional[_Iterable[bytes]] = ..., render: _Optional[_Union[RenderOptions, _Mapping]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class PromptTokens(_message.Message):
    __slots__ = ("tokens", "text")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenDelta]
    text: str
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenDelta, _Mapping]]] = ..., text: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "text", "add_special_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    add_special_tokens: bool
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "tokens", "max_model_len")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    max_model_len: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("model", "token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class TokenizerInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class TokenizerInfoResponse(_message.Message):
    __slots__ = ("info_json",)
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    info_json: str
    def __init__(self, info_json: _Optional[str] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CancelTurnRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CancelTurnResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "workers", "recovery_modes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_MODES_FIELD_NUMBER: _ClassVar[int]
    name: str
    workers: int
    recovery_modes: _containers.RepeatedScalarFieldContainer[RecoveryMode]
    def __init__(self, name: _Optional[str] = ..., workers: _Optional[int] = ..., recovery_modes: _Optional[_Iterable[_Union[RecoveryMode, str]]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...
