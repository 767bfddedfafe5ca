"""The engine core: the one owner of every state change of sessions, turns, recoveries and the pools.

It holds the scheduler, the model runner, the pools (reserved at start-up by engine/memory.py), the clock
and every session's cache; instrumentation hooks are engine/hooks.py's, the drafter's bookkeeping
engine/drafting.py's, and what sessions share through the prefix cache engine/prefix_sharing.py's.
A step is `plan = schedule(); out = run(resolve(plan)); settle(apply(plan, out))` (engine/step.py): the
core puts what the runner reads of the sessions into the plan (`resolve`), the update only reports what
ended (engine/update.py) and the core settles it here. Only the core admits, ends, fails and undoes a
turn, finishes or gives up a recovery, and forgets a session; a recovery's own transitions are its
methods (deferral/recovery.py), and it is reachable from its session's cache only. The facade
(engine/engine.py), the sessions and the stepper (engine/stepper.py, which drives the steps) call these
verbs under the engine lock.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from ..config import EngineConfig, ModelConfig
from ..deferral.gdn_join import GDNJoin
from ..deferral.handoff import ResidualResult
from ..deferral.recovery import Recovery
from ..errors import RankFailedError, SamplingError, StepFailedError
from ..models import DecoderLM
from ..multimodal.turn_input import TurnInput
from ..ops.backend import GDNOps, token_by_token
from ..ops.gdn_traffic import GDNTraffic
from ..speculative.drafter import Drafter
from .ahead import StepsAhead
from .cost_model import StepCostModel
from .drafting import Drafting
from .hooks import Hooks, StepStats
from .memory import reserve
from .mirror import Mirror, rank_clock
from .plan import StepPlan
from .prefix_sharing import publish, reuse_prefix
from .request import Admission, TurnRequest
from .resolve import resolve
from .runner import ModelRunner
from .scheduler import Scheduler
from .session_cache import Checkpoint, SessionCache
from .step_sessions import ScratchWork
from .update import StepResult

log = logging.getLogger(__name__)

# A post-answer recovery whose own chunk fails this many times is given up: its remaining deferred rows
# are dropped (the session continues as if they had been pruned) rather than blocking the next turn.
MAX_RECOVERY_FAILURES = 3

_scratch_ids = itertools.count(1)


class EngineCore:
    def __init__(self, model: DecoderLM, model_config: ModelConfig, config: EngineConfig,
                 drafter: Drafter | None = None, mirror: Mirror | None = None):
        """`drafter`: what proposes draft tokens when `config.speculative` is on (engine/drafting.py);
        `mirror`: this engine is rank 0 of worker ranks it started (engine/mirror.py)."""
        cfg = model_config
        self.config = config
        # rank 0 of worker ranks this engine started: its state-changing calls are replayed there
        self.mirror = mirror
        self.model = model
        self.model_config = cfg
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        # a tensor-parallel rank's pools hold only its heads
        memory = reserve(model.rank_config, config, self.device, self.dtype)
        self.kv, self.gdn, self.prefix = memory.kv, memory.gdn, memory.prefix
        self.drafting = Drafting(config.speculative, drafter, model_config.vocab_size)
        self.drafter = self.drafting.drafter      # what the update tells each step's rows (StepSessions)
        self.runner = ModelRunner(model, self.kv, self.gdn, cfg.linear_conv_kernel, config.backend)
        self.runner.keep_hidden = self.drafting.needs_hidden
        cut = self.gdn is not None and not token_by_token(self.runner.ops())
        self.scheduler = Scheduler(config.max_rows_per_step, config.deferred_budget, config.recovery_chunk,
                                   StepCostModel(), align=memory.align, cut_for_hits=cut,
                                   speculation=self.drafting.initial())
        # not yet at TP > 1: capturing the NCCL collectives of a step has not been run on a multi-GPU host
        if config.cuda_graphs and self.device.type == "cuda" and config.backend in ("auto", "flex", "fla") \
                and model.tp is None:
            self.runner.use_graphs(capture=True)      # engine/graphs.py; never on the CPU
        # every time the engine measures (step costs for the TPOT objective, turn metrics, recovery times)
        self.clock: Callable[[], float] = rank_clock(time.perf_counter, model.tp, mirror)
        self.audit_gdn_join = False       # keep every joined token's factors (tests, audits)
        self.caches: dict[str, SessionCache] = {}
        self.turns: dict[str, TurnRequest] = {}          # session -> its turn whose answer is streaming
        self.scratches: dict[str, ScratchWork] = {}      # scratch session -> its rows and their cursor
        self.handoffs: dict[str, ResidualResult] = {}    # session -> the result its hand-off step joins
        self.hooks = Hooks()
        self.recovery_serials = itertools.count(1)     # this engine's own: replicas count alike
        self.ahead = StepsAhead(self, mirror is None and model.tp is None)     # the next step, staged during one

    # ---------------------------------------------------------------- what the runner and update read
    def cache(self, session: str) -> SessionCache:
        return self.caches[session]

    def turn(self, session: str) -> TurnRequest | None:
        return self.turns.get(session)

    def scratch(self, session: str) -> ScratchWork | None:
        return self.scratches.get(session)

    def resolve(self, plan: StepPlan, gdn_ops: GDNOps) -> StepPlan:
        """`plan` with what its forward reads of the sessions put into its segments (engine/resolve.py)."""
        return resolve(plan, self, self.handoffs, gdn_ops)

    # ---------------------------------------------------------------- measuring and instrumentation
    def use_clock(self, clock: Callable[[], float]) -> None:
        """Measure with `clock` from now on (thread CPU time in a benchmark, a simulated clock in a test),
        with a fresh step-cost model: its samples must share one clock."""
        self.clock = rank_clock(clock, self.model.tp, self.mirror)
        self.scheduler.cost = StepCostModel()

    def replicate(self, op: str, *args: Any, required: bool = True) -> AbstractContextManager[None]:
        """The body is call `op(*args)` of the facade or a session: on rank 0 of worker ranks the engine
        started, sent to them first (engine/mirror.py `Mirror.call`; enter under the engine lock)."""
        return nullcontext() if self.mirror is None else self.mirror.call(op, *args, required=required)

    def stepped(self, plan: StepPlan, seconds: float, failed: bool, gdn_traffic: GDNTraffic | None = None) -> None:
        """A step ran: teach the TPOT objective (a step that did not fail) and tell the hooks."""
        if not failed:
            self.scheduler.account(plan, seconds, self.turn)
        if self.hooks.step:
            stats = StepStats.of(plan, seconds, failed, gdn_traffic)
            for hook in self.hooks.step:
                hook(stats)

    def speculate(self, num_tokens: int | None) -> None:
        """Up to `num_tokens` drafts per decode step from now on (None: none), by the engine's drafter."""
        self.scheduler.speculation = self.drafting.speculation(num_tokens)

    # ---------------------------------------------------------------- stepping
    def has_work(self) -> bool:
        """Work to step (none once the engine's ranks failed: a step would only raise)."""
        return self.scheduler.has_work() and (self.mirror is None or self.mirror.failure is None)

    def cancel(self, plan: StepPlan) -> None:
        """Drop a plan whose forward failed: the claimed slots go back to their sessions unfilled."""
        for sid in plan.sessions():
            self.caches[sid].cancel_claims()

    def settle(self, result: StepResult) -> None:
        """What a step's update found ended: failed turns are undone, ended turns' recoveries go on in
        the gaps, complete recoveries are finished."""
        for cache in result.grown:          # first: a failed turn's pages hold valid K/V all the same
            publish(self.prefix, self.kv, self.gdn, cache, cache.session in self.scratches)
        for req, logits in result.forked:   # before the parent's end: a branch copies its cache as it stands
            self.fork(req, logits)
        for req, error in result.failed:
            self.fail_turn(req, error)
        for req in result.ended:
            self.end_turn(req)
        for cache, rec in result.recovered:
            if cache.recovery is rec:       # not undone with a failed turn meanwhile
                self.finish_recovery(cache)

    # ---------------------------------------------------------------- sessions
    def open_cache(self, session: str, max_pages: int) -> SessionCache:
        cache = SessionCache(session, self.kv, self.gdn, max_pages)
        self.caches[session] = cache
        return cache

    def forget(self, session: str) -> None:
        """The session is closed: its pages and state slots go back to the pools."""
        cache = self.caches.pop(session, None)
        if cache is not None:
            self.scheduler.remove_recovering(cache)
            cache.release()
            self.drafting.release(session)

    @contextmanager
    def scratch_session(self, rows: TurnInput) -> Iterator[SessionCache]:
        """A session that exists for one forward or prefill outside any turn (a hand-off's residual, a
        session-free forward): `rows` are its rows; released on exit."""
        sid = f"scratch-{next(_scratch_ids)}"
        cache = self.open_cache(sid, self.kv.num_pages)
        work = self.scratches[sid] = ScratchWork(cache, rows)
        try:
            yield cache
        finally:
            self.scheduler.remove_scratch(work)
            del self.scratches[sid]
            self.forget(sid)

    def queue_scratch(self, cache: SessionCache) -> ScratchWork:
        """A scratch session's rows are planned from the next step on, beside the running turns' rows, until
        they are in or the scratch session ends (the stepper prefills them: `Stepper.prefill_scratch`)."""
        work = self.scratches[cache.session]
        self.scheduler.add_scratch(work)
        return work

    @contextmanager
    def handing_in(self, cache: SessionCache, result: ResidualResult) -> Iterator[None]:
        """`result`, a deferred worker's, is what the hand-off step of `cache`'s recovery joins (the
        stepper's `hand_in`), until the context ends."""
        self.handoffs[cache.session] = result
        try:
            yield
        finally:
            del self.handoffs[cache.session]

    # ---------------------------------------------------------------- turns
    @property
    def max_model_len(self) -> int | None:
        """Tokens a session may hold: `EngineConfig.max_model_len`, else the checkpoint's context length."""
        return self.config.max_model_len or self.model_config.max_position_embeddings

    def admit(self, admission: Admission) -> None:
        """A validated turn starts: its slots are reserved, its deferred rows (if any) become the cache's
        recovery, and the scheduler runs it from the next step. With `n > 1` answers (and no deferred
        rows), answer i's request is made here (`TurnRequest.branch`) on a new cache, whose pages for the
        answer are reserved now; they fork from this one when its prompt is in (`fork`). On an error (no
        pages, no GDN slot) the cache is as before and nothing was admitted."""
        request, deferred, cfg = admission.request, admission.deferred, admission.cfg
        cache = request.cache
        checkpoint = cache.checkpoint(self.runner.ops().gdn)     # the op set the steps run on
        context = cache.length + len(request.input)
        try:
            for i in range(1, request.params.n):
                # named by turn too: an earlier turn's answers may still be decoding
                sid = f"{cache.session}#{cache.turns}.{i}"
                child = request.branch(i, self.open_cache(sid, cache.table.max_pages), admission.constraints[i])
                request.branches.append(child)
                child.cache.table.reserve(context % self.kv.page_size + request.params.max_new_tokens)
            cache.table.reserve(admission.slots - reuse_prefix(self.prefix, self.kv.page_size, request))
            if deferred is not None:
                join = None
                if self.gdn is not None:
                    join = GDNJoin(self.gdn, cache.gdn_slot, self.model_config.linear_conv_kernel,
                                   keep_factors=self.audit_gdn_join)
                rec = Recovery(deferred, cfg, join, turn=cache.turns, serial=next(self.recovery_serials))
                # behind a previous turn's rows still pending (a bounded barrier): restored after them
                if cache.recovery is None:
                    cache.recovery = rec
                else:
                    cache.queued = rec
        except Exception:
            cache.restore(checkpoint)
            for child in request.branches:
                self.forget(child.cache.session)
            request.branches = []
            raise
        request.checkpoint = checkpoint
        request.turn = cache.turns
        cache.deterministic = cfg.deterministic
        cache.pending_ids = []
        cache.turns += 1
        self.turns[cache.session] = request
        self.scheduler.add(request)

    def end_turn(self, request: TurnRequest) -> None:
        """The answer is over (stop, length, cancel): what is left of D is recovered in the gaps."""
        cache = request.cache
        self._stop_running(request)
        if request.choice:       # an answer the session does not continue: its pages go back now
            self.forget(cache.session)
            return
        cache.pending_ids = request.tail()
        rec = cache.own_recovery(request.turn)
        if rec is not None and not rec.done:
            rec.mark_answer_done(self.clock())
        if cache.recovery is not None and cache.recovery.answer_done:
            self.scheduler.add_recovering(cache)

    def cancel_turn(self, request: TurnRequest) -> None:
        """Stop `request` (and its other answers) after the current step; it ends with finish_reason
        "cancelled"."""
        for req in (request, *request.branches):
            if not req.finished:
                req.finish("cancelled")
                self.end_turn(req)

    def fail_turn(self, request: TurnRequest, error: Exception) -> None:
        """`request` fails, and with it its other answers still running (n > 1; an other answer fails
        alone); its session is undone to the turn's admission (as if it never ran)."""
        for child in request.branches:
            self.fail_turn(child, error)
        if request.finished:
            return
        cache = request.cache
        self._stop_running(request)
        if request.choice:
            self.forget(cache.session)
            request.fail(error)
            return
        if request.checkpoint is not None:
            self._restore(cache, request.checkpoint)
        log.warning("turn %d failed and was undone: %s", request.id, error)
        request.fail(error)

    def fork(self, parent: TurnRequest, logits: torch.Tensor) -> None:
        """`parent`'s prompt is in and its first token drawn from `logits`: each other answer's cache forks
        from its cache (the prompt's pages shared, the GDN state copied), draws its own first token from
        the same logits and decodes from the next step, in the same steps as the others."""
        now = self.clock()
        for child in parent.branches:
            if child.finished:     # cancelled before the prompt was in
                continue
            child.cache.fork(parent.cache)
            child.forked(parent)
            try:
                token = child.sampler(logits)
            except Exception as e:   # this answer's sampling only
                self.fail_turn(child, e if isinstance(e, SamplingError) else SamplingError(f"sampling failed: {e}"))
                continue
            child.accept(token, logits, now, restoring=False)
            if child.finished:
                self.end_turn(child)
            else:
                self.turns[child.cache.session] = child
                self.scheduler.add(child)

    def _stop_running(self, request: TurnRequest) -> None:
        self.scheduler.remove(request)
        if self.turns.get(request.cache.session) is request:
            del self.turns[request.cache.session]

    def undo_ended_turn(self, request: TurnRequest, checkpoint: Checkpoint, error: Exception) -> None:
        """`request` ended but nobody read its end: put its session back as before it (its recovery, if
        any, is dropped) and mark it undone; its other answers still running fail."""
        for child in request.branches:
            self.fail_turn(child, error)
        self._restore(request.cache, checkpoint)
        request.error = error

    def _restore(self, cache: SessionCache, checkpoint: Checkpoint) -> None:
        """Undo a turn: the cache back to `checkpoint`; a previous turn's recovery pending then is pending
        again (docs/mechanism.md §10.4), and goes on in the gaps."""
        self.scheduler.remove_recovering(cache)
        cache.restore(checkpoint)
        self.drafting.rollback(cache.session, len(cache.tokens))
        if cache.recovery is not None:
            self.scheduler.add_recovering(cache)

    def step_failed(self, cache: SessionCache, error: Exception) -> None:
        """A step holding only `cache`'s rows failed: its running turn fails, or its recovery's chunk is
        retried, and the recovery given up after `MAX_RECOVERY_FAILURES`."""
        if isinstance(error, RankFailedError) and self.mirror is not None:
            self.mirror.fail(error)
        req = self.turns.get(cache.session)
        if req is not None:
            # a tensor-parallel rank that died is the server's fault, not the turn's: its own error says so
            self.fail_turn(req, error if isinstance(error, RankFailedError) else
                           StepFailedError(f"the forward pass running this turn failed: {error}"))
            return
        work = self.scratches.get(cache.session)
        if work is not None:
            work.error = error
            return
        rec = cache.recovery
        if rec is None:
            return
        rec.failures += 1
        if rec.failures < MAX_RECOVERY_FAILURES:
            log.error("a recovery chunk failed (%d of %d tries): %s", rec.failures, MAX_RECOVERY_FAILURES, error)
            return
        log.error("giving up a recovery after %d failed chunks; %d deferred tokens dropped: %s",
                  rec.failures, rec.pending, error)
        rec.give_up()
        self.finish_recovery(cache)

    # ---------------------------------------------------------------- recoveries
    def finish_recovery(self, cache: SessionCache) -> None:
        """The cache's recovery is complete (or given up): every slot is plain context from now on."""
        rec = cache.recovery
        for hook in self.hooks.recovery:
            hook(cache, rec)
        cache.end_recovery()
        self.scheduler.remove_recovering(cache)
        if cache.recovery is not None and cache.recovery.answer_done:   # a queued one is next
            self.scheduler.add_recovering(cache)

    def race_held(self, cache: SessionCache) -> None:
        """A barrier waits for `cache`'s recovery: if it is held for a deferred worker whose result is not
        back, it is recovered locally too (whichever ends first wins)."""
        rec = cache.recovery
        if rec.handed_off:
            log.info("a deferred worker's result is not back yet: recovering locally too")
            rec.race()

    def requeue_recovery(self, cache: SessionCache) -> None:
        """A barrier's step found none of `cache`'s deferred rows to run: its recovery is listed for the
        steps again."""
        self.scheduler.add_recovering(cache)
