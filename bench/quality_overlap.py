"""How much the selectors' choices overlap: the Jaccard index of the visual rows two selectors keep.

For every turn that brings visuals (first dialogues of a family), each selector partitions the engine's own
turn input at the benchmark's retention (`partition_turn`, as a session does), and every pair of selectors
is compared visual by visual: |A ∩ B| / |A ∪ B| of the kept rows. Two selectors that keep the same rows
are one selection counted twice in a mean over selectors.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from raincheck_core import DeferralConfig, Engine, Message
from raincheck_core.deferral.partition import partition_turn

from .quality_control import turn_input


def kept_rows(engine: Engine, message: Message, first_turn: bool, selectors: tuple[str, ...], retention: float
              ) -> dict[str, list[set[int]]]:
    """Per selector, per visual of the turn: the rows (of the turn input) it keeps."""
    out = {}
    for sel in selectors:
        cfg = DeferralConfig("hard", selector=sel, retention=retention)
        full, visuals = turn_input(engine, message, first_turn, cfg)
        keep = set(partition_turn(full, visuals, cfg, engine.model_config.spatial_merge_size).keep_rows.tolist())
        out[sel] = [keep & set(span.token_indices.tolist()) for span in full.layout.spans]
    return out


def jaccard(a: set[int], b: set[int]) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def measure(engine: Engine, messages: list[list[Message]], selectors: tuple[str, ...], retention: float,
            threshold: float = 0.8) -> dict:
    """Over every turn of `messages` (one list per dialogue) that brings visuals, per pair "a/b" of
    selectors: mean, max and share above `threshold` of the Jaccard index of the rows kept per visual."""
    values: dict[str, list[float]] = {f"{a}/{b}": [] for a, b in itertools.combinations(selectors, 2)}
    with torch.no_grad():
        for turns in messages:
            for t, message in enumerate(turns):
                if not (message.images or message.videos):
                    continue
                kept = kept_rows(engine, message, t == 0, selectors, retention)
                for a, b in itertools.combinations(selectors, 2):
                    values[f"{a}/{b}"] += [jaccard(x, y) for x, y in zip(kept[a], kept[b], strict=True)]
    return {pair: {"mean": float(np.mean(v)), "max": float(np.max(v)), "visuals": len(v),
                   f"above_{threshold}": float(np.mean(np.array(v) > threshold))} for pair, v in values.items()}
