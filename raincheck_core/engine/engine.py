"""The Engine: one model on one device, a shared KV pool and GDN state pool, many sessions.

Work advances in steps (`step()`): each step runs one forward over the rows the scheduler picked
from every running turn. There is no engine thread: whoever waits for a turn's next event drives
the steps, under one lock, so embedded use needs no threads and concurrent callers share steps.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..cache.gdn_state import GDNStatePool
from ..cache.kv_pool import KVPool, PoolStats
from ..config import EngineConfig, ModelConfig
from ..deferral.handoff import Joined, ResidualPayload, ResidualResult
from ..deferral.policy import DeferralConfig
from ..errors import InvalidInputError, StepFailedError
from ..inputs import VisualInput
from ..models import DecoderLM, build_decoder
from ..models.loader import load_decoder_weights
from ..models.shipped import resolve_model_path
from ..multimodal.turn_input import TurnInput, build_turn_input
from ..pruning.settings import load_selector_options
from . import residual
from .cost_model import StepCostModel
from .engine_lock import EngineLock
from .plan import Kind, Segment, StepPlan
from .request import TurnRequest
from .runner import ModelRunner
from .scheduler import Scheduler
from .session import Session
from .session_cache import SessionCache
from .step import run_step

log = logging.getLogger(__name__)

# A post-answer recovery whose own chunk fails this many times is given up: its remaining deferred rows
# are dropped (the session continues as if they had been pruned) rather than blocking the next turn.
MAX_RECOVERY_FAILURES = 3


class Engine:
    def __init__(self, model: DecoderLM, model_config: ModelConfig, config: EngineConfig | None = None,
                 formatter=None, vision=None, selector_options: dict[str, dict] | None = None):
        self.config = config or EngineConfig()
        # the checkpoint's calibrated selector options ({selector: {option: value}}, selector_options.json)
        self.selector_options = dict(selector_options or {})
        # GDN decays drive states into subnormal floats, which run 10-70x slower on x86 CPUs; flushing
        # them changes nothing measurable. Set before the first multi-threaded op so workers inherit it.
        torch.set_flush_denormal(True)
        self.model_config = cfg = model_config
        self.model = model.eval()
        self.formatter = formatter        # multimodal.chat.ChatFormatter, or None (token-level input only)
        self.vision = vision              # multimodal.vision.VisionEncoder, or None
        self.device = torch.device(self.config.device)
        self.dtype = self.config.torch_dtype
        self.kv = KVPool(cfg.num_attention_layers, self.config.num_pages, self.config.page_size,
                         cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        self.gdn = None
        if cfg.num_gdn_layers:
            conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
                cfg.linear_num_value_heads * cfg.linear_value_head_dim
            self.gdn = GDNStatePool(self.config.max_gdn_slots, cfg.num_gdn_layers, conv_dim,
                                    cfg.linear_conv_kernel, cfg.linear_num_value_heads,
                                    cfg.linear_key_head_dim, cfg.linear_value_head_dim, self.dtype, self.device)
        self.cost = StepCostModel()
        self.scheduler = Scheduler(self.config.max_rows_per_step, self.config.deferred_budget,
                                   self.config.recovery_chunk, self.cost)
        self.runner = ModelRunner(self.model, self.kv, self.gdn, cfg.linear_conv_kernel)
        self.lock = EngineLock()         # step loops take it with for_step(): waiting callers go first
        self.sessions: dict[str, Session] = {}
        self.audit_gdn_join = False       # keep every joined token's factors (tests, audits)
        # every time the engine measures (step costs for the TPOT objective, turn metrics, recovery times);
        # a benchmark may swap in thread CPU time, a test a simulated clock
        self.clock: Callable[[], float] = time.perf_counter
        self._background: tuple[threading.Thread, threading.Event] | None = None
        self._drivers = 0                 # consumers inside drive(): the background stepper leaves steps to them
        self._drivers_lock = threading.Lock()
        self._wake = threading.Event()

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype: str = "float32",
                        **engine_options) -> Engine:
        """Load a Hugging Face-format folder (config.json + safetensors; tokenizer/processor if present)."""
        from ..multimodal.chat import ChatFormatter
        from ..multimodal.vision import VisionEncoder

        folder = resolve_model_path(path)
        config = EngineConfig(device=device, dtype=dtype, **engine_options)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model_config = ModelConfig.from_folder(folder)
        model = build_decoder(model_config).to(device=config.device, dtype=config.torch_dtype)
        others = load_decoder_weights(model, folder, model_config.tie_word_embeddings)
        vision = None
        if model_config.has_vision and any(k.startswith(("model.visual.", "visual.")) for k in others):
            vision = VisionEncoder.from_checkpoint(folder, model_config.raw, others, config.device,
                                                   config.torch_dtype)
        formatter = ChatFormatter.from_checkpoint(folder)
        log.info("loaded %s from %s (%s, %s)", model_config.family, folder, device, dtype)
        return cls(model, model_config, config, formatter=formatter, vision=vision,
                   selector_options=load_selector_options(folder))

    def deferral_for(self, cfg: DeferralConfig) -> DeferralConfig:
        """`cfg` with this model's calibrated options for its selector (the checkpoint's
        `selector_options.json`) when it names none itself; explicit options always win."""
        calibrated = self.selector_options.get(cfg.selector)
        if calibrated and not cfg.selector_options:
            return dataclasses.replace(cfg, selector_options=dict(calibrated))
        return cfg

    # ---------------------------------------------------------------- sessions
    def open_session(self, *, max_pages: int | None = None, session_id: str | None = None,
                     deferral: DeferralConfig | None = None) -> Session:
        """A new chat session; `deferral` is its policy (default `full`), overridable per turn."""
        limit = max_pages or self.config.max_pages_per_session
        with self.lock:
            if session_id is not None and session_id in self.sessions:
                raise InvalidInputError(f"a session with id {session_id!r} already exists")
            session = Session(self, SessionCache(self.kv, self.gdn, limit), session_id, deferral)
            self.sessions[session.id] = session
        return session

    def stop_token_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.formatter is not None:
            ids |= set(self.formatter.stop_token_ids)
        return ids

    def pool_stats(self) -> PoolStats:
        return self.kv.stats()

    # ---------------------------------------------------------------- stepping
    def step(self, only: SessionCache | None = None) -> bool:
        """One step over every running turn (and recoveries in the gaps; only `only`'s when given):
        engine/step.py. False when there was no work."""
        with self.lock.for_step():
            return run_step(self, only)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def drive(self, request: TurnRequest) -> None:
        """Step until `request` has an event to hand out or has ended. A consumer waits for the lock like
        any caller (not behind the background stepper, which would otherwise keep it through a whole
        post-answer recovery once the consumer's event was already there)."""
        with self._drivers_lock:
            self._drivers += 1
        try:
            while not request.events and not request.finished:
                with self.lock:
                    if not request.events and not request.finished:
                        self.step()
        finally:
            with self._drivers_lock:
                self._drivers -= 1

    def complete_recovery(self, cache: SessionCache) -> None:
        """Run `cache`'s deferred rows to the end (the completion barrier), in prefill-only chunks
        shared with whatever else is running."""
        while cache.recovery is not None:
            with self.lock:
                rec = cache.recovery
                if rec is None:
                    break
                if not rec.answer_done:       # the answer is still streaming: finish it first
                    self.step()
                    continue
                if rec.handed_off:            # the deferred worker's result is not back: recover here too
                    log.info("a deferred worker's result is not back yet: recovering locally too")
                    residual.race(rec)
                if not self.step(only=cache):
                    self.scheduler.add_recovering(cache)

    def start_background(self, after_step: Callable[[], None] | None = None, idle_wait_s: float = 0.02) -> None:
        """Step in a daemon thread whenever there is work nobody is waiting for — chiefly post-answer
        recovery in the gaps between turns; `after_step` runs after each step and each idle wait (the
        services observe recoveries there). Consumers keep driving their own turns as before."""
        if self._background is not None:
            return
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                stepped = False
                try:
                    # a consumer driving its turn steps for everyone: stepping too would only trade the
                    # lock back and forth
                    stepped = not self._drivers and self.has_work() and self.step()
                    if after_step is not None:
                        after_step()
                except Exception:   # keep stepping; a failing turn gets its error from the step
                    log.exception("background engine step failed")
                if not stepped:
                    self._wake.wait(idle_wait_s)
                    self._wake.clear()

        thread = threading.Thread(target=loop, name="raincheck-engine-steps", daemon=True)
        self._background = (thread, stop)
        thread.start()

    def wake(self) -> None:
        """Tell the background stepper there is work now (instead of at its next idle check)."""
        self._wake.set()

    def stop_background(self) -> None:
        if self._background is not None:
            thread, stop = self._background
            stop.set()
            self._wake.set()
            thread.join(timeout=10)
            self._background = None

    # ---------------------------------------------------------------- hand-off (docs/mechanism.md §8)
    def hold_residual(self, session: Session, *, fuse: bool = True) -> int | None:
        """Reserve the session's current recovery for a deferred worker: local gap recovery leaves it
        alone, and fused chunks during the answer run only with `fuse`. Returns the recovery's ticket (its
        turn index), or None when nothing is left."""
        with self.lock:
            rec = session.cache.recovery
            if rec is None or rec.done:
                return None
            rec.held, rec.fuse_held = True, fuse
            return rec.turn

    def export_residual(self, session: Session, ticket: int, have: torch.Tensor | None = None) -> ResidualPayload:
        """What the held recovery's remaining rows may see (every non-GEN slot's K/V, the GDN prefix state)
        and the rows, as soon as the turn's I0 is prefilled (before that, or once the recovery is not held
        or over: RecoveryStateError). `have`: positions in the session's cache of context rows the receiver
        already holds; they are not shipped."""
        with self.lock:
            return residual.export(self, session.cache, ticket, have)

    def prefill_residual(self, payload: ResidualPayload) -> ResidualResult:
        """Deferred-worker side: prefill the payload's rows on top of its context (a scratch cache)."""
        with self.lock:
            return residual.prefill(self, payload)

    def apply_residual(self, session: Session, ticket: int, result: ResidualResult) -> Joined | None:
        """Join a deferred worker's result: the rows it covers that are not restored yet (fused chunks may
        have restored some since the export); the recovery is complete. None, with nothing changed, while
        the answer streams and no chunk may join now (a policy without fused chunks, or the guard): call
        again later. RecoveryStateError (nothing applied) when the recovery named by `ticket` is no longer
        held (taken back, finished locally, an earlier turn's) or the result was made for another one."""
        with self.lock:
            return residual.apply(self, session.cache, ticket, result)

    def take_back(self, session: Session, ticket: int) -> bool:
        """The deferred worker failed or timed out: the engine recovers the rest locally (a recovery is
        never lost) and refuses a result that comes later. False when that recovery is no longer held."""
        with self.lock:
            rec = session.cache.recovery
            if rec is None or rec.turn != ticket or not rec.held:
                return False
            rec.held = rec.racing = False
            self.wake()
            return True

    # ---------------------------------------------------------------- the engine's own verbs
    def _turn_ended(self, req: TurnRequest) -> None:
        """The answer is over (stop, length, cancel): what is left of D is recovered in the gaps."""
        self.scheduler.remove(req)
        rec = req.recovery
        if rec is not None and req.cache.recovery is rec and not rec.done:
            rec.mark_answer_done(self.clock())
            self.scheduler.add_recovering(req.cache)

    def _recovery_done(self, cache: SessionCache) -> None:
        rec = cache.recovery
        rec.release()
        cache.clear_generated()
        cache.last_recovery_s = rec.completion_s
        cache.recovery = None
        self.scheduler.remove_recovering(cache)

    def _fail_turn(self, req: TurnRequest, error: Exception) -> None:
        """`req` fails alone; its session is undone to the turn's admission (as if it never ran)."""
        if req.finished:
            return
        self.scheduler.remove(req)
        if req.checkpoint is not None:
            self.scheduler.remove_recovering(req.cache)
            req.cache.restore(req.checkpoint)
        log.warning("turn %d failed and was undone: %s", req.id, error)
        req.fail(error)

    def _step_failed(self, cache: SessionCache, error: Exception) -> None:
        """A step holding only `cache`'s rows failed."""
        req = next((r for r in self.scheduler.running if r.cache is cache), None)
        if req is not None:
            self._fail_turn(req, StepFailedError(f"the forward pass running this turn failed: {error}"))
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
        rec.cursor = rec.total
        self._recovery_done(cache)

    def _forget(self, session: Session) -> None:
        with self.lock:
            self.sessions.pop(session.id, None)
            self.scheduler.remove_recovering(session.cache)
            session.cache.release()

    # ---------------------------------------------------------------- session-free forward
    def forward_logits(self, input_ids: torch.Tensor | None = None, *, inputs_embeds: torch.Tensor | None = None,
                       position_ids: torch.Tensor | None = None,
                       visual: list[VisualInput] | None = None) -> torch.Tensor:
        """Full-prefill logits `[T, vocab]` (fp32) of one sequence, outside any session.

        `input_ids [T]` (placeholders for `visual`, which are scattered in and get 3-D positions), or
        `inputs_embeds [T, d]`; `position_ids [T]` or `[3, T]` override the computed positions."""
        cfg = self.model_config
        if (input_ids is None) == (inputs_embeds is None):
            raise InvalidInputError("pass exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            rows = build_turn_input(self.model, cfg, _as_list(input_ids), list(visual or []), 0)
        else:
            if visual:
                raise InvalidInputError("visual inputs need input_ids with their placeholder tokens")
            embeds = inputs_embeds.to(device=self.device, dtype=self.dtype)
            if embeds.dim() != 2 or embeds.shape[1] != cfg.hidden_size:
                raise InvalidInputError(f"inputs_embeds must be [T, {cfg.hidden_size}], got {tuple(embeds.shape)}")
            t = embeds.shape[0]
            rows = TurnInput([0] * t, embeds, torch.arange(t).expand(3, -1), t, None,
                             torch.empty(0, dtype=torch.long), [])
        if position_ids is not None:
            rows.positions = _positions(position_ids, len(rows))
        with self.lock:
            cache = SessionCache(self.kv, self.gdn, self.kv.num_pages)
            try:
                n = len(rows)
                write = cache.claim(n)
                inputs = self.runner.prepare(StepPlan([Segment(Kind.RESIDUAL, cache, n, write, cache.readable(n),
                                                               cache.gdn_slot, source=rows)]))
                inputs.batch.logit_rows = None
                return self.runner.forward(inputs).logits
            finally:
                cache.release()


def _as_list(ids: torch.Tensor | list[int]) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise InvalidInputError(f"input_ids must be 1-D [T], got shape {tuple(ids.shape)}")
        return ids.tolist()
    return list(ids)


def _positions(position_ids: torch.Tensor, t: int) -> torch.Tensor:
    if position_ids.dim() == 1:
        position_ids = position_ids.expand(3, -1)
    if tuple(position_ids.shape) != (3, t):
        raise InvalidInputError(f"position_ids must be [T] or [3, T] with T={t}, got {tuple(position_ids.shape)}")
    return position_ids.long()


__all__ = ["Engine"]
