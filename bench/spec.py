"""Speculative decoding with n-gram drafts (docs/mechanism.md §13): decode speed with and without it.

    python -m bench.spec [--quick] [--repeats N] [--max-new T] [--threads N] [--models M ...] [--json PATH]

Per model and setting, one session per turn, greedy, each arm once per round (the order reversed every
other round): speculation off, and on with k = 1, 2, 3 draft tokens per step. Models: the demo model
(models/demo-v2, a single-image dialogue whose every turn asks for a list of the scene's objects: its
longest answers, whose words repeat the earlier lists') and the
random `bench` checkpoints of both families (an image prompt; a random model's greedy answer falls into
loops, which the n-gram drafter continues). Settings: `full` (no deferred rows in flight) and `raincheck`
(fixed chunks fused from the first decode step, `tpot_slo=None`: deferred rows in flight beside the
verify rows; on Qwen3.5 a turn with its GDN join pending decodes plainly until D is in). Reported per
arm: the medians of the answer's mean TPOT and decode tokens/s (tokens after the first over the time
after the first), the ratio of each to speculation off in the same round, the drafts' acceptance rate
(accepted / verified) and tokens emitted per decode step. Greedy answers are the same in every arm of
`full` (tests/engine/test_speculative.py); this measures only time.

On a CPU a verify row costs about what a decode row costs (every row is arithmetic), so k drafts pay off
only where acceptance is high; on a GPU a decode step is memory-bound and k + 1 rows cost about one, so
every accepted draft is nearly a free token (the device run is expected to show that).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from raincheck_core import Engine, Message, Prompt, SamplingParams, TurnMetrics
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.models.random_init import save_random_checkpoint
from raincheck_core.speculative.config import SpeculativeConfig

from .common import image_prompt, setup_torch, use_clock

ARMS = (None, 1, 2, 3)             # drafts per step; None: speculation off
POLICIES = {"full": DeferralConfig("full"),
            "raincheck": DeferralConfig("raincheck", selector="uniform", tpot_slo=None, guard=0, chunk_size=7)}
V2 = Path(__file__).resolve().parents[1] / "models" / "demo-v2"
MODELS = ("demo-v2", "qwen3_vl", "qwen3_5")      # the demo model, the `bench` checkpoints by family


@dataclass
class Turn:
    metrics: TurnMetrics
    steps: int                     # decode steps after the first token


def run_turns(engine: Engine, prompts: list[Prompt | Message], cfg: DeferralConfig, params: SamplingParams
              ) -> list[Turn]:
    session = engine.open_session(deferral=cfg)
    steps = [0]
    remove = engine.on_step(lambda s: steps.__setitem__(0, steps[0] + (s.decode_rows > 0)))
    out = []
    try:
        for prompt in prompts:
            before = steps[0]
            end = session.turn(prompt, params).result()
            # the step that drew the first token is a prefill step without decode rows
            out.append(Turn(end.metrics, steps[0] - before))
    finally:
        remove()
        session.close()
    return out


def measure(engine: Engine, prompts: list[Prompt | Message], repeats: int, params: SamplingParams) -> dict:
    """Policy -> arm -> medians (keys as in the module docstring)."""
    use_clock(engine, time.perf_counter)
    out = {}
    for name, cfg in POLICIES.items():
        engine.speculate(None)
        run_turns(engine, prompts, cfg, params)        # warm-up
        runs: dict[int | None, list[list[Turn]]] = {k: [] for k in ARMS}
        for r in range(repeats):
            for k in ARMS if r % 2 == 0 else reversed(ARMS):
                engine.speculate(k)
                runs[k].append(run_turns(engine, prompts, cfg, params))
        out[name] = {("off" if k is None else f"k={k}"): summary(turns, runs[None]) for k, turns in runs.items()}
    engine.speculate(None)
    return out


def summary(rounds: list[list[Turn]], off: list[list[Turn]]) -> dict:
    def tpot(turns: list[Turn]) -> float:
        tokens = sum(t.metrics.generated_tokens - 1 for t in turns)
        return sum(t.metrics.tpot_s * (t.metrics.generated_tokens - 1) for t in turns) / max(tokens, 1)

    def med(get: Callable[[list[Turn]], float]) -> float:
        return statistics.median(get(turns) for turns in rounds)

    proposed = sum(t.metrics.drafts_proposed for turns in rounds for t in turns)
    accepted = sum(t.metrics.drafts_accepted for turns in rounds for t in turns)
    steps = sum(t.steps for turns in rounds for t in turns)
    tokens = sum(t.metrics.generated_tokens - 1 for turns in rounds for t in turns)
    return {"tpot_s": med(tpot), "tokens_per_s": med(lambda turns: 1 / tpot(turns)),
            "tpot_ratio": statistics.median(tpot(a) / tpot(b) for a, b in zip(rounds, off, strict=True)),
            "acceptance": accepted / proposed if proposed else None,
            "tokens_per_step": tokens / steps if steps else None, "drafts": proposed}


def demo_prompts(turns: int) -> list[Message]:
    from raincheck_demo.world import make_dialogue

    d = make_dialogue(random.Random(41), turns=turns, kinds=("list",))     # its longest answers
    return [d.message(t) for t in range(turns)]


def table(results: dict) -> str:
    lines = ["| model | policy | arm | mean TPOT ms | tokens/s | TPOT / off | acceptance | tokens per step |",
             "|---|---|---|---|---|---|---|---|"]
    for model, policies in results.items():
        for policy, arms in policies.items():
            for arm, r in arms.items():
                acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
                per_step = "-" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}"
                lines.append(f"| {model} | {policy} | {arm} | {1e3 * r['tpot_s']:.2f} | {r['tokens_per_s']:.1f} | "
                             f"{r['tpot_ratio']:.2f} | {acc} | {per_step} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round, short answers, a small image")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--side", type=int, default=16, help="the bench prompts' image side in merged tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.max_new, args.side = 1, 24, 8
    setup_torch(args.threads)
    options = dict(prefix_cache=False, speculative=SpeculativeConfig("ngram", max(k for k in ARMS if k)))
    results = {}
    if "demo-v2" in args.models and (V2 / "model.safetensors").is_file():
        engine = Engine.from_pretrained(V2, **options)
        results["demo-v2"] = measure(engine, demo_prompts(2 if args.quick else 3), args.repeats,
                                     SamplingParams(max_new_tokens=args.max_new))
    with tempfile.TemporaryDirectory() as tmp:
        for family in (m for m in MODELS[1:] if m in args.models):
            folder = save_random_checkpoint(Path(tmp) / family, family, "bench")
            engine = Engine.from_pretrained(folder, max_rows_per_step=4096, **options)
            # a random model's answer runs to the limit
            results[f"bench {family}"] = measure(engine, [image_prompt(engine, args.side)], args.repeats,
                                                 SamplingParams(max_new_tokens=args.max_new, ignore_eos=True))
    print(f"Speculative decoding, n-gram drafts ({args.max_new}-token answers, median of {args.repeats} rounds, "
          f"{args.threads} thread(s)):\n\n{table(results)}")
    if args.json:
        args.json.write_text(json.dumps({"spec": results, "args": vars(args) | {"json": str(args.json)}}, indent=2))


if __name__ == "__main__":
    main()
