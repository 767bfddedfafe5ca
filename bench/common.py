"""Shared pieces of the latency benchmarks: engine setup, a synthetic image turn, one timed turn, and
side-by-side rounds of several deferral settings with alternating order.

Everything runs on the random `bench` checkpoints (`raincheck_core.models.random_init`); visual input
is given as precomputed embeddings (no vision tower runs), so only the LLM decoder is timed.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from raincheck_core import Engine, Prompt, SamplingParams, TurnEnd, TurnMetrics, VisualInput
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine.hooks import StepStats
from raincheck_core.models.random_init import save_random_checkpoint
from raincheck_core.warmup import warm_up

FAMILIES = ("qwen3_5", "qwen3_vl")
POLICIES = ("full", "hard", "raincheck", "post_answer")


def setup_torch(threads: int) -> None:
    """Flush subnormals before any multi-threaded op (GDN decays make them; they are 10-70x slower)."""
    torch.set_flush_denormal(True)
    torch.set_num_threads(threads)


def build_engine(family: str, workdir: Path, prefix_cache: bool = False, size: str = "bench",
                 max_gdn_slots: int = 64, backend: str | None = None, plan_ahead: bool | None = None) -> Engine:
    """The `bench` checkpoint's engine (or the `size` one of models/random_init.py); without the prefix cache
    unless asked (the latency benchmarks run the same prompt again and again: it would serve them from the
    cache). `max_gdn_slots`: a slot per open session, and one more per pending GDN join; `backend`: the op
    backend (`EngineConfig.backend`, its default unless given; flex is the GPU path's CPU twin); `plan_ahead`:
    `EngineConfig.plan_ahead`."""
    folder = save_random_checkpoint(workdir / family, family, size)
    return Engine.from_pretrained(folder, max_rows_per_step=4096, deferred_budget=63, prefix_cache=prefix_cache,
                                  max_gdn_slots=max_gdn_slots, plan_ahead=plan_ahead,
                                  **({} if backend is None else {"backend": backend}))


def image_prompt(engine: Engine, side: int = 32, text: int = 32, seed: int = 0) -> Prompt:
    """`text` text ids, one image of side×side merged tokens (grid (1, 2·side, 2·side)), `text` more ids."""
    cfg = engine.model_config
    n = side * side
    g = torch.Generator().manual_seed(seed)
    visual = VisualInput("image", torch.randn(n, cfg.hidden_size, generator=g), (1, 2 * side, 2 * side),
                         [torch.randn(n, cfg.hidden_size, generator=g) for _ in range(cfg.deepstack_levels)])
    words = torch.randint(16, min(2000, cfg.vocab_size - 16), (2 * text,), generator=g).tolist()   # tiny's too
    ids = [*words[:text], cfg.vision_start_token_id, *[cfg.image_token_id] * n, cfg.vision_end_token_id,
           *words[text:]]
    return Prompt(ids, [visual])


class StepLog:
    """Every engine step's decode rows, deferred rows and duration (the engine's clock, as its TPOT
    objective sees it), recorded through the engine's `on_step` hook."""

    def __init__(self, engine: Engine):
        self.steps: list[tuple[int, int, float]] = []     # (decode rows, deferred rows, seconds)
        engine.on_step(self.record)

    def record(self, stats: StepStats) -> None:
        if not stats.failed:
            self.steps.append((stats.decode_rows, stats.deferred_rows + stats.recovery_rows, stats.seconds))


_LOGS: weakref.WeakKeyDictionary[Engine, StepLog] = weakref.WeakKeyDictionary()


def step_log(engine: Engine) -> StepLog:
    """The engine's step log, installed on first use."""
    if engine not in _LOGS:
        _LOGS[engine] = StepLog(engine)
    return _LOGS[engine]


