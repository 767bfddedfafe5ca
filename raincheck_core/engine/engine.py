"""The Engine facade: one model on one device, a shared KV pool and GDN state pool, many sessions.

It loads a checkpoint, opens sessions, runs session-free forwards, and offers the hand-off verbs. The
state it serves lives in the engine core (engine/core.py), which owns every transition; the steps are
driven by whoever waits for a turn's next event, or by the background stepper (engine/stepper.py),
under one lock (engine/engine_lock.py). No module of the engine package imports this one.
"""

from __future__ import annotations

import atexit
import dataclasses
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..cache.gdn_state import GDNStatePool
from ..cache.kv_pool import KVPool, PoolStats
from ..cache.prefix import PrefixStats
from ..config import EngineConfig, ModelConfig
from ..deferral.handoff import Joined, ResidualPayload, ResidualResult
from ..deferral.policy import DeferralConfig
from ..errors import InvalidInputError
from ..grammar import Grammars
from ..inputs import Message, Prompt, VisualInput
from ..models import DecoderLM
from ..multimodal.encoder_cache import EncoderCache, EncoderCacheStats
from ..multimodal.turn_input import MessageMarks
from ..parallel.group import RankGroup
from ..parallel.workers import WorkerRanks
from ..speculative.drafter import Drafter
from .core import EngineCore
from .engine_lock import EngineLock
from .forward_logits import scratch_logits, sequence_rows
from .handoff_verbs import HandOffVerbs
from .instruments import EngineInstruments
from .mirror import Mirror, replay_commands
from .pretrained import load_pretrained
from .scheduler import Scheduler
from .session import Session, TurnStream
from .session_cache import SessionCache
from .stepper import Stepper


