"""Every answer of a few arms on held-out demo dialogues, for an exact comparison between two checkouts.

The engine is exact: a change that is not meant to change the model's arithmetic beyond fp32 rounding
(a new kernel, a new step layout) must give the same greedy answers. This dumps them, then compares:

    python -m bench.answers --model models/demo-v2 --families single,multi --dialogues 40 --json A.json
    (in the other checkout, the same with --json B.json)
    python -m bench.answers --compare A.json B.json

With `--speculative-method ngram|mtp --speculative-tokens K` the same engine verifies drafts: under `full`
and `hard` greedy answers must be the same as with speculation off (docs/mechanism.md §13; `--arms
full,hard/hiprune` runs only those); under raincheck a verify step changes which tokens see a fused chunk,
so its answers may differ.

Arms: full; hard and raincheck with HiPrune; raincheck and post_answer with MMTok (the model's selector
options). Raincheck runs with a fixed schedule (`tpot_slo=None`, 31-row chunks): at the default TPOT
objective, which chunks ride on which decode step follows measured step times, so two runs may fuse
differently and join GDN states that differ at the 1e-7 level.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tqdm import tqdm

from raincheck_core import Engine
from raincheck_core.speculative.config import METHODS, SpeculativeConfig

from . import quality

ARMS = (("full", "full", "mmtok"), ("hard/hiprune", "hard", "hiprune"), ("raincheck/hiprune", "raincheck", "hiprune"),
        ("raincheck/mmtok", "raincheck", "mmtok"), ("post_answer/mmtok", "post_answer", "mmtok"))


def dump(model: str, families: list[str], dialogues: int, arms: list[str] | None = None,
         speculative: SpeculativeConfig | None = None, plan_ahead: bool | None = None
         ) -> dict[str, dict[str, list[list[str]]]]:
    """{family: {arm: per dialogue, per turn, the answer text}}; `arms`: by name (None: all); `plan_ahead`:
    `EngineConfig.plan_ahead` (decode steps staged during the last one's forward, where the backend stages)."""
    engine = Engine.from_pretrained(model, num_threads=1, speculative=speculative or SpeculativeConfig(),
                                    plan_ahead=plan_ahead)
    out: dict[str, dict[str, list[list[str]]]] = {}
    for family in families:
        held_out = quality.held_out(family, dialogues)
        messages = [[d.message(t) for t in range(len(d.questions))] for d in held_out]
        out[family] = {}
        for name, policy, selector in ARMS:
            if arms is not None and name not in arms:
                continue
            cfg = dataclasses.replace(quality.Arm(name, policy, selector).config(engine.selector_options),
                                      tpot_slo=None)
            out[family][name] = [quality.run_engine_arm(engine, cfg, d, m) for d, m in
                                 tqdm(list(zip(held_out, messages, strict=True)), desc=f"{family} {name}", leave=False)]
    ahead = engine.ahead_counts
    if ahead.staged:
        print(f"decode steps staged ahead: {ahead.launched} launched ({ahead.void_rows} rows void: their turn had "
              f"ended), {ahead.dropped} dropped", file=sys.stderr)
    prefix = engine.prefix_stats()
    if prefix is not None:     # the arms share sessions' prefixes (the same dialogue under another policy)
        print(f"prefix cache: {prefix.hits} hits, {prefix.hit_tokens} prompt tokens served", file=sys.stderr)
    return out


def compare(a: dict, b: dict) -> tuple[int, list[str]]:
    """The number of answers compared and a line per difference (or per arm/family only one side has)."""
    total, diffs = 0, []
    for family in sorted(set(a) | set(b)):
        for arm in sorted(set(a.get(family, {})) | set(b.get(family, {}))):
            if arm not in a.get(family, {}) or arm not in b.get(family, {}):
                diffs.append(f"{family} {arm}: only in one report")
                continue
            for i, (da, db) in enumerate(zip(a[family][arm], b[family][arm], strict=True)):
                for t, (x, y) in enumerate(zip(da, db, strict=True)):
                    total += 1
                    if x != y:
                        diffs.append(f"{family} {arm} dialogue {i} turn {t}: {x!r} != {y!r}")
    return total, diffs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/demo-v2")
    p.add_argument("--families", default="single,multi")
    p.add_argument("--dialogues", type=int, default=40)
    p.add_argument("--json", type=Path, help="where to write the answers")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two reports instead")
    p.add_argument("--arms", help=f"comma-separated, of {', '.join(a for a, _, _ in ARMS)} (default: all)")
    p.add_argument("--speculative-method", choices=METHODS, help="verify drafts of this drafter (default: off)")
    p.add_argument("--speculative-tokens", type=int, default=3, help="drafts per step with --speculative-method")
    p.add_argument("--plan-ahead", action="store_true", help="stage each decode step during the last one's forward "
                   "(EngineConfig.plan_ahead; the GPU path's backends: RAINCHECK_BACKEND=flex on a CPU)")
    args = p.parse_args(argv)
    if args.compare:
        total, diffs = compare(*(json.loads(path.read_text()) for path in args.compare))
        print("\n".join(diffs))
        print(f"{total} answers compared, {len(diffs)} different")
        sys.exit(1 if diffs else 0)
    if args.json is None:
        p.error("--json PATH is required (or --compare A B)")
    arms = args.arms.split(",") if args.arms else None
    unknown = set(arms or ()) - {a for a, _, _ in ARMS}
    if unknown:
        p.error(f"unknown arms: {', '.join(sorted(unknown))}")
    speculative = SpeculativeConfig(args.speculative_method, args.speculative_tokens) if args.speculative_method \
        else None
    out = dump(args.model, args.families.split(","), args.dialogues, arms, speculative, args.plan_ahead or None)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {sum(len(d) for f in out.values() for a in f.values() for d in a)} answers to {args.json}")


if __name__ == "__main__":
    main()