def use_clock(engine: Engine, clock: Callable[[], float], calibrate: bool = False) -> None:
    """Measure with `clock` from now on, with a fresh step-cost model (its samples must share one clock).
    `calibrate`: fill that model by the engine's warm-up on this clock, as a decode worker does before it
    reports ready, so the TPOT objective decides from a full calibration from the first timed turn on
    (without it, the model learns from the benchmark's own turns, starting from its expensive prior)."""
    engine.use_clock(clock)
    if calibrate:
        warm_up(engine)


@dataclass
class TurnStats:
    """One timed turn (the engine's clock). `steps`: (deferred rows, seconds) of each decode step, one per
    token after the first; a step with deferred rows is a chunk-carrying ("restoring") step."""

    ttft_s: float
    tpot_s: float
    e2e_s: float
    tpot_restoring_s: float | None
    deferred_tokens: int
    deferred_pending: int
    completion_s: float                       # post-response completion (session.complete_recovery())
    prompt_tokens: int
    restoring_steps: int
    steps: list[tuple[int, float]] = field(default_factory=list, repr=False)

    @property
    def restored_before_end(self) -> float | None:
        """Share of the deferred tokens D prefilled before the answer ended."""
        if not self.deferred_tokens:
            return None
        return (self.deferred_tokens - self.deferred_pending) / self.deferred_tokens

    def plain_gaps(self) -> list[float]:
        """Decode steps that carried no deferred rows."""
        return [s for rows, s in self.steps if not rows]

    def restoring_gaps(self, rows: int | None = None) -> list[float]:
        """Decode steps that carried deferred rows (`rows` of them, when given)."""
        return [s for r, s in self.steps if r and (rows is None or r == rows)]


def run_turn(engine: Engine, prompt: Prompt, cfg: DeferralConfig, max_new: int) -> TurnStats:
    session = engine.open_session(deferral=cfg)
    log = step_log(engine)
    gc.collect()
    gc.disable()                  # no collector pauses inside the timed turn
    try:
        first = len(log.steps)
        end: TurnEnd | None = None
        for event in session.turn(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True)):
            if isinstance(event, TurnEnd):
                end = event
        steps = [(deferred, s) for decode, deferred, s in log.steps[first:] if decode]
        pending = session.pending_deferred
        completion = session.complete_recovery() if pending else 0.0
    finally:
        gc.enable()
        session.close()
    assert end is not None
    m = end.metrics
    return TurnStats(m.ttft_s, m.tpot_s, m.e2e_s, m.tpot_restoring_s, m.deferred_tokens, m.deferred_pending,
                     completion, m.prompt_tokens, sum(1 for rows, _ in steps if rows), steps)


def text_prompt(words: int = 32, seed: int = 1) -> Prompt:
    """A text-only follow-up question of `words` random ids."""
    return Prompt(torch.randint(16, 2000, (words,), generator=torch.Generator().manual_seed(seed)).tolist())


def run_dialogue(engine: Engine, prompts: Sequence[Prompt], cfg: DeferralConfig, max_new: int,
                 think_s: float) -> list[TurnMetrics]:
    """One session, one turn per prompt, sleeping `think_s` (wall clock) between an answer's end and the
    next question, as a user does; whatever steps in the background meanwhile recovers in that gap."""
    session = engine.open_session(deferral=cfg)
    try:
        metrics = []
        for i, prompt in enumerate(prompts):
            if i:
                time.sleep(think_s)
            end = session.turn(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True)).result()
            metrics.append(end.metrics)
        return metrics
    finally:
        session.close()


@dataclass(frozen=True)
class Arm:
    """One setting measured side by side with others."""

    name: str
    cfg: DeferralConfig


def run_rounds(engine: Engine, prompt: Prompt, arms: Sequence[Arm], repeats: int, max_new: int,
               desc: str) -> dict[str, list[TurnStats]]:
    """Every arm once per round; the order is reversed every other round so drift hits all alike.
    One untimed short warm-up turn per arm first (allocations, kernel selection)."""
    for arm in arms:
        run_turn(engine, prompt, arm.cfg, min(max_new, arm.cfg.guard + 8))
    out: dict[str, list[TurnStats]] = {arm.name: [] for arm in arms}
    with tqdm(total=repeats * len(arms), desc=desc, leave=False) as bar:
        for r in range(repeats):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                out[arm.name].append(run_turn(engine, prompt, arm.cfg, max_new))
                bar.update()
    return out


