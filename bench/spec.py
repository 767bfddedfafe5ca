"""Speculative decoding with n-gram and MTP drafts (docs/mechanism.md §13): decode speed with and without it.

    python -m bench.spec [--quick] [--repeats N] [--max-new T] [--threads N] [--models M ...] [--json PATH]

Per model and setting, one session per turn, greedy, each arm once per round (the order reversed every
other round): speculation off; n-gram drafts, k = 1, 2, 3 per step; on demo-v2 its trained MTP head's
drafts, k = 1, 2, 3; and a replay of the answer speculation off gave the same prompts (`BenchDrafter`),
k = 1, 2, 3: every draft right wherever the answer is the same, so its TPOT is what verify rows cost at full
acceptance, the most any drafter could save on this machine. Models: the demo model
(models/demo-v2, a single-image dialogue whose every turn asks for a list of the scene's objects: its
longest answers, whose words repeat the earlier lists') and the
random `bench` checkpoints of both families (an image prompt; a random model's greedy answer falls into
loops, which the n-gram drafter continues). Settings: `full` (no deferred rows in flight) and `raincheck`
(fixed chunks fused from the first decode step, `tpot_slo=None`: deferred rows in flight beside the
verify rows; on Qwen3.5 a turn with its GDN join pending carries drafts or a chunk in a step, whichever
is worth more: docs/mechanism.md §13, so there the replay tries first the answer decoded with no chunk
riding on it, which a turn whose drafts are always right decodes). Reported per
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
import dataclasses
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from raincheck_core import Engine, Message, Prompt, SamplingParams, TurnMetrics
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.models.random_init import save_random_checkpoint
from raincheck_core.speculative.config import SpeculativeConfig
from raincheck_core.speculative.mtp import MtpDrafter
from raincheck_core.speculative.ngram import NgramDrafter

from .common import image_prompt, setup_torch, use_clock

# (label, drafter, drafts per step): speculation off, the n-gram drafter, and a replay of the answer
# speculation off gave (acceptance 1 wherever the answer is the same: what verify rows cost when every draft
# is right, the most any drafter could save)
ARMS = (("off", None, None), *((f"ngram k={k}", "ngram", k) for k in (1, 2, 3)),
        *((f"replay k={k}", "replay", k) for k in (1, 2, 3)))
MTP_ARMS = tuple((f"mtp k={k}", "mtp", k) for k in (1, 2, 3))     # a checkpoint with a head (demo-v2)
POLICIES = {"full": DeferralConfig("full"),
            "raincheck": DeferralConfig("raincheck", selector="uniform", tpot_slo=None, guard=0, chunk_size=7)}
V2 = Path(__file__).resolve().parents[1] / "models" / "demo-v2"
MODELS = ("demo-v2", "qwen3_vl", "qwen3_5")      # the demo model, the `bench` checkpoints by family


@dataclass
class Turn:
    metrics: TurnMetrics
    steps: int                     # decode steps after the first token
    answer: list[int]


class BenchDrafter:
    """The n-gram drafter (`mode` "ngram"), the checkpoint's MTP head (`mode` "mtp", once `mtp` is set: it
    observes every arm's kept rows, so its K/V are current whichever arm runs), or a replay of `answers`
    (`mode` "replay": the next k tokens of the answer the history ends in the middle of)."""

    def __init__(self, mtp: bool = False) -> None:
        self.ngram = NgramDrafter(SpeculativeConfig("ngram"))
        self.mtp: MtpDrafter | None = None
        self.needs_hidden = mtp                 # read by the engine when it is built
        self.mode = "ngram"
        self.answers: list[list[int]] = []

    def observe(self, session: str, next_tokens: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None) -> None:
        if self.mtp is not None:
            self.mtp.observe(session, next_tokens, positions, hidden)

    def propose(self, session: str, history: Sequence[int], k: int) -> list[int]:
        if self.mode == "ngram":
            return self.ngram.propose(session, history, k)
        if self.mode == "mtp":
            return self.mtp.propose(session, history, k) if self.mtp is not None else []
        tail = list(history[-max(map(len, self.answers), default=0):])
        for g in range(len(tail), 0, -1):       # the longest start of an answer the history ends with
            for answer in self.answers:
                if tail[len(tail) - g:] == answer[:g]:
                    return answer[g:g + k]
        return []

    def rollback(self, session: str, length: int) -> None:
        if self.mtp is not None:
            self.mtp.rollback(session, length)

    def release(self, session: str) -> None:
        if self.mtp is not None:
            self.mtp.release(session)


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
            out.append(Turn(end.metrics, steps[0] - before, end.token_ids))
    finally:
        remove()
        session.close()
    return out


def measure(engine: Engine, drafter: BenchDrafter, prompts: list[Prompt | Message], repeats: int,
            params: SamplingParams) -> dict:
    """Policy -> arm -> medians (keys as in the module docstring); `drafter`: the engine's."""
    use_clock(engine, time.perf_counter)
    arms = ARMS + (MTP_ARMS if drafter.mtp is not None else ())
    out = {}
    for name, cfg in POLICIES.items():
        engine.speculate(None)
        drafter.answers = [t.answer for t in run_turns(engine, prompts, cfg, params)]     # and a warm-up
        if cfg.policy == "raincheck" and engine.model_config.num_gdn_layers:
            # a hybrid turn whose drafts are always right carries them instead of its chunks while D is
            # pending (docs/mechanism.md §13): its answer is the one no chunk rides on, tried first
            late = dataclasses.replace(cfg, guard=params.max_new_tokens)
            drafter.answers = [t.answer for t in run_turns(engine, prompts, late, params)] + drafter.answers
        runs: dict[str, list[list[Turn]]] = {label: [] for label, _, _ in arms}
        for r in range(repeats):
            for label, mode, k in arms if r % 2 == 0 else reversed(arms):
                drafter.mode = mode or drafter.mode
                engine.speculate(k)
                runs[label].append(run_turns(engine, prompts, cfg, params))
        out[name] = {label: summary(turns, runs["off"]) for label, turns in runs.items()}
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
    drafter = BenchDrafter()
    options = dict(prefix_cache=False, speculative=SpeculativeConfig("ngram"), drafter=drafter)
    results = {}
    if "demo-v2" in args.models and (V2 / "model.safetensors").is_file():
        with_head = BenchDrafter(mtp=True)       # demo-v2 ships a trained MTP head
        engine = Engine.from_pretrained(V2, **{**options, "drafter": with_head})
        with_head.mtp = MtpDrafter.from_checkpoint(V2, engine.model, engine.config)
        results["demo-v2"] = measure(engine, with_head, demo_prompts(2 if args.quick else 3), args.repeats,
                                     SamplingParams(max_new_tokens=args.max_new))
    with tempfile.TemporaryDirectory() as tmp:
        for family in (m for m in MODELS[1:] if m in args.models):
            folder = save_random_checkpoint(Path(tmp) / family, family, "bench")
            engine = Engine.from_pretrained(folder, max_rows_per_step=4096, **options)
            # a random model's answer runs to the limit
            results[f"bench {family}"] = measure(engine, drafter, [image_prompt(engine, args.side)], args.repeats,
                                                 SamplingParams(max_new_tokens=args.max_new, ignore_eos=True))
    print(f"Speculative decoding, n-gram and MTP drafts ({args.max_new}-token answers, median of {args.repeats} "
          f"rounds, {args.threads} thread(s)):\n\n{table(results)}")
    if args.json:
        args.json.write_text(json.dumps({"spec": results, "args": vars(args) | {"json": str(args.json)}}, indent=2))


if __name__ == "__main__":
    main()
