from . import chat_pb2 as _chat_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HistoryTurn(_message.Message):
    __slots__ = ("message", "answer_token_ids", "finish_reason")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ANSWER_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    message: _chat_pb2.UserMessage
    answer_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    def __init__(self, message: _Optional[_Union[_chat_pb2.UserMessage, _Mapping]] = ..., answer_token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "deferral", "recovery_mode", "history")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DEFERRAL_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_MODE_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    deferral: _chat_pb2.DeferralSettings
    recovery_mode: _chat_pb2.RecoveryMode
    history: _containers.RepeatedCompositeFieldContainer[HistoryTurn]
    def __init__(self, session_id: _Optional[str] = ..., deferral: _Optional[_Union[_chat_pb2.DeferralSettings, _Mapping]] = ..., recovery_mode: _Optional[_Union[_chat_pb2.RecoveryMode, str]] = ..., history: _Optional[_Iterable[_Union[HistoryTurn, _Mapping]]] = ...) -> None: ...

class TurnRequest(_message.Message):
    __slots__ = ("session_id", "turn_id", "message", "sampling", "deferral", "follow_recovery")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEFERRAL_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_RECOVERY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    turn_id: str
    message: _chat_pb2.UserMessage
    sampling: _chat_pb2.SamplingOptions
    deferral: _chat_pb2.DeferralSettings
    follow_recovery: bool
    def __init__(self, session_id: _Optional[str] = ..., turn_id: _Optional[str] = ..., message: _Optional[_Union[_chat_pb2.UserMessage, _Mapping]] = ..., sampling: _Optional[_Union[_chat_pb2.SamplingOptions, _Mapping]] = ..., deferral: _Optional[_Union[_chat_pb2.DeferralSettings, _Mapping]] = ..., follow_recovery: _Optional[bool] = ...) -> None: ...

class WorkerSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class WorkerSession(_message.Message):
    __slots__ = ("session_id", "status", "turns", "pending_deferred_tokens", "cached_tokens", "recovery_mode", "deferral")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    PENDING_DEFERRED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_MODE_FIELD_NUMBER: _ClassVar[int]
    DEFERRAL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    status: _chat_pb2.SessionStatus
    turns: int
    pending_deferred_tokens: int
    cached_tokens: int
    recovery_mode: _chat_pb2.RecoveryMode
    deferral: _chat_pb2.DeferralSettings
    def __init__(self, session_id: _Optional[str] = ..., status: _Optional[_Union[_chat_pb2.SessionStatus, str]] = ..., turns: _Optional[int] = ..., pending_deferred_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., recovery_mode: _Optional[_Union[_chat_pb2.RecoveryMode, str]] = ..., deferral: _Optional[_Union[_chat_pb2.DeferralSettings, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "model", "sessions", "active_turns", "deferred_pending_tokens", "total_pages", "free_pages", "page_size", "recovery_modes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TURNS_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_MODES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    sessions: int
    active_turns: int
    deferred_pending_tokens: int
    total_pages: int
    free_pages: int
    page_size: int
    recovery_modes: _containers.RepeatedScalarFieldContainer[_chat_pb2.RecoveryMode]
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., sessions: _Optional[int] = ..., active_turns: _Optional[int] = ..., deferred_pending_tokens: _Optional[int] = ..., total_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., recovery_modes: _Optional[_Iterable[_Union[_chat_pb2.RecoveryMode, str]]] = ...) -> None: ...
