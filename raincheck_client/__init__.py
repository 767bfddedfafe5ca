"""Raincheck Serve's client SDK: multi-turn image chat over gRPC. Needs only grpcio and protobuf.

    from raincheck_client import Client

    with Client("127.0.0.1:50051", api_key="...") as client:
        session = client.create_session(policy="raincheck")
        for event in session.send("what is this?", images=["scene.png"]):
            ...                      # Token, RecoveryProgress, Metrics, then Final
        print(session.send("and the blue one?").text())
        session.close()

`AsyncClient` is the same API for asyncio (`async for event in session.send(...)`).
"""

from .aio import AsyncClient, AsyncSession, AsyncTurn
from .errors import (
    Cancelled,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    RaincheckError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from .events import Event, Final, Metrics, RecoveryProgress, Token
from .sampling import Sampling
from .session_info import ModelInfo, SessionInfo
from .sync import Client, Session, Turn

__all__ = [
    "AsyncClient", "AsyncSession", "AsyncTurn", "Cancelled", "Client", "Event", "FailedPrecondition", "Final",
    "InvalidArgument", "Metrics", "ModelInfo", "NotFound", "PermissionDenied", "RaincheckError",
    "RecoveryProgress", "ResourceExhausted", "Sampling", "Session", "SessionInfo", "Token", "Turn", "Unauthenticated",
    "Unavailable",
]
