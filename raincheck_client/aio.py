"""The asyncio client: `AsyncClient` -> `AsyncSession` -> `AsyncTurn` (an async iterator over events)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc
from grpc import aio

from . import _build, _ready
from ._gen import chat_pb2, chat_pb2_grpc
from .errors import from_rpc_error
from .events import Event, Final, Metrics, from_proto
from .sampling import Sampling
from .session_info import ModelInfo, SessionInfo


class AsyncClient:
    """As `Client`, for asyncio. Create it inside a running event loop. With `wait_ready`, the wait happens
    on entering `async with`, or before the first call."""

    def __init__(self, address: str, api_key: str | None = None, tls: bool | bytes | None = None,
                 timeout_s: float | None = 30.0, wait_ready: bool | float | None = None, retry: bool = True):
        creds = _build.credentials(tls)
        options = _build.CHANNEL_OPTIONS + _ready.CHANNEL_OPTIONS
        self._channel = (aio.secure_channel(address, creds, options) if creds
                         else aio.insecure_channel(address, options))
        self._stub = chat_pb2_grpc.ChatServiceStub(self._channel)
        self._health = self._channel.unary_unary(_ready.HEALTH_CHECK, request_serializer=_ready.identity,
                                                 response_deserializer=_ready.identity)
        self._metadata = _build.metadata(api_key)
        self.address = address
        self.timeout_s = timeout_s
        self.retry = retry
        self._ready_s = None if not wait_ready else _ready.DEFAULT_READY_S if wait_ready is True else float(wait_ready)

    async def wait_ready(self, timeout_s: float = _ready.DEFAULT_READY_S,
                         progress: _ready.Progress | None = None) -> None:
        """As `Client.wait_ready`."""
        wait = _ready.ReadyWait(self.address, timeout_s, progress)
        while True:
            try:
                reply, error = await self._health(b"", timeout=wait.check_timeout(), wait_for_ready=True), None
            except grpc.RpcError as e:
                reply, error = None, e
            pause = wait.after(reply, error)
            if pause is None:
                return
            await asyncio.sleep(pause)

    async def _when_ready(self) -> None:
        if self._ready_s is not None:
            ready_s, self._ready_s = self._ready_s, None
            await self.wait_ready(ready_s)

    async def _call(self, method, request, retry: bool = False):
        """As `Client._call`."""
        await self._when_ready()
        tries = _ready.CallTries(self.address, self.timeout_s, retry and self.retry)
        while True:
            try:
                return await method(request, metadata=self._metadata, timeout=tries.timeout(),
                                    wait_for_ready=tries.wait_for_ready)
            except grpc.RpcError as e:
                pause = tries.after(e, await self._reachable() if tries.ask_reachable(e) else True)
            await asyncio.sleep(pause)

    async def create_session(self, model: str = "", *, policy: str | None = None, selector: str | None = None,
                             retention: float | None = None, chunk_size: int | None = None,
                             guard: int | None = None, tpot_slo: float | None = None,
                             barrier_timeout_s: float | None = None,
                             recovery: str | None = None, deterministic: bool | None = None) -> AsyncSession:
        request = _build.create_session(model, recovery, policy=policy, selector=selector, retention=retention,
                                        chunk_size=chunk_size, guard=guard, tpot_slo=tpot_slo,
                                        barrier_timeout_s=barrier_timeout_s, deterministic=deterministic)
        return AsyncSession(self, SessionInfo.from_proto(await self._call(self._stub.CreateSession, request,
                                                                          retry=True)))

    async def session(self, session_id: str) -> AsyncSession:
        return AsyncSession(self, await self._get(session_id))

    async def _get(self, session_id: str) -> SessionInfo:
        reply = await self._call(self._stub.GetSession, chat_pb2.GetSessionRequest(session_id=session_id),
                                 retry=True)
        return SessionInfo.from_proto(reply)

    async def list_models(self) -> list[ModelInfo]:
        reply = await self._call(self._stub.ListModels, chat_pb2.ListModelsRequest(), retry=True)
        return [ModelInfo.from_proto(m) for m in reply.models]

    async def _reachable(self) -> bool:
        """As `Client._reachable`."""
        try:
            await self._health(b"", timeout=_ready.CHECK_S)
        except grpc.RpcError as e:
            return e.code() != grpc.StatusCode.UNAVAILABLE
        return True

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        await self._when_ready()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class AsyncSession:
    def __init__(self, client: AsyncClient, info: SessionInfo):
        self.client = client
        self.id = info.session_id
        self.info = info

    def send(self, text: str = "", images: Sequence[_build.ImageSource] = (),
             videos: Sequence[Sequence[_build.ImageSource]] = (), *, max_new_tokens: int | None = None,
             temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
             seed: int | None = None, ignore_eos: bool = False, policy: dict | None = None,
             follow_recovery: bool = False, sampling: Sampling | None = None) -> AsyncTurn:
        """As `Session.send`; iterate the result with `async for`."""
        request = _build.chat(self.id, text, images, videos, follow_recovery=follow_recovery, policy=policy,
                              max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              seed=seed, ignore_eos=ignore_eos, options=sampling)
        c = self.client
        return AsyncTurn(c._stub.Chat(request, metadata=c._metadata))

    async def status(self) -> SessionInfo:
        self.info = await self.client._get(self.id)
        return self.info

    async def cancel(self) -> bool:
        c = self.client
        return (await c._call(c._stub.CancelTurn, chat_pb2.CancelTurnRequest(session_id=self.id))).cancelled

    async def close(self) -> None:
        c = self.client
        await c._call(c._stub.CloseSession, chat_pb2.CloseSessionRequest(session_id=self.id))


class AsyncTurn:
    def __init__(self, call):
        self._call = call
        self.final: Final | None = None           # answer 0's (the one the session continues)
        self.metrics: Metrics | None = None
        self.finals: dict[int, Final] = {}        # every answer's, by choice (Sampling(n=...))

    async def __aiter__(self) -> AsyncIterator[Event]:
        try:
            async for message in self._call:
                event = from_proto(message)
                if isinstance(event, Final):
                    self.finals[event.choice] = event
                    self.final = self.finals.get(0)
                elif isinstance(event, Metrics) and not event.choice:
                    self.metrics = event
                yield event
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def result(self) -> Final:
        async for _ in self:
            pass
        if self.final is None:
            raise RuntimeError("the turn's stream ended without a final event")
        return self.final

    async def text(self) -> str:
        return (await self.result()).text

    def cancel(self) -> None:
        self._call.cancel()
