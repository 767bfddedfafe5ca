"""Host time of a decode step outside the model's forward, at B = 1, 16, 64 concurrent sessions.

    python -m bench.host [--quick] [--bs 1,16,64] [--families qwen3_5,qwen3_vl] [--size bench|tiny] [--profile]
                         [--images SIDE] [--backend flex [--graphs]] [--stub-forward] [--json PATH]

On a GPU the forward is a few milliseconds of kernels (or one graph replay); what the engine does on the
host around it — schedule the step, build the runner's inputs, apply the results, sample, settle —
either hides behind it or sets the step's time. This measures that part on the CPU, where it costs the
same host time: B sessions each start a 64-token text turn (distinct ids, prefix cache on, as served),
then the engine steps until all have ended; every steady step (all B decoding) is timed in thread CPU
time, and so is the model's forward inside it (a hook on the decoder module: its Python and its
arithmetic), and the host time is the difference. The random `bench` checkpoint's arithmetic is small,
but only the difference is reported. 20th percentile and median over the steady steps of the rounds. A
second table splits it by stage (`STAGES`), in a round of its own: the engine's plan, read and step hooks and
the decoder's forward hooks mark the stages' ends. What the update does before it first reads a value the
forward computed runs beside the forward on a device (the forward returns when its kernels are queued); the
rest is the critical path, the host time a device waits for between two forwards. Of the inputs, the table
also gives what the GPU path's CPU twin does in a device's place (`DEVICE`: its staged copy and the device work
queued after it), which a GPU's host only queues.
`--images SIDE` gives each turn an image of SIDE² merged tokens between its text (precomputed embeddings)
under raincheck (30% kept, 31-row chunks after a 16-token guard, no TPOT objective): its steady steps carry
the deferred chunks the engine's budget lets them (63 rows a step: two sessions' chunks), the host work of
a fused step. `--profile` adds cProfile's top functions of the largest B by time spent outside the
forward. `--size tiny` runs the same steps on the `tiny` checkpoint, whose forward is small enough to leave
most of the CPU's caches warm: the same host work, without most of the cache misses the `bench` forward's
40-odd MB of weights cause (a forward on a device leaves the host's caches alone: `--stub-forward`).
`--backend flex` runs the GPU path's CPU twin, whose attention layout (ops/flex_layout.py) is host work of
every step on a GPU; with `--graphs` its decode steps take the graph path as on a GPU (padded to their
bucket, looked up by skeleton, copied into the static batch), run eagerly where a GPU replays
(`Engine.use_step_graphs(False)`).
`--stub-forward` replaces the model's forward by one that returns zero logits at once: the host work of a
step whose forward is a device's graph replay, which costs the host a call and leaves its caches alone (any
CPU forward, even `tiny`'s, evicts some of what the next step's host work reads); text turns only (deferred
rows read the forward's GDN factors).

The random checkpoint has no tokenizer, so the steps above stream no text; a served model's consumers find
each token's text as they read its event, outside the step. That part is measured apart, with the demo
model's tokenizer on a long English answer: the host time of one
token's text at answer positions 16 to 4,096, decoding the whole answer so far (what the engine did
before multimodal/detokenize.py, and a naive server does) against the incremental window, side by side.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.multimodal.chat import ChatFormatter
from raincheck_core.multimodal.detokenize import IncrementalText

from .common import FAMILIES, STEP_QUANTILE, build_engine, image_prompt, quantile, setup_torch

TEXT = 64
GOAL_MS = 1.0           # issue 39: host time per decode step outside the forward at B = 64
TOKENIZER = Path(__file__).resolve().parent.parent / "models" / "demo-v2"
POSITIONS = (16, 256, 1024, 4096)      # answer tokens so far, where a token's text is timed
ANSWER = ("The red circle is to the left of the blue square, and two small green triangles sit above it; "
          "a yellow star, partly hidden, is in the lower right corner of the picture. ")


@contextmanager
def forward_timer(model: torch.nn.Module) -> Iterator[list[float]]:
    """Thread CPU seconds of each call of `model` (the decoder's whole forward), appended as they end."""
    spent: list[float] = []
    start: list[float] = []
    pre = model.register_forward_pre_hook(lambda _m, _a: start.append(time.thread_time()))
    post = model.register_forward_hook(lambda _m, _a, _o: spent.append(time.thread_time() - start.pop()))
    try:
        yield spent
    finally:
        pre.remove()
        post.remove()


# the host time of a step by stage, from marks the engine's public hooks and the decoder's forward hooks set:
# planning (the scheduler, until the plan is handed to the forward's hooks), inputs (resolving the plan, the
# op set, the runner's tensors), beside the forward (its outputs and the update's bookkeeping, until the update
# first reads a value the forward computed: `Engine.on_read`; on a device this runs while the forward's
# kernels compute), after its logits (sampling, the tokens' events, settling, the cost model, the step
# hooks), and the rest of the step's own calls (the lock, the clock); the critical path is all but the
# stage beside the forward: what a device waits for between two forwards
STAGES = ("planning", "inputs", "beside the forward", "after its logits", "rest")
CRITICAL = "critical path"
# of the inputs, what the GPU path's CPU twin does in a device's place: its staged copy and the device work queued
# after it (the decode tokens' embedding rows, the slot-table writes; `Uploads.send`), which a GPU's host only
# queues (a copy and a few launches); none on the native path
DEVICE = "the twin's device work"


@contextmanager
def step_marks(engine: Engine) -> Iterator[dict[str, float]]:
    """Thread CPU times at which the current step planned (its first pass's plan), entered and left the
    forward (first entry, last exit), first read the forward's values (its last pass's update) and ended
    (the step hooks), in a dict the caller clears per step."""
    marks: dict[str, float] = {}

    def first(name: str) -> Callable[..., None]:
        def mark(*_args: object) -> None:     # returns None: a forward hook's value would replace the inputs
            marks.setdefault(name, time.thread_time())
        return mark

    def last(name: str) -> Callable[..., None]:
        def mark(*_args: object) -> None:
            marks[name] = time.thread_time()
        return mark

    def timed(send: Callable[[], None]) -> Callable[[], None]:
        def timed_send() -> None:        # `DEVICE`: its thread CPU time, summed over the step
            start = time.thread_time()
            send()
            marks[DEVICE] = marks.get(DEVICE, 0.0) + time.thread_time() - start
        return timed_send

    model = engine.model
    removers = [engine.on_plan(first("planned")), engine.on_read(last("read")), engine.on_step(first("stepped"))]
    pre, post = model.register_forward_pre_hook(first("forward")), model.register_forward_hook(last("forwarded"))
    for uploads in engine.staging:      # both: a step staged ahead sends from the other one
        uploads.send = timed(uploads.send)      # an instance attribute: the runner and the graph path call it
    try:
        yield marks
    finally:
        for remove in removers:
            remove()
        pre.remove()
        post.remove()
        for uploads in engine.staging:
            del uploads.send


@contextmanager
def stub_forward(engine: Engine) -> Iterator[None]:
    """The model's forward returns zero logits for the rows the step keeps, computing nothing (greedy draws
    token 0, ignore_eos keeps the turns going); hooks on the model still fire around it."""
    model = engine.model
    zeros = torch.zeros(engine.config.max_rows_per_step, engine.model_config.vocab_size)
    model.forward = lambda batch: zeros[:batch.logit_rows.shape[0]]     # an instance attribute: module calls take it
    try:
        yield
    finally:
        del model.forward


def prompts(b: int, seed: int = 0, vocab: int = 2048) -> list[Prompt]:
    g = torch.Generator().manual_seed(seed)
    return [Prompt(torch.randint(16, min(2000, vocab - 16), (TEXT,), generator=g).tolist()) for _ in range(b)]


@dataclass(frozen=True)
class Load:
    """What each of the B sessions sends: a `TEXT`-token text turn, or with `image_side` its text around an
    image whose deferred rows ride on the decode steps (`--images`)."""

    image_side: int = 0

    def batch(self, engine: Engine, b: int, seed: int) -> list[Prompt]:
        if self.image_side:
            return [image_prompt(engine, self.image_side, TEXT // 2, seed=seed * 1000 + i) for i in range(b)]
        return prompts(b, seed, engine.model_config.vocab_size)

    @property
    def deferral(self) -> DeferralConfig | None:
        return DeferralConfig("raincheck", selector="uniform", retention=0.3, chunk_size=31, guard=16,
                              tpot_slo=None) if self.image_side else None


def host_steps(engine: Engine, batch: Sequence[Prompt], max_new: int, profiler: cProfile.Profile | None = None,
               stages: dict[str, list[float]] | None = None, deferral: DeferralConfig | None = None,
               uploads: list[tuple[int, int]] | None = None) -> tuple[list[float], list[float]]:
    """(step CPU seconds, forward CPU seconds) of the steady decode steps of one batch of turns (under
    `deferral`, if given); with `stages`, each steady step's CPU seconds by stage are appended to it too
    (`STAGES`: the hooks that mark them cost a little of the steps they time, so the main figures are
    measured without them); with `uploads`, each steady step's staged host-to-device copies and the tensors
    they carried (ops/uploads.py: the GPU path's, on its CPU twin; none on the native path)."""
    sessions = [engine.open_session() for _ in batch]
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    steps, forwards = [], []
    gc.collect()
    gc.disable()
    try:
        with forward_timer(engine.model) as spent, \
                (step_marks(engine) if stages is not None else nullcontext({})) as marks:
            turns = [s.turn(p, params, deferral=deferral).request for s, p in zip(sessions, batch, strict=True)]
            while not all(t.finished for t in turns):
                steady = all(t.decoding and not t.finished for t in turns)
                calls = len(spent)
                marks.clear()
                if steady and profiler is not None:
                    profiler.enable()
                start = cpu = time.thread_time()
                engine.step()
                cpu = time.thread_time() - cpu
                if profiler is not None:
                    profiler.disable()
                if steady:
                    steps.append(cpu)
                    forwards.append(sum(spent[calls:]))
                    if uploads is not None:
                        uploads.append((engine.uploads.copies, engine.uploads.staged))
                    if stages is not None:
                        _split(marks, start, cpu, forwards[-1], stages)
    finally:
        gc.enable()
        for s in sessions:
            s.close()
    return steps, forwards


def _split(marks: dict[str, float], start: float, step: float, forward: float, stages: dict[str, list[float]]
           ) -> None:
    """One step's marks (`step_marks`) as CPU seconds by stage, appended to `stages`, its critical path and, of
    its inputs, the CPU twin's device work (`DEVICE`)."""
    parts = {"planning": marks["planned"] - start, "inputs": marks["forward"] - marks["planned"],
             "beside the forward": marks["read"] - marks["forwarded"],
             "after its logits": marks["stepped"] - marks["read"]}
    parts["rest"] = step - forward - sum(parts.values())
    parts[CRITICAL] = step - forward - parts["beside the forward"]
    parts[DEVICE] = marks.get(DEVICE, 0.0)
    for name, seconds in parts.items():
        stages[name].append(seconds)


def measure(engine: Engine, bs: Sequence[int], repeats: int, max_new: int, desc: str, load: Load = Load()
            ) -> dict[int, dict]:
    defer = load.deferral
    host_steps(engine, load.batch(engine, 4, 99), max_new if defer else 8, deferral=defer)   # warm-up: first uses
    pooled: dict[int, tuple[list[float], list[float]]] = {b: ([], []) for b in bs}
    by_stage: dict[int, dict[str, list[float]]] = {b: {name: [] for name in (*STAGES, CRITICAL, DEVICE)} for b in bs}
    staged: dict[int, list[tuple[int, int]]] = {b: [] for b in bs}
    with tqdm(total=(repeats + 1) * len(bs), desc=desc, leave=False) as bar:
        for r in range(repeats):
            for b in bs if r % 2 == 0 else bs[::-1]:
                steps, forwards = host_steps(engine, load.batch(engine, b, r), max_new, deferral=defer)
                pooled[b][0].extend(steps)
                pooled[b][1].extend(forwards)
                bar.update()
        for b in bs:        # the stages: a round of their own, with the hooks that mark them
            host_steps(engine, load.batch(engine, b, repeats), max_new, stages=by_stage[b], deferral=defer,
                       uploads=staged[b])
            bar.update()
    out = {}
    for b, (steps, forwards) in pooled.items():
        host = [s - f for s, f in zip(steps, forwards, strict=True)]
        out[b] = dict(steps=len(steps), host_ms_p20=1e3 * quantile(host, STEP_QUANTILE),
                      host_ms_median=1e3 * statistics.median(host),
                      step_ms_median=1e3 * statistics.median(steps),
                      forward_ms_median=1e3 * statistics.median(forwards))
        out[b]["host_us_per_row"] = 1e3 * out[b]["host_ms_median"] / b
        out[b]["stage_ms_median"] = {name: 1e3 * statistics.median(v) for name, v in by_stage[b].items()}
        out[b]["critical_ms_p20"] = 1e3 * quantile(by_stage[b][CRITICAL], STEP_QUANTILE)
        if staged[b] and any(n for _, n in staged[b]):
            out[b]["staged_copies_max"] = max(c for c, _ in staged[b])
            out[b]["staged_tensors_median"] = statistics.median(n for _, n in staged[b])
    return out


def profile_outside(engine: Engine, b: int, max_new: int, top: int = 25, load: Load = Load()) -> str:
    """cProfile's top functions by internal time over the steady steps of one batch of `b` turns (the
    forward's own functions are listed too: read the engine's)."""
    profiler = cProfile.Profile()
    host_steps(engine, load.batch(engine, b, 7), max_new, profiler, deferral=load.deferral)
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(top)
    return stream.getvalue()


def text_costs(positions: Sequence[int], repeats: int) -> list[dict]:
    """Microseconds of one generated token's text at each answer position: the whole answer decoded again
    and the incremental window (best of `repeats` rounds of 50 calls each)."""
    formatter = ChatFormatter.from_checkpoint(TOKENIZER)
    base = formatter.encode(ANSWER)
    ids = (base * (max(positions) // len(base) + 1))[:max(positions)]
    rows = []
    for n in positions:
        answer = ids[:n]

        def whole(answer: list[int] = answer) -> None:
            formatter.decode(answer)

        def window(answer: list[int] = answer) -> None:
            text = IncrementalText(formatter.decode)
            text.prefix, text.read = len(answer) - 2, len(answer) - 1   # as after token n - 1's text
            text.delta(answer)
        rows.append(dict(position=n, whole_us=_best_us(whole, repeats), incremental_us=_best_us(window, repeats)))
    return rows


def _best_us(call, repeats: int, calls: int = 50) -> float:
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - t) / calls)
    return 1e6 * best


def text_table(rows: list[dict], b: int) -> str:
    lines = [f"| answer tokens so far | whole answer decoded, µs / token | incremental, µs / token | ratio | "
             f"ms / step at B = {b}, whole / incremental |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['position']} | {r['whole_us']:.1f} | {r['incremental_us']:.1f} | "
                     f"{r['incremental_us'] / r['whole_us']:.3f} | {b * r['whole_us'] / 1e3:.2f} / "
                     f"{b * r['incremental_us'] / 1e3:.2f} |")
    return "\n".join(lines)


def table(results: dict[str, dict[int, dict]]) -> str:
    """The host time per step; on the GPU path, also its staged copies to the device (the most any steady step
    made) and the tensors they carried (median)."""
    staged = any("staged_copies_max" in r for by_b in results.values() for r in by_b.values())
    extra = " staged copies, max (tensors) |" if staged else ""
    lines = ["| family | B | host ms / step, p20 | median | µs per row | forward ms (median) | step ms (median) |"
             + extra, "|---|---|---|---|---|---|---|" + ("---|" if staged else "")]
    for family, by_b in results.items():
        for b, r in by_b.items():
            copies = f" {r.get('staged_copies_max', 0)} ({r.get('staged_tensors_median', 0):.0f}) |" if staged else ""
            lines.append(f"| {family} | {b} | {r['host_ms_p20']:.2f} | {r['host_ms_median']:.2f} | "
                         f"{r['host_us_per_row']:.0f} | {r['forward_ms_median']:.2f} | {r['step_ms_median']:.2f} |"
                         + copies)
    return "\n".join(lines)


def stage_table(results: dict[str, dict[int, dict]]) -> str:
    """The host time by stage (`STAGES`; medians over a round's steady steps), the critical path's (p20 and
    median) and, of the inputs, the CPU twin's device work (`DEVICE`, median)."""
    lines = ["| family | B | " + " | ".join(f"{name} ms" for name in STAGES)
             + f" | {CRITICAL} ms, p20 / median | of the inputs, {DEVICE} ms |",
             "|---|---|" + "---|" * (len(STAGES) + 2)]
    for family, by_b in results.items():
        for b, r in by_b.items():
            stages = r["stage_ms_median"]
            lines.append(f"| {family} | {b} | " + " | ".join(f"{stages[name]:.2f}" for name in STAGES)
                         + f" | {r['critical_ms_p20']:.2f} / {stages[CRITICAL]:.2f} | {stages[DEVICE]:.2f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds of 16 new tokens (~1 min)")
    ap.add_argument("--bs", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--max-new", type=int, default=None)
    ap.add_argument("--size", choices=("bench", "tiny"), default="bench",
                    help="the checkpoint: tiny's forward leaves more of the caches warm")
    ap.add_argument("--profile", action="store_true", help="cProfile's top functions at the largest B")
    ap.add_argument("--backend", default=None, help="the op backend (EngineConfig.backend): flex is the GPU "
                    "path's CPU twin, whose host work (its attention layout) is the GPU path's")
    ap.add_argument("--graphs", action="store_true", help="with --backend flex: decode steps padded and run "
                    "over static batches, as graph replays are (eagerly: the host work of the graph path)")
    ap.add_argument("--plan-ahead", action="store_true", help="stage each decode step while the last one's "
                    "forward runs, as on a GPU (EngineConfig.plan_ahead; the GPU path's backends)")
    ap.add_argument("--stub-forward", action="store_true", help="the model's forward returns zero logits at "
                    "once: the host work of a step whose forward is a device's graph replay (text turns only)")
    ap.add_argument("--images", type=int, default=0, metavar="SIDE",
                    help="an image of SIDE² tokens in each turn, its deferred rows fused into the decode steps")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.stub_forward and args.images:
        ap.error("--stub-forward times text turns only: deferred rows read the forward's GDN factors")
    args.repeats = args.repeats or (2 if args.quick else 3)
    # with images, past the 16-token guard: the steps after it carry the chunks
    args.max_new = args.max_new or (16 if args.quick else 32) + (32 if args.images else 0)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_torch(1)
    results, profiles = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            engine = build_engine(family, Path(tmp), prefix_cache=True, size=args.size,     # a slot per session
                                  max_gdn_slots=2 * max(args.bs) + 8, backend=args.backend,   # and per join
                                  plan_ahead=args.plan_ahead or None)
            if args.graphs:
                engine.use_step_graphs(False)
            load = Load(args.images)
            with stub_forward(engine) if args.stub_forward else nullcontext():
                results[family] = measure(engine, args.bs, args.repeats, args.max_new, family, load)
                if args.profile:
                    profiles[family] = profile_outside(engine, max(args.bs), args.max_new, load=load)
    texts = text_costs(POSITIONS, args.repeats) if (TOKENIZER / "tokenizer.json").is_file() and not args.images \
        else []
    cmd = " ".join(["python -m bench.host", *(argv if argv is not None else sys.argv[1:])])
    turns = f"{TEXT}-token text turns" + (f" around a {args.images}² image, raincheck" if args.images else "")
    backend = (f", the {args.backend} backend" if args.backend else "") + (", graph path" if args.graphs else "") \
        + (", forward stubbed" if args.stub_forward else "") + (", steps staged ahead" if args.plan_ahead else "")
    print(f"\n`{cmd}`: the {args.size} checkpoint{backend}, {turns}, {args.max_new} new tokens, one thread, "
          f"{args.repeats} rounds; "
          f"goal: host time at B = {max(args.bs)} <= {GOAL_MS} ms, or on the critical path (the rest runs beside "
          f"the forward on a device)\n")
    print(table(results))
    print(f"\nBy stage (thread CPU ms, medians of the steady steps of a round of their own):\n\n"
          f"{stage_table(results)}")
    if texts:
        print(f"\nA token's text (the demo-v2 tokenizer, an English answer), best of {args.repeats}:\n")
        print(text_table(texts, max(args.bs)))
    for family, text in profiles.items():
        print(f"\ncProfile, {family}, B = {max(args.bs)} (the forward's own functions included):\n{text}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(command=cmd, results=results, text=texts), indent=2))


if __name__ == "__main__":
    main()
