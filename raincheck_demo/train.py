"""Train the demo VLM (v2) from scratch on the world's dialogues and save it as a Hugging Face folder.

    python -m raincheck_demo.train [--out models/demo-v2] [--seed 0] [--steps 1500]

This trains v2 (`models/demo-v2`, the default model: "demo"). v1 (`models/demo`, loadable as "demo-v1") was
written by this module as it stood before issue 17, then at raincheck_core/models/demo/train.py (one vision
block, single-image dialogues, a smaller vocabulary; its model card names the commit).

Seeded and single-threaded (the run takes the same steps whatever the machine's speed: `--steps`;
`--minutes` optionally caps its CPU time). Teacher-forced on the exact token layout the engine builds
(`data.layout`), loss on the answers only, on a mix of the world's three dialogue families (`--families`);
a distractor curriculum and position-preserving visual-token dropout shape what each example shows
(`batch.Views`), and examples are batched with others of similar length (`--bucket`).
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
from transformers import Qwen3_5ForConditionalGeneration

from raincheck_core.multimodal.chat import ChatFormatter

from . import batch as B
from .config import model_config, save_processor_files
from .data import formatter, layout
from .world import (
    FAMILIES,
    FIRST_TURN,
    LATER_TURNS,
    TRAINED_KINDS,
    Dialogue,
    make,
    make_dialogue,
    make_multi_dialogue,
    make_video_dialogue,
)

TRAIN_SEED_OFFSET = 1_000_003   # training dialogues come from seed + offset; held-out seeds stay below it
VALIDATION_SEED = 77


def training_dialogue(rng: random.Random, family: str, progress: float, args: argparse.Namespace) -> Dialogue:
    """Training style: grids growing from 4×4 to 12×12 over the size curriculum (then some 16×16 single
    images), more turns per visual (more answers per visual prefill), any cell in any turn."""
    top = 4 + round(8 * min(1.0, progress / args.size_curriculum))
    first, later = ({**w, "list": w["list"] * args.lists} for w in (FIRST_TURN, LATER_TURNS))
    if family == "multi":
        return make_multi_dialogue(rng, sizes=(4, top), turns=rng.randint(3, args.max_turns), min_gap=1,
                                   first=first, later=later)
    if family == "video":
        return make_video_dialogue(rng, sizes=(4, min(top, 8)), turns=rng.randint(3, args.max_turns), min_gap=1)
    rows = 16 if progress > args.size_curriculum and rng.random() < args.large else rng.randint(4, top)
    cols = rows if rng.random() < 0.5 else rng.randint(max(4, rows - 2), min(16, rows + 2))
    return make_dialogue(rng, rows, cols, turns=rng.randint(3, args.max_turns), kinds=TRAINED_KINDS, min_gap=1,
                         first=first, later=later)


def examples(rng: random.Random, fmt: ChatFormatter, families: list[str], progress: float | None = None,
             args: argparse.Namespace | None = None) -> tuple[list[Dialogue], list]:
    """One dialogue of each of `families` with its layout: held-out style (the benchmark's settings) when
    `progress` is None, else training style."""
    dialogues = [make(f, rng) if progress is None else training_dialogue(rng, f, progress, args) for f in families]
    return dialogues, [layout(fmt, d) for d in dialogues]


@torch.no_grad()
def evaluate(model: Qwen3_5ForConditionalGeneration, fmt: ChatFormatter, n: int = 64, seed: int = VALIDATION_SEED,
             retention: float = 1.0, batch_size: int = 16) -> dict:
    """Teacher-forced exact match (= greedy exact match given the gold history) per family, kind and turn;
    `retention` < 1 drops a random part of the visual tokens (position-preserving), as `hard` would."""
    model.eval()
    rng = random.Random(seed)
    hits: dict[str, list[int]] = defaultdict(list)
    for family in FAMILIES:
        for _ in range(0, n, batch_size):
            dialogues, layouts = examples(rng, fmt, [family] * batch_size)
            rows = []
            for lay in layouts:
                keep = torch.ones(len(lay.ids), dtype=torch.bool)
                nv = len(lay.visual_rows)
                dropped = rng.sample(range(nv), nv - math.ceil(retention * nv))
                keep[lay.visual_rows[dropped]] = False
                rows.append(torch.nonzero(keep).flatten())
            batch = B.collate(dialogues, layouts, rows)
            pred = B.forward(model, batch).argmax(-1)
            for i, (dialogue, lay) in enumerate(zip(dialogues, layouts, strict=True)):
                r = rows[i]
                for t, (q, (s, e)) in enumerate(zip(dialogue.questions, lay.answers, strict=True)):
                    at = torch.nonzero((r >= s - 1) & (r < e - 1)).flatten()
                    ok = bool((pred[i, at] == batch.targets[i, at]).all())
                    for key in (family, f"{family}/{q.kind}", f"{family}/T{min(t + 1, 3)}", "all"):
                        hits[key].append(ok)
    model.train()
    return {k: sum(v) / len(v) for k, v in sorted(hits.items())}


def slow_decay(model: Qwen3_5ForConditionalGeneration) -> None:
    """Start every GDN head with a slow decay (A in [0.02, 0.5] instead of transformers' [0, 16]), so the
    recurrent state remembers the question's words for more than a token or two from the start."""
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            if hasattr(layer, "linear_attn"):
                a_log = layer.linear_attn.A_log
                a_log.copy_(torch.empty_like(a_log).uniform_(0.02, 0.5).log())


def bucketed(rng: random.Random, fmt: ChatFormatter, mix: dict[str, float], progress: float, views: B.Views,
             args: argparse.Namespace) -> list[B.Batch]:
    """The next `args.bucket` batches: that many batches' worth of examples sorted by length and cut into
    batches of similar lengths (less padding: a batch is as wide as its longest example), in random order."""
    families = rng.choices(list(mix), list(mix.values()), k=args.batch * args.bucket)
    dialogues, layouts = examples(rng, fmt, families, progress, args)
    rows = [B.choose_rows(lay, progress, views, rng) for lay in layouts]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    groups = [order[i:i + args.batch] for i in range(0, len(order), args.batch)]
    rng.shuffle(groups)
    return [B.collate([dialogues[i] for i in g], [layouts[i] for i in g], [rows[i] for i in g]) for g in groups]


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def train(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed + TRAIN_SEED_OFFSET)
    mix = dict(zip(FAMILIES, map(float, args.families.split(",")), strict=True))
    fmt = formatter()
    model = Qwen3_5ForConditionalGeneration(model_config())
    if not args.vit_position:
        with torch.no_grad():
            model.model.visual.pos_embed.weight.zero_()
        model.model.visual.pos_embed.weight.requires_grad_(False)
    model.train()
    B.patch_embed_as_matmul(model.model.visual)
    slow_decay(model)
    probes = B.Probes(model.config.text_config.hidden_size, args.position_layer)
    params = [p for p in [*model.parameters(), *probes.parameters()] if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    views = B.Views(curriculum=args.curriculum, deferred_order=args.deferred_order, bands=args.bands)
    t0, cpu0 = time.perf_counter(), time.process_time()
    bar = tqdm(range(args.steps), desc="train", dynamic_ncols=True)
    log = []
    queue: list[B.Batch] = []
    for step in bar:
        if not queue:
            queue = bucketed(rng, fmt, mix, step / args.steps, views, args)
        batch = queue.pop()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        model.set_attn_implementation("eager")
        logits, visual, hidden, attention = B.forward(model, batch, probes=True)
        model.set_attn_implementation("sdpa")
        answer_loss = B.loss_fn(logits, batch)
        aux = probes.losses(visual, hidden, attention, batch)
        loss = answer_loss + args.aux_weight * sum(aux.values())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        bar.set_postfix(loss=f"{answer_loss.item():.3f}", **{k: f"{v.item():.2f}" for k, v in aux.items()})
        if args.eval_every and (step + 1) % args.eval_every == 0:
            acc = evaluate(model, fmt, args.eval_n)
            log.append({"step": step + 1, "minutes": (time.perf_counter() - t0) / 60,
                        "cpu_minutes": (time.process_time() - cpu0) / 60, "loss": answer_loss.item(),
                        **{k: v.item() for k, v in aux.items()}, **acc})
            tqdm.write(json.dumps(log[-1]))
        if args.minutes and time.process_time() - cpu0 > args.minutes * 60:
            tqdm.write(f"stopping at step {step + 1}: --minutes {args.minutes} CPU minutes reached")
            break
    final = evaluate(model, fmt, args.final_n)
    summary = {"args": vars(args), "wall_minutes": (time.perf_counter() - t0) / 60,
               "cpu_minutes": (time.process_time() - cpu0) / 60, "steps_run": step + 1,
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
    p.add_argument("--out", default="models/demo-v2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--bucket", type=int, default=8, help="batches whose examples are sorted by length together")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--curriculum", type=float, default=0.4, help="share of training with the distractor curriculum")
    p.add_argument("--size-curriculum", type=float, default=0.4, help="share of training while grids grow to 12×12")
    p.add_argument("--deferred-order", type=float, default=B.Views.deferred_order,
                   help="share of examples after the curriculum laid out in raincheck's order I0 ‖ D ‖ answer")
    p.add_argument("--bands", type=float, default=B.Views.bands,
                   help="share of I0 ‖ D examples whose I0 is a band of rows or columns (else random cells)")
    p.add_argument("--large", type=float, default=0.1, help="share of 16×16 grids after the size curriculum")
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--lists", type=float, default=3.0,
                   help="weight of list questions in training (single, multi), relative to the benchmark")
    p.add_argument("--families", default="0.35,0.4,0.25",
                   help=f"share of training dialogues of each family ({', '.join(FAMILIES)})")
    p.add_argument("--vit-position", action=argparse.BooleanOptionalAction, default=False,
                   help="let the vision tower learn absolute position embeddings (default: zero, frozen)")
    p.add_argument("--position-layer", type=int, default=3, help="decoder layer whose output the position probe reads")
    p.add_argument("--aux-weight", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--minutes", type=float, default=None,
                   help="cap on the run's CPU time (default none: the run takes its --steps whatever the time)")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-n", type=int, default=64)
    p.add_argument("--final-n", type=int, default=128, help="validation dialogues per family at the end")
    return p.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
