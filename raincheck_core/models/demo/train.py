"""Train the demo VLM from scratch on the world's dialogues and save it as a Hugging Face folder.

    python -m raincheck_core.models.demo.train [--out models/demo] [--minutes 30] [--seed 0]

Seeded and single-threaded (the run takes the same steps whatever the machine's speed: `--steps`;
`--minutes` only caps the wall time). Teacher-forced on the exact token layout the engine builds
(`data.layout`), loss on the answers only; a distractor curriculum and position-preserving visual-token
dropout shape what each example shows (`batch.Views`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from . import batch as B
from .config import model_config, save_processor_files
from .data import formatter, layout
from .world import KINDS, make_dialogue

TRAIN_SEED_OFFSET = 1_000_003   # training dialogues come from seed + offset; held-out seeds stay below it
VALIDATION_SEED = 77


def examples(rng: random.Random, fmt, n: int, kinds: tuple[str, ...]) -> tuple[list, list]:
    dialogues = [make_dialogue(rng, kinds=kinds) for _ in range(n)]
    return [d.scene for d in dialogues], [(d, layout(fmt, d)) for d in dialogues]


@torch.no_grad()
def evaluate(model, fmt, n: int = 64, seed: int = VALIDATION_SEED, kinds: tuple[str, ...] = KINDS,
             retention: float = 1.0, batch_size: int = 16) -> dict:
    """Teacher-forced exact match (= greedy exact match given the gold history) per kind and per turn;
    `retention` < 1 drops a random part of the visual tokens (position-preserving), as `hard` would."""
    model.eval()
    rng = random.Random(seed)
    hits: dict[str, list[int]] = defaultdict(list)
    for _ in range(0, n, batch_size):
        scenes, pairs = examples(rng, fmt, batch_size, kinds)
        rows = []
        for _, lay in pairs:
            keep = torch.ones(len(lay.ids), dtype=torch.bool)
            nv = len(lay.visual_rows)
            dropped = rng.sample(range(nv), nv - math.ceil(retention * nv))
            keep[lay.visual_rows[dropped]] = False
            rows.append(torch.nonzero(keep).flatten())
        batch = B.collate(scenes, [lay for _, lay in pairs], rows)
        pred = B.forward(model, batch).argmax(-1)
        for i, (dialogue, lay) in enumerate(pairs):
            r = rows[i]
            for t, (q, (s, e)) in enumerate(zip(dialogue.questions, lay.answers, strict=True)):
                at = torch.nonzero((r >= s - 1) & (r < e - 1)).flatten()
                ok = bool((pred[i, at] == batch.targets[i, at]).all())
                hits[q.kind].append(ok)
                hits[f"T{min(t + 1, 3)}"].append(ok)
                hits["all"].append(ok)
    model.train()
    return {k: sum(v) / len(v) for k, v in sorted(hits.items())}


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def train(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed + TRAIN_SEED_OFFSET)
    kinds = tuple(args.kinds.split(","))
    fmt = formatter()
    model = __import__("transformers").Qwen3_5ForConditionalGeneration(model_config())
    if not args.vit_position:
        with torch.no_grad():
            model.model.visual.pos_embed.weight.zero_()
        model.model.visual.pos_embed.weight.requires_grad_(False)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    views = B.Views(curriculum=args.curriculum)
    t0 = time.perf_counter()
    bar = tqdm(range(args.steps), desc="train", dynamic_ncols=True)
    log = []
    for step in bar:
        progress = step / args.steps
        scenes, pairs = examples(rng, fmt, args.batch, kinds)
        rows = [B.choose_rows(lay, progress, views, rng) for _, lay in pairs]
        batch = B.collate(scenes, [lay for _, lay in pairs], rows)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss = B.loss_fn(B.forward(model, batch), batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if args.eval_every and (step + 1) % args.eval_every == 0:
            acc = evaluate(model, fmt, args.eval_n, kinds=kinds)
            log.append({"step": step + 1, "minutes": (time.perf_counter() - t0) / 60, "loss": loss.item(), **acc})
            tqdm.write(json.dumps(log[-1]))
        if time.perf_counter() - t0 > args.minutes * 60:
            tqdm.write(f"stopping at step {step + 1}: --minutes {args.minutes} reached")
            break
    final = evaluate(model, fmt, args.final_n, kinds=kinds)
    summary = {"args": vars(args), "wall_minutes": (time.perf_counter() - t0) / 60, "steps_run": step + 1,
               "validation": final, "log": log}
    tqdm.write(json.dumps(final))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(out, safe_serialization=True)
    save_processor_files(out)
    (out / "training_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="models/demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--curriculum", type=float, default=0.4)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--vit-position", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--minutes", type=float, default=40.0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-n", type=int, default=64)
    p.add_argument("--final-n", type=int, default=256)
    return p.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
