"""Prometheus metrics (prometheus-client's default registry) and the `/metrics` endpoint.

Latency metrics reuse the names vLLM and SGLang export (`*:time_to_first_token_seconds`, ...), labelled
by the service that observed them (the frontend sees what clients see; the decode worker sees the
engine). The deferral-specific ones are Raincheck's own.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram, start_http_server

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BYTES = tuple(float(2**k) for k in range(10, 34, 2))   # 1 KiB .. 8 GiB

TTFT = Histogram("raincheck:time_to_first_token_seconds", "Turn submitted to first token.", ["service"],
                 buckets=_LATENCY)
ITL = Histogram("raincheck:inter_token_latency_seconds", "Time between consecutive tokens of a turn.",
                ["service"], buckets=_LATENCY)
E2E = Histogram("raincheck:e2e_request_latency_seconds", "Turn submitted to its final event.", ["service"],
                buckets=_LATENCY)
REQUESTS = Counter("raincheck:requests", "RPCs handled, by method and status code.", ["service", "method", "code"])
DEFERRED_PENDING = Gauge("raincheck:deferred_tokens_pending",
                         "Deferred visual tokens not yet prefilled, over the worker's sessions.", ["worker"])
RECOVERY_LATENCY = Histogram("raincheck:recovery_latency_seconds",
                             "Answer end to the last deferred token prefilled (post-answer completion).",
                             ["mode"], buckets=_LATENCY)
RECOVERY_BYTES = Histogram("raincheck:recovery_bytes_shipped",
                           "Bytes shipped per recovery (KV pages + state deltas, both ways); 0 when colocated.",
                           ["mode"], buckets=(0.0, *_BYTES))
RECOVERY_FALLBACKS = Counter("raincheck:deferred_fallbacks",
                             "Disaggregated recoveries finished by the decode worker itself, by why the deferred "
                             "worker did not (timeout, worker_died, no_worker, error).", ["reason"])
BARRIER_WAIT = Histogram("raincheck:barrier_wait_seconds",
                         "Time a turn waited for its session's previous recovery to complete.", buckets=_LATENCY)
RECOVERY_UP = Gauge("raincheck:recovery_mode_up", "1 while the worker's recovery mode works as designed; 0 while it is "
                    "degraded (disaggregated without Ray: its recoveries finish locally).", ["worker", "mode"])
RESIDENT_MISSES = Counter("raincheck:deferred_resident_misses",
                          "Recoveries that relied on a deferred worker's copy of the session's context and shipped "
                          "the whole context after all, by why (none: evicted or a restarted actor; stale: another "
                          "copy; gone: the actor; busy: it stayed busy).", ["reason"])
DEFERRED_QUEUE = Gauge("raincheck:deferred_queue_depth", "Residuals waiting for a free deferred worker.", ["worker"])
DEFERRED_QUEUE_WAIT = Histogram("raincheck:deferred_queue_wait_seconds",
                                "Time a residual waited for a free deferred worker.", buckets=_LATENCY)
SESSIONS = Gauge("raincheck:sessions_active", "Open sessions on the worker.", ["worker"])
KV_USAGE = Gauge("raincheck:kv_cache_usage_perc", "Fraction of the worker's KV pages in use.", ["worker"])
DRAFT_TOKENS = Counter("raincheck:spec_decode_num_draft_tokens", "Draft tokens verified by speculative decoding.")
ACCEPTED_TOKENS = Counter("raincheck:spec_decode_num_accepted_tokens", "Draft tokens speculative decoding "
                          "accepted (each a token without a decode step of its own).")
PREFIX_HIT_TOKENS = Counter("raincheck:prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache "
                            "(shared KV pages) instead of prefilled.")
PREFIX_PAGES = Gauge("raincheck:prefix_cache_pages", "KV pages the prefix cache holds (shared or cache-only).",
                     ["worker"])
ENCODER_HITS = Counter("raincheck:encoder_cache_hits", "Images and videos served from the encoder cache instead "
                       "of the vision tower.")
ENCODER_BYTES = Gauge("raincheck:encoder_cache_bytes", "Memory the encoder cache holds.", ["worker"])
STEPS_AHEAD = Counter("raincheck:steps_planned_ahead", "Decode steps planned and staged during the previous step's "
                      "forward, by outcome: launched as staged, or dropped and planned again (docs/design.md).",
                      ["outcome"])
AHEAD_VOID_ROWS = Counter("raincheck:ahead_void_rows", "Decode rows of steps staged ahead whose turn ended "
                          "before the step ran: computed and dropped, the price of keeping the step.")
STEP_COST_DRIFT = Gauge("raincheck:step_cost_drift", "How far measured step costs stand from the calibration the "
                        "TPOT objective decides from (largest relative gap; docs/services.md, \"Deterministic "
                        "mode\").", ["worker"])


class TurnTimer:
    """Observes TTFT, inter-token latency and E2E of one turn as `service` sees it."""

    def __init__(self, service: str):
        self.service = service
        self.t0 = time.perf_counter()
        self.last: float | None = None

    def token(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            TTFT.labels(self.service).observe(now - self.t0)
        else:
            ITL.labels(self.service).observe(now - self.last)
        self.last = now

    def done(self) -> None:
        E2E.labels(self.service).observe(time.perf_counter() - self.t0)


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Start `/metrics` on host:port (0: any free port); returns the port."""
    server, _ = start_http_server(port, addr=host)
    return server.server_port
