"""Chooses each step's rows under one row budget, with no prefill or decode phase (vLLM-style):
every running turn in decode gets its one row first, then turns still prefilling share what is
left, oldest first, each taking a chunk of its remaining input."""

from __future__ import annotations

from dataclasses import dataclass

from .request import TurnRequest


@dataclass(frozen=True)
class Work:
    request: TurnRequest
    rows: int


class Scheduler:
    def __init__(self, max_rows_per_step: int):
        self.max_rows = max_rows_per_step
        self.running: list[TurnRequest] = []

    def add(self, request: TurnRequest) -> None:
        self.running.append(request)

    def remove(self, request: TurnRequest) -> None:
        if request in self.running:
            self.running.remove(request)

    def has_work(self) -> bool:
        return bool(self.running)

    def schedule(self) -> list[Work]:
        budget = self.max_rows
        work: list[Work] = []
        for req in self.running:
            if req.decoding and budget > 0:
                work.append(Work(req, 1))
                budget -= 1
        for req in self.running:
            if not req.decoding and budget > 0:
                n = min(req.input_remaining, budget)
                work.append(Work(req, n))
                budget -= n
        return work
