"""The local channel between a decode worker and its Ray driver process (bridge.py <-> driver.py).

A message is a JSON header and raw arrays, each sent as one frame on a socket pair, so nothing is
pickled between the two processes. In the header, a packed tensor (wire.py: `(dtype name, array)`)
stands as `{"$t": i, "dtype": name}` and a bare array as `{"$a": i}`, `i` indexing the arrays that
follow; the array list itself (numpy dtype and shape of each) rides in the header as `"$arrays"`.
"""

from __future__ import annotations

import json
import threading
from multiprocessing.connection import Connection
from typing import Any

import numpy as np


class Channel:
    """One end of the socket pair. `send` may be called from any thread; `recv` from one thread only."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._send_lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        arrays: list[np.ndarray] = []
        header = _encode(message, arrays)
        header["$arrays"] = [[a.dtype.str, list(a.shape)] for a in arrays]
        with self._send_lock:
            self.conn.send_bytes(json.dumps(header).encode())
            for a in arrays:
                self.conn.send_bytes(memoryview(np.ascontiguousarray(a)).cast("B"))

    def recv(self) -> dict[str, Any]:
        """The next message (arrays read-only, backed by the received bytes). EOFError when the other end
        has gone."""
        header = json.loads(self.conn.recv_bytes())
        arrays = [np.frombuffer(self.conn.recv_bytes(), dtype=np.dtype(dtype)).reshape(shape)
                  for dtype, shape in header.pop("$arrays")]
        return _decode(header, arrays)

    def close(self) -> None:
        self.conn.close()


def _encode(value: Any, arrays: list[np.ndarray]) -> Any:
    if isinstance(value, np.ndarray):
        arrays.append(value)
        return {"$a": len(arrays) - 1}
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], np.ndarray):
        arrays.append(value[1])
        return {"$t": len(arrays) - 1, "dtype": value[0]}
    if isinstance(value, dict):
        return {k: _encode(v, arrays) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode(v, arrays) for v in value]
    return value


def _decode(value: Any, arrays: list[np.ndarray]) -> Any:
    if isinstance(value, dict):
        if "$a" in value:
            return arrays[value["$a"]]
        if "$t" in value:
            return value["dtype"], arrays[value["$t"]]
        return {k: _decode(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    return value
