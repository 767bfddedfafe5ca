"""The asyncio client: `AsyncClient` -> `AsyncSession` -> `AsyncTurn` (an async iterator over events)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc
from grpc import aio

from . import _build
from ._gen import chat_pb2, chat_pb2_grpc
from .errors import from_rpc_error
from .events import Event, Final, Metrics, from_proto
from .sampling import Sampling
from .session_info import ModelInfo, SessionInfo


class AsyncClient:
    """As `Client`, for asyncio. Create it inside a running event loop."""

    def __init__(self, address: str, api_key: str | None = None, tls: bool | bytes | None = None,
                 timeout_s: float | None = 30.0):
        creds = _build.credentials(tls)
        self._channel = (aio.secure_channel(address, creds, _build.CHANNEL_OPTIONS) if creds
                         else aio.insecure_channel(address, _build.CHANNEL_OPTIONS))
        self._stub = chat_pb2_grpc.ChatServiceStub(self._channel)
        self._metadata = _build.metadata(api_key)
        self.timeout_s = timeout_s

    async def _call(self, method, request):
        try:
            return await method(request, metadata=self._metadata, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def create_session(self, model: str = "", *, policy: str | None = None, selector: str | None = None,
                             retention: float | None = None, chunk_size: int | None = None,
                             guard: int | None = None, tpot_slo: float | None = None,
                             barrier_timeout_s: float | None = None,
                             recovery: str | None = None, deterministic: bool | None = None) -> AsyncSession:
        request = _build.create_session(model, recovery, policy=policy, selector=selector, retention=retention,
                                        chunk_size=chunk_size, guard=guard, tpot_slo=tpot_slo,
                                        barrier_timeout_s=barrier_timeout_s, deterministic=deterministic)
        return AsyncSession(self, SessionInfo.from_proto(await self._call(self._stub.CreateSession, request)))

    async def session(self, session_id: str) -> AsyncSession:
        return AsyncSession(self, await self._get(session_id))

    async def _get(self, session_id: str) -> SessionInfo:
        reply = await self._call(self._stub.GetSession, chat_pb2.GetSessionRequest(session_id=session_id))
        return SessionInfo.from_proto(reply)

    async def list_models(self) -> list[ModelInfo]:
        reply = await self._call(self._stub.ListModels, chat_pb2.ListModelsRequest())
        return [ModelInfo.from_proto(m) for m in reply.models]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
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
