"""A deferred worker that takes its time: a hung or dying one, for the fall-back tests (a module of its
own, so that Ray workers import it without the test module)."""

from __future__ import annotations

import time

from services.common.settings import ModelSpec
from services.deferred_worker.actor import DeferredWorker


class SlowDeferredWorker(DeferredWorker):
    def __init__(self, spec: ModelSpec, delay_s: float):
        super().__init__(spec)
        self.delay_s = delay_s
        self.begun = 0

    def prefill(self, request: dict) -> dict:
        self.begun += 1
        time.sleep(self.delay_s)
        return super().prefill(request)

    def started(self) -> int:
        """Prefills begun (answers while one sleeps: the actor runs with max_concurrency > 1)."""
        return self.begun
