"""The blocking client: `Client` -> `Session` -> `Turn` (an iterator over one turn's events)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import grpc

from . import _build, _ready
from ._gen import chat_pb2, chat_pb2_grpc
from .errors import from_rpc_error
from .events import Event, Final, Metrics, from_proto
from .sampling import Sampling
from .session_info import ModelInfo, SessionInfo


class Client:
    """A connection to a Raincheck frontend. `tls`: None/False plaintext, True system roots, bytes PEM roots.

    `timeout_s`: the deadline of each unary call, retries included. `wait_ready`: wait (True: up to 60 s, or
    that many seconds) until the server says it can serve a turn before returning (`wait_ready()`).
    `retry`: retry opening a session, a session's status and the model list while the server answers
    UNAVAILABLE (starting, or between workers), within their deadline (raincheck_client/_ready.py)."""

    def __init__(self, address: str, api_key: str | None = None, tls: bool | bytes | None = None,
                 timeout_s: float | None = 30.0, wait_ready: bool | float | None = None, retry: bool = True):
        creds = _build.credentials(tls)
        options = _build.CHANNEL_OPTIONS + _ready.CHANNEL_OPTIONS
        self._channel = (grpc.secure_channel(address, creds, options) if creds
                         else grpc.insecure_channel(address, options))
        self._stub = chat_pb2_grpc.ChatServiceStub(self._channel)
        self._health = self._channel.unary_unary(_ready.HEALTH_CHECK, request_serializer=_ready.identity,
                                                 response_deserializer=_ready.identity)
        self._metadata = _build.metadata(api_key)
        self.address = address
        self.timeout_s = timeout_s          # for unary calls; turns stream without a deadline
        self.retry = retry
        if wait_ready:
            self.wait_ready(_ready.DEFAULT_READY_S if wait_ready is True else float(wait_ready))

    def wait_ready(self, timeout_s: float = _ready.DEFAULT_READY_S, progress: _ready.Progress | None = None) -> None:
        """Return once the server's gRPC health says SERVING (it can serve a turn now); `Unavailable` when it
        has not after `timeout_s`. `progress(why, waited_s)` is told at least every second while it waits."""
        wait = _ready.ReadyWait(self.address, timeout_s, progress)
        while True:
            try:
                reply, error = self._health(b"", timeout=wait.check_timeout(), wait_for_ready=True), None
            except grpc.RpcError as e:
                reply, error = None, e
            pause = wait.after(reply, error)
            if pause is None:
                return
            time.sleep(pause)

    def _call(self, method, request, retry: bool = False):
        """A unary call; with `retry` (and the client's), UNAVAILABLE is tried again within the deadline."""
        tries = _ready.CallTries(self.address, self.timeout_s, retry and self.retry)
        while True:
            try:
                return method(request, metadata=self._metadata, timeout=tries.timeout(),
                              wait_for_ready=tries.wait_for_ready)
            except grpc.RpcError as e:
                pause = tries.after(e, self._reachable() if tries.ask_reachable(e) else True)
            time.sleep(pause)

    def create_session(self, model: str = "", *, policy: str | None = None, selector: str | None = None,
                       retention: float | None = None, chunk_size: int | None = None,
                       guard: int | None = None, tpot_slo: float | None = None,
                       barrier_timeout_s: float | None = None,
                       recovery: str | None = None, deterministic: bool | None = None) -> Session:
        """A new session; unset settings take the server's defaults. `recovery`: colocated | disaggregated.
        `tpot_slo`: the allowed mean TPOT as a ratio of a plain decode step (0: none, fixed chunks).
        `barrier_timeout_s`: how long a turn waits for the previous turn's deferred rows (0: never; < 0: until
        they are all in). `deterministic`: the same answer for the same request, whatever else the server runs."""
        request = _build.create_session(model, recovery, policy=policy, selector=selector, retention=retention,
                                        chunk_size=chunk_size, guard=guard, tpot_slo=tpot_slo,
                                        barrier_timeout_s=barrier_timeout_s, deterministic=deterministic)
        return Session(self, SessionInfo.from_proto(self._call(self._stub.CreateSession, request, retry=True)))

    def session(self, session_id: str) -> Session:
        """An existing session (e.g. after a restart of this program)."""
        return Session(self, self._get(session_id))

    def _get(self, session_id: str) -> SessionInfo:
        reply = self._call(self._stub.GetSession, chat_pb2.GetSessionRequest(session_id=session_id), retry=True)
        return SessionInfo.from_proto(reply)

    def list_models(self) -> list[ModelInfo]:
        reply = self._call(self._stub.ListModels, chat_pb2.ListModelsRequest(), retry=True)
        return [ModelInfo.from_proto(m) for m in reply.models]

    def _reachable(self) -> bool:
        """The server answers at all now (its health, not waiting for a connection)."""
        try:
            self._health(b"", timeout=_ready.CHECK_S)
        except grpc.RpcError as e:
            return e.code() != grpc.StatusCode.UNAVAILABLE
        return True

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Session:
    def __init__(self, client: Client, info: SessionInfo):
        self.client = client
        self.id = info.session_id
        self.info = info                    # as of creation (or the last `status()`)

    def send(self, text: str = "", images: Sequence[_build.ImageSource] = (),
             videos: Sequence[Sequence[_build.ImageSource]] = (), *, max_new_tokens: int | None = None,
             temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
             seed: int | None = None, ignore_eos: bool = False, policy: dict | None = None,
             follow_recovery: bool = False, sampling: Sampling | None = None) -> Turn:
        """Start a turn: images are encoded bytes or file paths, videos lists of frames. `policy`
        overrides the session's deferral settings for this turn (keys as in `create_session`).
        With `follow_recovery` the stream continues after `Final` with `RecoveryProgress` events until
        the turn's deferred tokens are all prefilled."""
        request = _build.chat(self.id, text, images, videos, follow_recovery=follow_recovery, policy=policy,
                              max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              seed=seed, ignore_eos=ignore_eos, options=sampling)
        c = self.client
        return Turn(c._stub.Chat(request, metadata=c._metadata))

    def status(self) -> SessionInfo:
        self.info = self.client._get(self.id)
        return self.info

    def cancel(self) -> bool:
        """Stop the running turn; False when none was running."""
        c = self.client
        return c._call(c._stub.CancelTurn, chat_pb2.CancelTurnRequest(session_id=self.id)).cancelled

    def close(self) -> None:
        c = self.client
        c._call(c._stub.CloseSession, chat_pb2.CloseSessionRequest(session_id=self.id))


class Turn:
    """One turn's events, in order; iterate once. `text()` runs it to the end and returns the answer."""

    def __init__(self, call):
        self._call = call
        self.final: Final | None = None           # answer 0's (the one the session continues)
        self.metrics: Metrics | None = None
        self.finals: dict[int, Final] = {}        # every answer's, by choice (Sampling(n=...))

    def __iter__(self) -> Iterator[Event]:
        try:
            for message in self._call:
                event = from_proto(message)
                if isinstance(event, Final):
                    self.finals[event.choice] = event
                    self.final = self.finals.get(0)
                elif isinstance(event, Metrics) and not event.choice:
                    self.metrics = event
                yield event
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def result(self) -> Final:
        for _ in self:
            pass
        if self.final is None:
            raise RuntimeError("the turn's stream ended without a final event")
        return self.final

    def text(self) -> str:
        return self.result().text

    def cancel(self) -> None:
        """Stop reading: cancels the call (the server then cancels the turn)."""
        self._call.cancel()
