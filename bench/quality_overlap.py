"""How much the selectors' choices overlap: the Jaccard index of the visual rows two selectors keep.

For every turn that brings visuals (first dialogues of a family), each selector partitions the engine's own
turn input at the benchmark's retention (`partition_turn`, as a session does), and every pair of selectors
is compared visual by visual: |A ∩ B| / |A ∪ B| of the kept rows. Two selectors that keep the same rows
are one selection counted twice in a mean over selectors.

Run alone, it also calibrates HiPrune's layers for the model (docs/selectors.md §5): the mean spatial
spread of each recorded ViT layer's top attention-received tokens, and the layers it implies:

    python -m bench.quality_overlap --model models/demo-v2 [--dialogues 40] [--write] [--options JSON] [--json PATH]

`--write` stores the calibrated layers in the model folder (`selector_options.json`); the overlap is then
measured with the options the folder ships, updated by `--options` (e.g. '{"hiprune": {"alpha": 1.0}}').
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
import torch

from raincheck_core import DeferralConfig, Engine, Message
from raincheck_core.deferral.partition import partition_turn
from raincheck_core.pruning.hiprune import calibrated_layers, spatial_spread
from raincheck_core.pruning.settings import save_selector_options
from raincheck_demo.world import FAMILIES

from .quality_control import turn_input


def _visual_turns(messages: list[list[Message]]):
    """(message, first_turn) for every turn of `messages` (one list per dialogue) that brings visuals."""
    for turns in messages:
        for t, message in enumerate(turns):
            if message.images or message.videos:
                yield message, t == 0


def kept_rows(engine: Engine, message: Message, first_turn: bool, selectors: tuple[str, ...], retention: float,
              options: dict[str, dict]) -> dict[str, list[set[int]]]:
    """Per selector (with its `options`), per visual of the turn: the rows (of the turn input) it keeps."""
    out = {}
    for sel in selectors:
        cfg = DeferralConfig("hard", selector=sel, selector_options=options.get(sel, {}), retention=retention)
        full, visuals = turn_input(engine, message, first_turn, cfg)
        keep = set(partition_turn(full, visuals, cfg, engine.model_config.spatial_merge_size).keep_rows.tolist())
        out[sel] = [keep & set(span.token_indices.tolist()) for span in full.layout.spans]
    return out


def jaccard(a: set[int], b: set[int]) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def measure(engine: Engine, messages: list[list[Message]], selectors: tuple[str, ...], retention: float,
            options: dict[str, dict] | None = None, threshold: float = 0.8) -> dict:
    """Over every turn of `messages` (one list per dialogue) that brings visuals, per pair "a/b" of
    selectors: mean, max and share above `threshold` of the Jaccard index of the rows kept per visual."""
    values: dict[str, list[float]] = {f"{a}/{b}": [] for a, b in itertools.combinations(selectors, 2)}
    with torch.no_grad():
        for message, first_turn in _visual_turns(messages):
            kept = kept_rows(engine, message, first_turn, selectors, retention, options or {})
            for a, b in itertools.combinations(selectors, 2):
                values[f"{a}/{b}"] += [jaccard(x, y) for x, y in zip(kept[a], kept[b], strict=True)]
    return {pair: {"mean": float(np.mean(v)), "max": float(np.max(v)), "visuals": len(v),
                   f"above_{threshold}": float(np.mean(np.array(v) > threshold))} for pair, v in values.items()}


def layer_spread(engine: Engine, messages: list[list[Message]]) -> dict[str, float]:
    """Per recorded ViT layer: the mean `spatial_spread` of its attention-received scores over the visuals."""
    cfg = DeferralConfig("hard", selector="hiprune")   # any selector that asks the tower for attention
    merge = engine.model_config.spatial_merge_size
    spreads: dict[str, list[float]] = {}
    with torch.no_grad():
        for message, first_turn in _visual_turns(messages):
            for visual in turn_input(engine, message, first_turn, cfg)[1]:
                t, h, w = visual.grid_thw
                for layer, score in visual.attention_received.items():
                    spreads.setdefault(layer, []).append(spatial_spread(score, (t, h // merge, w // merge)))
    return {layer: float(np.mean(v)) for layer, v in spreads.items()}


def main(argv: list[str] | None = None) -> dict:
    from .quality import DEFAULT, PAPER_SELECTORS, held_out

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/demo-v2")
    p.add_argument("--dialogues", type=int, default=40, help="held-out dialogues per family (bench.quality's first)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--write", action="store_true", help="store the calibrated HiPrune layers in the model folder")
    p.add_argument("--options", type=json.loads, default={},
                   help="selector options over the folder's for the overlap, as JSON {selector: {option: value}}")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    engine = Engine.from_pretrained(args.model, num_threads=args.threads)
    messages = {f: [[d.message(t) for t in range(len(d.questions))] for d in held_out(f, args.dialogues)]
                for f in FAMILIES}
    spread = {f: layer_spread(engine, m) for f, m in messages.items()}
    mean_spread = {layer: float(np.mean([s[layer] for s in spread.values()])) for layer in spread[FAMILIES[0]]}
    calibrated = calibrated_layers(mean_spread)
    print(f"mean spread of the top 10% attention-received tokens per layer (merged cells): {spread}")
    print(f"calibrated HiPrune layers: {calibrated}")
    options = dict(engine.selector_options)
    if args.write:
        options["hiprune"] = {**options.get("hiprune", {}), **calibrated}
        print(f"wrote {save_selector_options(args.model, options)}")
    for name, opts in args.options.items():
        options[name] = {**options.get(name, {}), **opts}
    overlap = {f: measure(engine, m, PAPER_SELECTORS, DEFAULT[1], options) for f, m in messages.items()}
    print(f"\nselector options: {options}\n\n| pair | " + " | ".join(f"{f} mean / max" for f in FAMILIES) + " |")
    print("|---|" + "---|" * len(FAMILIES))
    for pair in overlap[FAMILIES[0]]:
        print(f"| {pair} | " + " | ".join(f"{overlap[f][pair]['mean']:.3f} / {overlap[f][pair]['max']:.3f}"
                                          for f in FAMILIES) + " |")
    out = {"model": args.model, "dialogues": args.dialogues, "layer_spread": spread, "calibrated": calibrated,
           "selector_options": options, "overlap": overlap}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
