"""One turn in flight: its input rows, how far it has run, its sampler, and the events it has produced."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable

import torch

from ..deferral.recovery import Recovery
from ..sampling import Sampler, SamplingParams
from .events import TokenEvent, TurnEnd, TurnEvent, TurnMetrics
from .sequence import Sequence
from .turn_input import TurnInput

_ids = itertools.count(1)


class TurnRequest:
    def __init__(
        self, seq: Sequence, turn_input: TurnInput, params: SamplingParams, stop_ids: set[int],
        decode: Callable[[list[int]], str] | None, return_logits: bool, turn_end_id: int | None = None,
        recovery: Recovery | None = None, barrier_wait_s: float = 0.0, previous_recovery_s: float | None = None,
    ):
        self.id = next(_ids)
        self.seq = seq
        self.input = turn_input
        self.params = params
        self.sampler = Sampler(params)
        self.stop_ids = stop_ids
        self.decode_text = decode
        self.return_logits = return_logits
        self.turn_end_id = turn_end_id    # the chat template's closing token, for chat-level turns
        self.recovery = recovery          # this turn's deferred input D, if any
        self.barrier_wait_s = barrier_wait_s
        self.previous_recovery_s = previous_recovery_s
        self.restoring = False            # the current decode step carries a deferred chunk
        self._restoring_gaps: list[float] = []
        self.cursor = 0                    # input rows already run
        self.generated: list[int] = []
        self.events: deque[TurnEvent] = deque()
        self.finished = False
        self.error: BaseException | None = None
        self._text = ""
        self.t_submit = time.perf_counter()
        self.t_start: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None

    @property
    def decoding(self) -> bool:
        return self.cursor >= len(self.input)

    @property
    def input_remaining(self) -> int:
        return len(self.input) - self.cursor

    def mark_started(self) -> None:
        if self.t_start is None:
            self.t_start = time.perf_counter()

    def advance(self, n: int) -> None:
        """Record that `n` rows ran (input rows, or the one decode row)."""
        if self.decoding:
            self.seq.tokens.append(self.generated[-1])
            self.seq.next_position += 1
        else:
            self.seq.tokens.extend(self.input.token_ids[self.cursor:self.cursor + n])
            self.cursor += n
            if self.decoding:
                self.seq.next_position = self.input.next_position
                if self.recovery is not None and self.recovery.join is not None:
                    self.recovery.join.begin()

    @property
    def last_token(self) -> int:
        return self.generated[-1]

    def on_logits(self, logits: torch.Tensor) -> None:
        """Sample the next token from this step's logits `[vocab]` and emit its event(s)."""
        token = self.sampler(logits)
        now = time.perf_counter()
        if self.restoring and self.t_last is not None:
            self._restoring_gaps.append(now - self.t_last)
        self.t_first = self.t_first or now
        self.t_last = now
        self.generated.append(token)
        text = self._text_delta()
        self.events.append(TokenEvent(token, text, len(self.generated) - 1,
                                      logits.clone() if self.return_logits else None))
        if token in self.stop_ids and not self.params.ignore_eos:
            self.finish("stop")
        elif len(self.generated) >= self.params.max_new_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        if self.finished:
            return
        self.finished = True
        if self.generated and reason != "cancelled":
            # The last sampled token was never fed; the next turn feeds it first, as a single pass
            # over the whole conversation would. A chat transcript closes every answer with the
            # template's turn-end token, whatever stop token (or length limit) ended it.
            last = self.generated[-1]
            if self.turn_end_id is None or last == self.turn_end_id:
                self.seq.pending_ids = [last]
            elif reason == "stop":
                self.seq.pending_ids = [self.turn_end_id]
            else:
                self.seq.pending_ids = [last, self.turn_end_id]
        self.events.append(TurnEnd(reason, list(self.generated), self._full_text(), self.metrics()))

    def fail(self, error: BaseException) -> None:
        self.finished = True
        self.error = error

    def metrics(self) -> TurnMetrics:
        end = self.t_last or time.perf_counter()
        first = self.t_first or end
        n = len(self.generated)
        rec = self.recovery
        gaps = self._restoring_gaps
        return TurnMetrics(
            prompt_tokens=len(self.input), generated_tokens=n, ttft_s=first - self.t_submit,
            tpot_s=(end - first) / (n - 1) if n > 1 else 0.0, e2e_s=end - self.t_submit,
            queue_s=(self.t_start or end) - self.t_submit,
            deferred_tokens=rec.total if rec else 0, deferred_pending=rec.pending if rec else 0,
            tpot_restoring_s=sum(gaps) / len(gaps) if gaps else None,
            barrier_wait_s=self.barrier_wait_s, previous_recovery_s=self.previous_recovery_s,
        )

    def _full_text(self) -> str:
        return self.decode_text(self.generated) if self.decode_text else ""

    def _text_delta(self) -> str:
        if self.decode_text is None:
            return ""
        text = self._full_text()
        if text.endswith("\ufffd"):   # an incomplete UTF-8 sequence: wait for the next token
            return ""
        delta, self._text = text[len(self._text):], text
        return delta