METRICS: dict[str, Callable[[TurnStats], float | None]] = {
    "ttft_s": lambda t: t.ttft_s,
    "tpot_s": lambda t: t.tpot_s,
    "tpot_restoring_s": lambda t: t.tpot_restoring_s,
    "e2e_s": lambda t: t.e2e_s,
    "completion_s": lambda t: t.completion_s,
}
STEP_QUANTILE = 0.2


def quantile(values: list[float], q: float) -> float | None:
    return sorted(values)[round(q * (len(values) - 1))] if values else None


def summarise(turns: list[TurnStats]) -> dict:
    """Best (min) and median of each engine metric over the repeats; counts from the last turn
    (deterministic). Then a noise-robust step view: the 20th percentile of plain and of restoring
    step times pooled over all repeats, and the mean TPOT rebuilt from them, `tpot_steps_s`. A burst
    from a neighbour on this shared machine stretches whole turns 2-20x; a low percentile over a
    few hundred steps is not moved by it, while best-of-N needs one undisturbed turn per setting."""
    out: dict = {"repeats": len(turns)}
    for name, get in METRICS.items():
        values = [v for v in map(get, turns) if v is not None]
        out[name] = min(values) if values else None
        out[name + "_median"] = statistics.median(values) if values else None
    last = turns[-1]
    plain = quantile([g for t in turns for g in t.plain_gaps()], STEP_QUANTILE)
    restoring = quantile([g for t in turns for g in t.restoring_gaps()], STEP_QUANTILE)
    n, k = len(last.steps), last.restoring_steps
    plain_all = [g for t in turns for g in t.plain_gaps()]
    out["plain_median_s"] = statistics.median(plain_all) if plain_all else None   # what the objective measures
    out.update(plain_step_s=plain, restoring_step_s=restoring,
               tpot_steps_s=((n - k) * plain + k * (restoring or 0.0)) / n if n else None)
    restored = [t.restored_before_end for t in turns if t.restored_before_end is not None]
    out["restored_before_end"] = statistics.median(restored) if restored else None
    out.update(deferred_tokens=last.deferred_tokens, deferred_pending=last.deferred_pending,
               prompt_tokens=last.prompt_tokens, restoring_steps=last.restoring_steps)
    out["raw"] = [{k: v for k, v in asdict(t).items() if k != "steps"} for t in turns]
    return out


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: a line of `header`'s cells, the separator, a line per row (each cell as str)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def paired_median_ratio(xs: list[TurnStats], ys: list[TurnStats], get: Callable[[TurnStats], float | None]
                        ) -> float | None:
    """Median over rounds of x_i / y_i (same round, so slow phases of the machine cancel)."""
    values = [ratio(get(x), get(y)) for x, y in zip(xs, ys, strict=True)]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def add_ratios(summary: dict, turns: list[TurnStats], ref_summary: dict, ref_turns: list[TurnStats]) -> None:
    """`*_ratio`: best over best; `*_ratio_paired`: median of same-round ratios; `tpot_steps_ratio`:
    of the step-percentile TPOTs."""
    for key, name in (("ttft_s", "ttft"), ("tpot_s", "tpot"), ("e2e_s", "e2e")):
        summary[name + "_ratio"] = ratio(summary[key], ref_summary[key])
        summary[name + "_ratio_paired"] = paired_median_ratio(turns, ref_turns, METRICS[key])
    summary["tpot_steps_ratio"] = ratio(summary["tpot_steps_s"], ref_summary["tpot_steps_s"])


