"""One turn in flight: its input rows, how far it has run, its sampler, and the events it has produced;
and a turn ready to be admitted (`Admission`).

A request changes only through the step's update (engine/update.py): `fed` after its rows ran, `accept`
after a token was sampled for it; and through the engine core (engine/core.py) when it ends: `finish`,
`fail`. It reads its session's cache but never changes it (its recovery is the cache's).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..deferral.policy import DeferralConfig
from ..grammar import TokenConstraint
from ..multimodal.detokenize import IncrementalText
from ..multimodal.turn_input import TurnInput
from ..sampling import Sampler
from ..sampling_params import SamplingParams
from .events import TokenEvent, TurnEnd, TurnEvent, TurnMetrics
from .session_cache import Checkpoint, SessionCache

_ids = itertools.count(1)


def answer_tail(token_ids: list[int], finish_reason: str, turn_end_id: int | None) -> list[int]:
    """What a transcript holds after an answer that the cache has not fed yet.

    The last sampled token was never fed; the next turn feeds it first, as one pass over the whole
    conversation would. A chat transcript closes every answer with the template's turn-end token,
    whatever stop token (or length limit) ended it; a cancelled answer keeps nothing unfed."""
    if not token_ids or finish_reason == "cancelled":
        return []
    last = token_ids[-1]
    if turn_end_id is None or last == turn_end_id:
        return [last]
    if finish_reason == "stop":
        return [turn_end_id]
    return [last, turn_end_id]


class TurnRequest:
    def __init__(
        self, *, cache: SessionCache, turn_input: TurnInput, params: SamplingParams, stop_ids: set[int],
        decode: Callable[[list[int]], str] | None = None, return_logits: bool = False,
        turn_end_id: int | None = None, deferred_tokens: int = 0, barrier_wait_s: float = 0.0,
        previous_recovery_s: float | None = None, previous_pending: int = 0, tpot_slo: float | None = None,
        clock: Callable[[], float] = time.perf_counter, constraint: TokenConstraint | None = None, choice: int = 0,
    ):
        self.id = next(_ids)
        self.turn = cache.turns           # the session's turn index (set again at admission)
        self.cache = cache
        self.input = turn_input
        self._input_rows = len(turn_input)    # `decoding` is asked several times per row and step
        self.params = params
        self.sampler = Sampler(params, turn_input.token_ids, stop_ids, constraint)
        self.stop_ids = stop_ids
        self.decode_text = decode
        self.return_logits = return_logits
        self.turn_end_id = turn_end_id    # the chat template's closing token, for chat-level turns
        self.deferred_tokens = deferred_tokens    # |D| of this turn (its recovery is the cache's)
        self.checkpoint: Checkpoint | None = None     # the cache at admission: a failed turn is undone to it
        self.barrier_wait_s = barrier_wait_s
        self.previous_recovery_s = previous_recovery_s
        self.previous_pending = previous_pending    # earlier turns' deferred rows still pending at admission
        self._restoring_gaps: list[float] = []
        self.cursor = 0                    # input rows already run
        self.cached_prompt_tokens = 0      # of them, served from the prefix cache (not run)
        self.generated: list[int] = []
        self.events: deque[TurnEvent] = deque()
        self.finished = False
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self._text = IncrementalText(decode) if decode is not None else None    # the streamed deltas
        # the TPOT objective (DeferralConfig.tpot_slo): this turn's decode steps as measured, and what the
        # same steps would have cost as plain decode steps (the scheduler's cost model)
        self.tpot_slo = tpot_slo
        self.decode_s = 0.0
        self.plain_s = 0.0
        self.clock = clock
        self.choice = choice               # which answer of an `n > 1` turn (0: the session's own)
        self.branches: list[TurnRequest] = []   # answers 1..n-1: forked from this one after the prompt
        self.t_submit = clock()
        self.t_start: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        # speculative decoding (docs/mechanism.md §13): draft tokens verified and accepted over the turn, and
        # the tokens its latest decode step emitted (the TPOT objective counts a step by them)
        self.drafts_proposed = 0
        self.drafts_accepted = 0
        self.drafts_tried = 0       # drafts a draw was compared with (after a rejection the rest are not)
        self.step_tokens = 0

    def branch(self, choice: int, cache: SessionCache, constraint: TokenConstraint | None) -> TurnRequest:
        """Answer `choice` of this `n > 1` turn, on its own `cache` (it forks from this one's after the
        prompt): the same input, stop tokens, text and objective; its own sampling parameters (`branch`)
        and grammar."""
        return TurnRequest(cache=cache, turn_input=self.input, params=self.params.branch(choice),
                           stop_ids=self.stop_ids, decode=self.decode_text, return_logits=self.return_logits,
                           turn_end_id=self.turn_end_id, tpot_slo=self.tpot_slo, clock=self.clock,
                           constraint=constraint, choice=choice)

    @property
    def decoding(self) -> bool:
        return self.cursor >= self._input_rows

    @property
    def input_remaining(self) -> int:
        return self._input_rows - self.cursor

    @property
    def boundaries(self) -> list[int]:
        return self.input.boundaries

    @property
    def answer_fed(self) -> int:
        """Generated tokens fed back so far (the last sampled one is not yet)."""
        return len(self.generated) - 1

    @property
    def last_token(self) -> int:
        return self.generated[-1]

    @property
    def draft_room(self) -> int:
        """Draft tokens a verify step may carry without emitting past `max_new_tokens` (it emits at most one
        token more than it has drafts)."""
        return self.params.max_new_tokens - len(self.generated) - 1

    def history(self) -> list[int]:
        """The session's token stream so far, every turn's input and answer, this turn's last sampled
        token included (it is not fed yet): what a drafter continues."""
        return [*self.cache.tokens, self.generated[-1]]

    def slack_s(self, plain_step_s: float) -> float:
        """Extra seconds the next decode step (a plain one costs `plain_step_s`) may cost with the turn's mean
        TPOT still within its objective: the slack saved by the steps so far."""
        return self.tpot_slo * (self.plain_s + plain_step_s) - self.decode_s - plain_step_s

    def charge(self, seconds: float, plain_step_s: float) -> None:
        """A decode step of this turn took `seconds`; a plain one would have taken `plain_step_s`."""
        self.decode_s += seconds
        self.plain_s += plain_step_s

    def skip_cached(self, n: int) -> None:
        """The first `n` input rows are in the session's cache already (the engine core found them in the
        prefix cache at admission)."""
        self.cursor = self.cached_prompt_tokens = n

    def forked(self, parent: TurnRequest) -> None:
        """This branch starts where `parent` stands after the prompt (its cache was forked from the
        parent's): every input row is in, and it shares the parent's times so far."""
        self.cursor = len(self.input)
        self.cached_prompt_tokens = parent.cached_prompt_tokens
        self.t_submit, self.t_start = parent.t_submit, parent.t_start

    def fed(self, n: int, now: float) -> None:
        """`n` rows of this turn ran: input rows, or the one row of the last sampled token."""
        if self.t_start is None:
            self.t_start = now
        if not self.decoding:
            self.cursor += n

    def drawn(self, maximum: tuple[float, int]) -> int | None:
        """The next token where `maximum` (its row's largest logit and index) is the whole draw: a plain greedy
        sampler's, on finite logits. None: `sample` draws it from the row. A sampler swapped for another
        callable is always called."""
        return self.sampler.from_maximum(maximum) if isinstance(self.sampler, Sampler) else None

    def sample(self, logits: torch.Tensor, maximum: tuple[float, int], draft: int | None = None) -> int:
        """The next token from this turn's row of the step's logits; `maximum`: the row's largest logit and
        its index (`drawn`); `draft`: the token a drafter proposed for this row (`Sampler.__call__`)."""
        token = self.drawn(maximum)
        if token is not None:
            return token
        return self.sampler(logits) if draft is None else self.sampler(logits, draft)

    def accept(self, token: int, logits: torch.Tensor | None, now: float, restoring: bool) -> None:
        """`token` was sampled from `logits [vocab]` (`restoring`: the step carried a deferred chunk; the
        logits are read only where the turn returns them, `return_logits`): emit its event, and end the turn
        on a stop token or the length limit."""
        if restoring and self.t_last is not None:
            self._restoring_gaps.append(now - self.t_last)
        self.t_first = self.t_first or now
        self.t_last = now
        self.generated.append(token)
        # its text is found when it is handed out (`text_of`): by the consumer, outside the step
        self.events.append(TokenEvent(token, "", len(self.generated) - 1,
                                      logits.clone() if self.return_logits else None,
                                      self.sampler.logprob, self.sampler.top_logprobs, self.choice))
        if token in self.stop_ids and not self.params.ignore_eos:
            self.finish("stop")
        elif len(self.generated) >= self.params.max_new_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        """The answer is over; the engine core settles what follows (engine/core.py `end_turn`)."""
        if self.finished:
            return
        self.finished = True
        self.finish_reason = reason
        self.checkpoint = None
        self.events.append(TurnEnd(reason, list(self.generated), self._full_text(), self.metrics(), self.choice))

    def tail(self) -> list[int]:
        """What the session's transcript holds of this ended answer that its cache has not fed."""
        return answer_tail(self.generated, self.finish_reason or "cancelled", self.turn_end_id)

    def fail(self, error: BaseException) -> None:
        self.finished = True
        self.error = error

    def metrics(self) -> TurnMetrics:
        end = self.t_last or self.clock()
        first = self.t_first or end
        n = len(self.generated)
        rec = self.cache.own_recovery(self.turn)
        gaps = self._restoring_gaps
        return TurnMetrics(
            prompt_tokens=len(self.input), generated_tokens=n, ttft_s=first - self.t_submit,
            tpot_s=(end - first) / (n - 1) if n > 1 else 0.0, e2e_s=end - self.t_submit,
            queue_s=(self.t_start or end) - self.t_submit,
            deferred_tokens=self.deferred_tokens, deferred_pending=rec.pending if rec is not None else 0,
            tpot_restoring_s=sum(gaps) / len(gaps) if gaps else None,
            barrier_wait_s=self.barrier_wait_s, previous_recovery_s=self.previous_recovery_s,
            cached_prompt_tokens=self.cached_prompt_tokens,
            previous_pending=self.previous_pending,
            drafts_proposed=self.drafts_proposed, drafts_accepted=self.drafts_accepted,
        )

    def _full_text(self) -> str:
        return self.decode_text(self.generated) if self.decode_text else ""

    def text_of(self, event: TokenEvent) -> TokenEvent:
        """`event`, this turn's, with the new text its token completes. Called as the events are handed out,
        in order (engine/session.py `TurnStream`): the detokenizing is the consumer's, outside the engine's
        step, which only appends tokens (and a late read of a long answer decodes a window, not the answer)."""
        if self._text is None:
            return event
        return replace(event, text=self._text.delta(self.generated, event.index + 1))


@dataclass
class Admission:
    """A validated turn, ready for the engine core to admit (`EngineCore.admit`; `Session.prepare_turn` makes
    it): answer 0's request and what admitting it takes. The core makes the other answers' requests."""

    request: TurnRequest                  # answer 0, the session's own
    deferred: TurnInput | None            # D, the rows restored after I0 (None: nothing deferred)
    cfg: DeferralConfig                   # the turn's deferral policy
    slots: int                            # reserved now: I0 + D + max_new_tokens (other answers' apart)
    constraints: list[TokenConstraint | None]   # every answer's grammar, by choice
