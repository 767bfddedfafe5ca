"""Prometheus metrics of the HTTP frontend (same registry and /metrics as the rest of the process)."""

from __future__ import annotations

from prometheus_client import Counter

SESSION_MATCHES = Counter(
    "raincheck:http_session_matches",
    "HTTP chat requests by how their history matched a session: continued (the session's next turn), forked "
    "(a new session that re-prefills the history), new (no history).", ["result"])
PROMPT_TOKENS = Counter(
    "raincheck:http_prompt_tokens",
    "Prompt tokens of HTTP chat requests: cached (the session already held them) or prefilled for the request.",
    ["source"])