def time_call(fn: Callable[[], object], inner: int, repeats: int,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Best over `repeats` batches of the mean time of `fn` in a batch of `inner` calls (seconds)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        for _ in range(inner):
            fn()
        best = min(best, (clock() - t0) / inner)
    return best


# ---------------------------------------------------------------------------- GDN join micro-benchmark
GDN_SHAPES = {"qwen3.5-9b layer": (32, 128), "bench model layer": (8, 48)}   # value heads, Dk = Dv


def _suffix_factors(n: int, heads: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """k (L2-normalised), v, g ≤ 0, beta ∈ (0,1) of n tokens. Per-head decays from fast (α≈0.8) to slow
    (α≈0.9999), as trained heads have; odd heads get anisotropic keys (effective rank ~d/6), whose
    rarely written directions keep P large: the hard case for the join."""
    from raincheck_core.ops.gdn import l2norm

    k = torch.randn(n, heads, d, generator=g)
    basis = torch.randn(max(2, d // 6), d, generator=g)
    k[:, 1::2] = torch.randn(n, heads // 2, basis.shape[0], generator=g) @ basis
    alpha = 1 - torch.logspace(math.log10(0.2), -4, heads)
    gate = (alpha.log() * (1 + 0.1 * torch.rand(n, heads, generator=g))).clamp(max=0)
    beta = torch.sigmoid(torch.randn(n, heads, generator=g))
    return l2norm(k), torch.randn(n, heads, d, generator=g), gate, beta


def _gdn_shape(shape: str, heads: int, d: int, lengths: Sequence[int], repeats: int, prefix: int,
               deferred: int) -> list[dict]:
    from raincheck_core.ops.gdn import recurrent_gated_delta_rule as rule
    from raincheck_core.ops.gdn_state_map import extend_map, identity_map, join_state

    g = torch.Generator().manual_seed(0)
    pre = _suffix_factors(prefix, heads, d, g)
    _, s0 = rule(pre[0] * d**-0.5, *pre, None)                 # a prefix state of realistic norm
    dfr = _suffix_factors(deferred, heads, d, g)
    _, s1 = rule(dfr[0] * d**-0.5, *dfr, s0)                    # the same after the deferred tokens
    delta, eye = s1 - s0, identity_map(heads, d)
    k1, v1, g1, b1 = _suffix_factors(1, heads, d, g)
    step_s = time_call(partial(rule, k1, k1, v1, g1, b1, s0), 20, repeats)
    call_s = time_call(partial(extend_map, eye, k1, g1, b1), 20, repeats)
    rows = []
    for n in lengths:
        k, v, gate, beta = _suffix_factors(n, heads, d, g)
        _, live = rule(k, k, v, gate, beta, s0)                 # the suffix as decoded before D
        P = extend_map(eye, k, gate, beta)
        joined = join_state(live, P, delta)
        _, reapplied = rule(k, k, v, gate, beta, s1)            # the suffix re-applied from S0'
        ref = reapplied.norm()
        per_token = time_call(partial(extend_map, eye, k, gate, beta), 2, repeats) / n
        join_s = time_call(partial(join_state, live, P, delta), 20, repeats)
        rows.append(dict(shape=shape, heads=heads, dk=d, dv=d, suffix=n,
                         extend_us_per_token=1e6 * per_token, extend_call_us=1e6 * call_s,
                         join_us=1e6 * join_s, state_step_us=1e6 * step_s,
                         join_rel_err=float((joined - reapplied).norm() / ref),
                         stale_rel_err=float((live - reapplied).norm() / ref),
                         p_norm=float(torch.linalg.matrix_norm(P, ord=2).max())))
    return rows


def gdn_join_bench(lengths: Sequence[int], repeats: int, prefix: int = 256, deferred: int = 256) -> list[dict]:
    """Per layer shape: online P update µs/token (amortised over the suffix, and as a 1-token call the
    way the engine issues it, copy of P included), join µs (`S + P·ΔS`), one GDN state step for scale,
    and the relative error of the join against token-by-token re-application of the recorded suffix
    factors from the changed prefix state (fp32), next to the error of not joining at all."""
    return [row for shape, (heads, d) in GDN_SHAPES.items()
            for row in _gdn_shape(shape, heads, d, lengths, repeats, prefix, deferred)]
