"""The blocking client: `Client` -> `Session` -> `Turn` (an iterator over one turn's events)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from . import _build
from ._gen import chat_pb2, chat_pb2_grpc
from .errors import from_rpc_error
from .events import Event, Final, Metrics, from_proto
from .sampling import Sampling
from .session_info import ModelInfo, SessionInfo


class Client:
    """A connection to a Raincheck frontend. `tls`: None/False plaintext, True system roots, bytes PEM roots."""

    def __init__(self, address: str, api_key: str | None = None, tls: bool | bytes | None = None,
                 timeout_s: float | None = 30.0):
        creds = _build.credentials(tls)
        self._channel = (grpc.secure_channel(address, creds, _build.CHANNEL_OPTIONS) if creds
                         else grpc.insecure_channel(address, _build.CHANNEL_OPTIONS))
        self._stub = chat_pb2_grpc.ChatServiceStub(self._channel)
        self._metadata = _build.metadata(api_key)
        self.timeout_s = timeout_s          # for unary calls; turns stream without a deadline

    def _call(self, method, request):
        try:
            return method(request, metadata=self._metadata, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

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
        return Session(self, SessionInfo.from_proto(self._call(self._stub.CreateSession, request)))

    def session(self, session_id: str) -> Session:
        """An existing session (e.g. after a restart of this program)."""
        return Session(self, self._get(session_id))

    def _get(self, session_id: str) -> SessionInfo:
        reply = self._call(self._stub.GetSession, chat_pb2.GetSessionRequest(session_id=session_id))
        return SessionInfo.from_proto(reply)

    def list_models(self) -> list[ModelInfo]:
        reply = self._call(self._stub.ListModels, chat_pb2.ListModelsRequest())
        return [ModelInfo.from_proto(m) for m in reply.models]

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
