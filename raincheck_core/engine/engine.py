"""The Engine: one model on one device, a shared KV pool and GDN state pool, many sessions.

Work advances in steps (`step()`): each step runs one forward over the rows the scheduler picked
from every running turn. There is no engine thread: whoever waits for a turn's next event drives
the steps, under one lock, so embedded use needs no threads and concurrent callers share steps.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from ..cache.gdn_state import GDNStatePool
from ..cache.kv_pool import KVPool, PoolStats
from ..config import EngineConfig, ModelConfig
from ..deferral.policy import DeferralConfig
from ..errors import CheckpointError, InvalidInputError
from ..inputs import VisualInput
from ..layers.batch import ForwardBatch
from ..models import DecoderLM, build_decoder
from ..models.loader import load_decoder_weights
from .request import TurnRequest
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence
from .session import Session
from .turn_input import build_turn_input

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: DecoderLM, model_config: ModelConfig, config: EngineConfig | None = None,
                 formatter=None, vision=None):
        self.config = config or EngineConfig()
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
        self.scheduler = Scheduler(self.config.max_rows_per_step, self.config.deferred_budget,
                                   self.config.recovery_chunk)
        self.runner = ModelRunner(self.model, self.kv, self.gdn)
        self.lock = threading.RLock()
        self.sessions: dict[str, Session] = {}
        self.audit_gdn_join = False       # keep every joined token's factors (tests, audits)
        self._background: tuple[threading.Thread, threading.Event] | None = None

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
        return cls(model, model_config, config, formatter=formatter, vision=vision)

    # ---------------------------------------------------------------- sessions
    def open_session(self, *, max_pages: int | None = None, session_id: str | None = None,
                     deferral: DeferralConfig | None = None) -> Session:
        """A new chat session; `deferral` is its policy (default `full`), overridable per turn."""
        limit = max_pages or self.config.max_pages_per_session
        with self.lock:
            if session_id is not None and session_id in self.sessions:
                raise InvalidInputError(f"a session with id {session_id!r} already exists")
            seq = Sequence(self.kv, self.gdn, limit)
            session = Session(self, seq, session_id, deferral)
            self.sessions[session.id] = session
        return session

    def _forget(self, session: Session) -> None:
        with self.lock:
            self.sessions.pop(session.id, None)
            self.scheduler.remove_recovering(session.seq)
            session.seq.release()

    def stop_token_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.formatter is not None:
            ids |= set(self.formatter.stop_token_ids)
        return ids

    # ---------------------------------------------------------------- stepping
    def step(self, only: Sequence | None = None) -> bool:
        """Run one forward over the scheduled rows of all running turns (and recoveries in the gaps).
        False when there was no work."""
        with self.lock:
            work = self.scheduler.schedule(only)
            if not work:
                return False
            try:
                self.runner.run(work)
            except Exception as e:  # a broken step fails its turns, not the engine
                log.exception("step failed")
                for item in work:
                    if item.request is not None:
                        item.request.fail(e)
            for item in work:
                req = item.request
                if req is not None and req.finished:
                    self.scheduler.remove(req)
                    self._answer_done(req)
                if item.seq is not None and item.seq.recovery is not None and item.seq.recovery.done:
                    self._recovery_done(item.seq)
            return True

    def _answer_done(self, req: TurnRequest) -> None:
        rec = req.recovery
        if rec is not None and req.seq.recovery is rec and not rec.done:
            rec.mark_answer_done()
            self.scheduler.add_recovering(req.seq)

    def _recovery_done(self, seq: Sequence) -> None:
        rec = seq.recovery
        rec.release()
        seq.clear_generated()
        seq.last_recovery_s = rec.completion_s
        seq.recovery = None
        self.scheduler.remove_recovering(seq)

    def drive(self, request: TurnRequest) -> None:
        """Step until `request` has an event to hand out or has ended."""
        while not request.events and not request.finished:
            with self.lock:
                if not request.events and not request.finished:
                    self.step()

    def complete_recovery(self, seq: Sequence) -> None:
        """Run `seq`'s deferred rows to the end (the completion barrier), in prefill-only chunks
        shared with whatever else is running."""
        while seq.recovery is not None:
            with self.lock:
                if seq.recovery is None:
                    break
                rec = seq.recovery
                if not rec.answer_done:       # the answer is still streaming: finish it first
                    self.step()
                    continue
                if rec.handed_off:            # nobody applied the deferred worker's result: do it here
                    log.warning("recovery handed off but not applied; finishing it locally")
                    rec.handed_off = False
                self.step(only=seq)

    def start_background(self, idle_wait_s: float = 0.02) -> None:
        """Step in a daemon thread whenever there is work nobody is waiting for — chiefly post-answer
        recovery in the gaps between turns. Consumers keep driving their own turns as before."""
        if self._background is not None:
            return
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                if not (self.scheduler.has_work() and self.step()):
                    stop.wait(idle_wait_s)

        thread = threading.Thread(target=loop, name="raincheck-engine-steps", daemon=True)
        self._background = (thread, stop)
        thread.start()

    def stop_background(self) -> None:
        if self._background is not None:
            thread, stop = self._background
            stop.set()
            thread.join()
            self._background = None

    def pool_stats(self) -> PoolStats:
        return self.kv.stats()

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
        deepstack_rows, deepstack = None, []
        if input_ids is not None:
            ti = build_turn_input(self.model, cfg, _as_list(input_ids), list(visual or []), 0)
            embeds, positions = ti.embeds, ti.positions
            if ti.deepstack:
                deepstack_rows, deepstack = ti.deepstack_index, ti.deepstack
        else:
            if visual:
                raise InvalidInputError("visual inputs need input_ids with their placeholder tokens")
            embeds = inputs_embeds.to(device=self.device, dtype=self.dtype)
            if embeds.dim() != 2 or embeds.shape[1] != cfg.hidden_size:
                raise InvalidInputError(f"inputs_embeds must be [T, {cfg.hidden_size}], got {tuple(embeds.shape)}")
            positions = torch.arange(embeds.shape[0]).expand(3, -1)
        if position_ids is not None:
            positions = _positions(position_ids, embeds.shape[0])
        with self.lock:
            seq = Sequence(self.kv, self.gdn, self.kv.num_pages)
            try:
                seg = seq.add_rows(0, embeds.shape[0])
                batch = ForwardBatch(embeds, positions.to(self.device), [seg], self.kv, self.gdn,
                                     deepstack_rows=deepstack_rows, deepstack=deepstack)
                with torch.inference_mode():
                    return self.model(batch)
            finally:
                seq.release()


def resolve_model_path(path: str | Path) -> Path:
    """A checkpoint folder; the name "demo" means the model this project trains and ships
    (`models/demo/` in the repository, or `$RAINCHECK_DEMO_MODEL`)."""
    if str(path) != "demo":
        return Path(path)
    folder = Path(os.environ.get("RAINCHECK_DEMO_MODEL", Path(__file__).resolve().parents[2] / "models" / "demo"))
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"the demo model is not at {folder}: train it with "
                              "`python -m raincheck_core.models.demo.train` or set RAINCHECK_DEMO_MODEL")
    return folder


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
