"""Structured logs: one JSON object per line, with the session and turn ids when there are any.

    log = bind(logging.getLogger(__name__), session_id=sid, turn_id=tid)
    log.info("turn started")   # {"ts": ..., "level": "INFO", ..., "session_id": sid, "turn_id": tid}
"""

from __future__ import annotations

import json
import logging
import sys
import time

CONTEXT_FIELDS = ("session_id", "turn_id", "worker_id", "service")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(level: str = "INFO", json_lines: bool = True) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def bind(logger: logging.Logger, **context: str) -> logging.LoggerAdapter:
    """A logger whose records carry `context` (session_id, turn_id, ...) as JSON fields."""
    return logging.LoggerAdapter(logger, context)