class Engine(EngineInstruments):
    def __init__(self, model: DecoderLM, model_config: ModelConfig, config: EngineConfig | None = None,
                 formatter=None, vision=None, selector_options: dict[str, dict] | None = None,
                 drafter: Drafter | None = None, ranks: WorkerRanks | None = None):
        self.config = config or EngineConfig()
        # the worker ranks this engine started (from_pretrained at tensor_parallel_size > 1); None: it runs
        # alone, or it is one of ranks the caller started, each making the same calls
        self.ranks = ranks
        # rank 0 or a replica of ranks an engine started (engine/mirror.py): its hand-offs carry whole heads
        self.replicated = ranks is not None
        # the checkpoint's calibrated selector options ({selector: {option: value}}, selector_options.json)
        self.selector_options = dict(selector_options or {})
        # GDN decays drive states into subnormal floats, which run 10-70x slower on x86 CPUs; flushing
        # them changes nothing measurable. Set before the first multi-threaded op so workers inherit it.
        torch.set_flush_denormal(True)
        self.model_config = model_config
        self.model = model.eval()
        self.formatter = formatter        # multimodal.chat.ChatFormatter, or None (token-level input only)
        self.vision = vision              # multimodal.vision.VisionEncoder, or None
        # what says where a prompt's messages and visuals end (the prefix cache's GDN checkpoints go there)
        self.marks = formatter.message_marks(model_config.vision_end_token_id) if formatter is not None \
            else MessageMarks(model_config.vision_end_token_id)
        self.grammars = Grammars(formatter.tokenizer if formatter is not None else None, model_config.vocab_size)
        if vision is not None and self.config.encoder_cache_bytes:
            vision.cache = EncoderCache(self.config.encoder_cache_bytes)
        self.core = EngineCore(self.model, model_config, self.config, drafter,
                               None if ranks is None else Mirror(ranks))
        # step loops take it with for_step(): waiting callers go first; any other holder may change the
        # sessions, so the step staged ahead is dropped (engine/ahead.py)
        self.lock = EngineLock(on_hold=self.core.ahead.drop)
        self.stepper = Stepper(self.core, self.lock)
        self.handoff = HandOffVerbs(self.core, self.stepper, self.lock)     # engine/handoff_verbs.py
        self.sessions: dict[str, Session] = {}
        if ranks is not None:      # no worker rank outlives its engine, closed or not
            atexit.register(_close_ranks, weakref.ref(self))

    # the pools and the scheduler are the core's; read here for the services, benchmarks and tests
    @property
    def device(self) -> torch.device:
        return self.core.device

    @property
    def dtype(self) -> torch.dtype:
        return self.core.dtype

    @property
    def kv(self) -> KVPool:
        return self.core.kv

    @property
    def gdn(self) -> GDNStatePool | None:
        return self.core.gdn

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def clock(self) -> Callable[[], float]:
        return self.core.clock

    @property
    def audit_gdn_join(self) -> bool:
        """Keep every joined token's factors in the turns admitted from now on (tests, audits)."""
        return self.core.audit_gdn_join

    @audit_gdn_join.setter
    def audit_gdn_join(self, value: bool) -> None:
        with self.lock, self.core.replicate("audit_gdn_join", value):
            self.core.audit_gdn_join = value

    # what the services, benchmarks and the warm-up read: nothing outside the engine package reads `core`,
    # `scheduler` or `stepper` (tests/test_boundaries.py)
    @property
    def max_model_len(self) -> int | None:
        """Tokens a session may hold (prompt and answers): `EngineConfig.max_model_len`, else the
        checkpoint's context length (None: no limit known)."""
        return self.core.max_model_len

    @property
    def prefill_alignment(self) -> tuple[int, int | None] | None:
        """(page, every): where the scheduler ends prefill steps, so that whole pages reach the prefix cache;
        None: anywhere. Settable (a benchmark measures what the alignment costs)."""
        return self.core.scheduler.align

    @prefill_alignment.setter
    def prefill_alignment(self, value: tuple[int, int | None] | None) -> None:
        with self.lock, self.core.replicate("prefill_alignment", value):
            self.core.scheduler.align = value

    def use_step_graphs(self, capture: bool) -> None:
        """Pad decode steps to their bucket and replay them from captured graphs (`capture`, CUDA), or run
        them eagerly over the same static buffers (`capture` False: the padded path timed on a CPU)."""
        with self.lock, self.core.replicate("use_step_graphs", capture):
            self.core.runner.use_graphs(capture)

    def input_prefilled(self, stream: TurnStream) -> bool:
        """The turn's input is prefilled (its answer is decoding): from then on its residual can be exported."""
        return stream.request.decoding

    def turn_error(self, stream: TurnStream) -> BaseException | None:
        """Why the turn failed or was undone (None while it runs or once it ended well)."""
        return stream.request.error

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype: str = "float32",
                        drafter: Drafter | None = None, **engine_options: Any) -> Engine:
        """Load a Hugging Face-format folder (config.json + safetensors; tokenizer/processor if present).
        `drafter`: what proposes draft tokens when `speculative` is on (default: the n-gram drafter, or the
        checkpoint's MTP head for method "mtp")."""
        return load_pretrained(cls, path, device, dtype, drafter, engine_options, serve_rank)

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Stop the background stepper and the worker ranks this engine started (their processes exit).
        The engine serves nothing afterwards at tensor_parallel_size > 1; at 1 it only stops stepping."""
        self.stop_background()
        if self.ranks is not None:
            self.ranks.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def rank_failure(self) -> str | None:
        """Why the engine's tensor-parallel ranks cannot serve (a worker rank exited, a collective failed
        or timed out); None while they can, or without worker ranks. Serving needs a new engine then."""
        if self.ranks is None:
            return None
        failure = self.core.mirror.failure
        if failure is not None:
            return str(failure)
        if self.ranks.closed:
            return "the engine is closed"
        return self.ranks.failure()

    def build_prompt(self, message: Message, *, first_turn: bool, selection_signals: bool = False) -> Prompt:
        """`message` as a token-level prompt, as a session's turn prefills it: rendered by the checkpoint's
        chat template (`first_turn`: with the conversation's opening), its images and videos encoded by the
        vision tower (`selection_signals`: with what attention-based selectors read) and expanded to their
        visual tokens. The one prompt builder of sessions, of a session rebuilt from its log (the services)
        and of the benchmarks."""
        if self.formatter is None:
            raise InvalidInputError("this checkpoint has no tokenizer: it takes token-level prompts only")
        cfg = self.model_config
        return self.formatter.build_prompt(
            message, first_turn=first_turn, vision=self.vision, selection_signals=selection_signals,
            image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
            vision_start_id=cfg.vision_start_token_id, vision_end_id=cfg.vision_end_token_id)

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
        sid = session_id or uuid.uuid4().hex
        with self.lock, self.core.replicate("open_session", sid, limit, deferral):
            if sid in self.sessions:
                raise InvalidInputError(f"a session with id {sid!r} already exists")
            session = Session(self, self.core.open_cache(sid, limit), deferral)
            self.sessions[session.id] = session
        return session

    def release_session(self, session: Session) -> None:
        """A closed session's pages and state slots go back to the pools (called by `Session.close`)."""
        with self.lock:
            self.sessions.pop(session.id, None)
            self.core.forget(session.id)

    def stop_token_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.formatter is not None:
            ids |= set(self.formatter.stop_token_ids)
        return ids

    def pool_stats(self) -> PoolStats:
        return self.kv.stats()

    def encoder_cache_stats(self) -> EncoderCacheStats | None:
        """The vision tower's output cache: entries, bytes, hits; None without a tower or with it off."""
        cache = self.vision.cache if self.vision is not None else None
        return cache.stats() if cache is not None else None

    def clear_caches(self) -> None:
        """Empty the prefix cache and the encoder cache (sessions keep the pages they hold)."""
        with self.lock, self.core.replicate("clear_caches"):
            if self.core.prefix is not None:
                self.core.prefix.clear()
        if self.vision is not None and self.vision.cache is not None:
            self.vision.cache.clear()

    def prefix_stats(self) -> PrefixStats | None:
        """The prefix cache's pages, GDN checkpoints and hits; None when it is off."""
        with self.lock.for_reading():
            return self.core.prefix.stats() if self.core.prefix is not None else None

    # ---------------------------------------------------------------- stepping and instrumentation
    def step(self, only: SessionCache | None = None) -> bool:
        """One step over every running turn (and recoveries in the gaps; only `only`'s when given):
        engine/step.py. False when there was no work."""
        return self.stepper.step(only)

    def has_work(self) -> bool:
        return self.core.has_work()

    def start_background(self, after_step: Callable[[], None] | None = None, idle_wait_s: float = 0.02) -> None:
        """Step in a daemon thread whenever there is work nobody is waiting for (engine/stepper.py)."""
        self.stepper.start_background(after_step, idle_wait_s)

    def wake(self) -> None:
        self.stepper.wake()

    def stop_background(self) -> None:
        self.stepper.stop_background()

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Measure with `clock` from now on (thread CPU time, a simulated clock), with a fresh cost model."""
        with self.lock, self.core.replicate("use_clock"):
            self.core.use_clock(clock)

    def speculate(self, num_tokens: int | None) -> None:
        """Verify up to `num_tokens` draft tokens per decode step from the next step on (None: decode one
        row a step), with the drafter the engine was loaded with (`EngineConfig.speculative`): benchmarks
        and tests compare both on one engine."""
        with self.lock:
            self.core.speculate(num_tokens)

    def stage_ahead(self, on: bool) -> None:
        """Stage each decode step during the last one's forward from now on, or not (engine/ahead.py; the
        default is `EngineConfig.plan_ahead`'s): benchmarks compare both on one engine. Never across ranks."""
        with self.lock:     # a hold that drops a step staged now
            self.core.ahead.on = on and self.core.mirror is None and self.model.tp is None

    # ---------------------------------------------------------------- hand-off (docs/mechanism.md §8)
    # under the engine lock, across the engine's ranks: engine/handoff_verbs.py
    def hold_residual(self, session: Session, *, fuse: bool = True) -> int | None:
        """Reserve the session's current recovery for a deferred worker: local gap recovery leaves it
        alone, and fused chunks during the answer run only with `fuse`. Returns the recovery's ticket (its
        turn index), or None when nothing is left."""
        return self.handoff.hold(session, fuse)

    def export_residual(self, session: Session, ticket: int, have: torch.Tensor | None = None) -> ResidualPayload:
        """What the held recovery's remaining rows may see (every non-GEN slot's K/V, the GDN prefix state)
        and the rows, as soon as the turn's I0 is prefilled (before that, or once the recovery is not held
        or over: RecoveryStateError). `have`: positions in the session's cache of context rows the receiver
        already holds; they are not shipped."""
        return self.handoff.export(session, ticket, have, self.replicated)

    def prefill_residual(self, payload: ResidualPayload) -> ResidualResult:
        """Deferred-worker side: prefill the payload's rows on top of its context (a scratch session)."""
        return self.handoff.prefill(payload, self.replicated)

    def apply_residual(self, session: Session, ticket: int, result: ResidualResult) -> Joined | None:
        """Join a deferred worker's result: the rows it covers that are not restored yet (fused chunks may
        have restored some since the export); the recovery is complete. None, with nothing changed, while
        the answer streams and no chunk may join now (a policy without fused chunks, or the guard): call
        again later. RecoveryStateError (nothing applied) when the recovery named by `ticket` is no longer
        held (taken back, finished locally, an earlier turn's) or the result was made for another one."""
        return self.handoff.apply(session, ticket, result, self.replicated)

    def take_back(self, session: Session, ticket: int) -> bool:
        """The deferred worker failed or timed out: the engine recovers the rest locally (a recovery is
        never lost) and refuses a result that comes later. False when that recovery is no longer held."""
        return self.handoff.take_back(session, ticket)

    # ---------------------------------------------------------------- session-free forward
    def forward_logits(self, input_ids: torch.Tensor | None = None, *, inputs_embeds: torch.Tensor | None = None,
                       position_ids: torch.Tensor | None = None,
                       visual: list[VisualInput] | None = None) -> torch.Tensor:
        """Full-prefill logits `[T, vocab]` (fp32) of one sequence, outside any session.

        `input_ids [T]` (placeholders for `visual`, which are scattered in and get 3-D positions), or
        `inputs_embeds [T, d]`; `position_ids [T]` or `[3, T]` override the computed positions."""
        # under the lock throughout: the input ids' digest is compared across ranks, in the calls' order
        with self.lock, self.core.replicate("forward_logits", input_ids, inputs_embeds, position_ids, visual):
            rows = sequence_rows(self.model, self.model_config, input_ids, inputs_embeds, position_ids, visual,
                                 self.device, self.dtype)
            return scratch_logits(self.core, rows)


def serve_rank(group: RankGroup, commands: object, folder: str, device: str, dtype: str, options: dict) -> None:
    """A worker rank of an engine that started its ranks: its replica loads its shard, then replays rank 0's
    calls (engine/mirror.py) until rank 0 stops it."""
    engine = Engine.from_pretrained(folder, device=device, dtype=dtype, **options)
    engine.replicated = True
    replay_commands(engine, commands)


def _close_ranks(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None and engine.ranks is not None:
        engine.ranks.close()


__all__ = ["Engine"]
