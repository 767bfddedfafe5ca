"""Train the demo model's multi-token-prediction head with the target frozen, and ship it in the checkpoint.

    python -m raincheck_demo.train_mtp [--model models/demo-v2] [--seed 0] [--steps 400]

The head (raincheck_demo/mtp.py, Qwen3.5's layout) learns, at every row t of the world's dialogues (the
benchmark's three families, every visual shown), to predict from the target's final-norm hidden state at t
and the embedding of token t+1 what the target predicts at t+1: the token after next. The loss is the
cross-entropy against the target's own distribution there (distillation: a draft is only worth what the
target accepts), on the rows whose token after next is an answer token (where decoding drafts). With
`--depth 3` two more passes train the chained drafts: the head's own output of the row before stands in for
the target's hidden state, and each chained row sees what the drafter's chain row sees (`chained_passes`).
The head starts as a copy of the target's last attention layer and final norm, its `fc` passing the hidden
half through. Seeded and single-threaded.

Written into the folder: the `mtp.*` tensors added to `model.safetensors` (every existing tensor kept
byte for byte: the target answers exactly as before), `mtp_num_hidden_layers: 1` in config.json's text
config, and the run (arguments, loss, CPU time, the head's acceptance from `mtp_acceptance.measure`, with
every row observed and with no visual row observed) under `"mtp"` in training_log.json.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from . import batch as B
from .data import formatter
from .mtp import TransformersMtp
from .mtp_acceptance import measure
from .train import examples, lr_at
from .world import FAMILIES

if TYPE_CHECKING:
    from transformers import Qwen3_5ForConditionalGeneration

MTP_SEED_OFFSET = 2_000_003     # the head's dialogues: apart from the target's training and held-out ones


def warm_start(head: TransformersMtp, target: Qwen3_5ForConditionalGeneration) -> None:
    """The head as the target's last full-attention layer and final norm; `fc` reads the hidden half as is
    and a little of the embedding half."""
    lm = target.model.language_model
    last = max(i for i, t in enumerate(target.config.text_config.layer_types) if t == "full_attention")
    head.layers[0].load_state_dict(lm.layers[last].state_dict())
    head.norm.load_state_dict(lm.norm.state_dict())
    d = head.fc.in_features // 2
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.02)
        head.fc.weight[:, d:] += torch.eye(d)


def gather_rows(x: torch.Tensor, idx: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """`x` at rows `idx [B, n]` along `dim` (1 for `[B, T, ...]`, 2 for positions `[3, B, T]`)."""
    if dim == 2:
        return x.gather(2, idx[None].expand(x.shape[0], -1, -1))
    return x.gather(1, idx.view(*idx.shape, *[1] * (x.dim() - 2)).expand(*idx.shape, *x.shape[2:]))


def chain_rows(loss_rows: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows the chained passes run at, per example: each loss row and the depth - 2 rows before it (all
    a loss row's chain reads). Returns them padded `[B, U]` (padding: row 1), which are real, and each
    head row's place among them (-1: none)."""
    b, n = loss_rows.shape
    chains = [sorted({r - j for r in loss_rows[i].nonzero().flatten().tolist() for j in range(depth - 1)
                      if r - j >= 1}) for i in range(b)]
    width = max(1, max(len(c) for c in chains))
    idx = torch.ones(b, width, dtype=torch.long)
    real = torch.zeros(b, width, dtype=torch.bool)
    place = torch.full((b, n), -1, dtype=torch.long)
    for i, c in enumerate(chains):
        idx[i, :len(c)] = torch.tensor(c, dtype=torch.long)
        real[i, :len(c)] = True
        place[i, c] = torch.arange(len(c))
    return idx, real, place


def chain_visibility(mask: torch.Tensor, idx: torch.Tensor, real: torch.Tensor, place: torch.Tensor,
                     depth: int) -> torch.Tensor:
    """`[B, L, L]` over pass 0's rows followed by each chained pass's: pass 0 causal; pass p's row r (the
    head's p-th chained draft after observing row r - p) sees pass 0's rows up to r - p and pass q's row
    r - p + q for q = 1..p, as the drafter's chain row does."""
    b, n = mask.shape
    width = idx.shape[1]
    size = n + (depth - 1) * width
    visible = torch.zeros(b, size, size, dtype=torch.bool)
    visible[:, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril() & mask.bool()[:, None, :]
    for i in range(b):
        for p in range(1, depth):
            for j in range(width):
                row = n + (p - 1) * width + j
                r = int(idx[i, j])
                if not real[i, j] or r < p:
                    visible[i, row, 0] = True        # padding: sees something, is never read
                    continue
                visible[i, row, :r - p + 1] = mask[i, :r - p + 1].bool()
                for q in range(1, p + 1):
                    at = int(place[i, r - p + q])
                    visible[i, row, n + (q - 1) * width + at] = at >= 0
    return visible


def chained_passes(head: TransformersMtp, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                   mask: torch.Tensor, rows: torch.Tensor, depth: int
                   ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The head's outputs of `depth` passes over head rows `[B, T]` (`embeds` of token t+1, the target's
    `hidden` at t, `positions`, `mask` of real rows), each with the rows it ran at and which of them are
    real (`[B, T]` for pass 0, the chained rows `[B, U]` after, padded). Pass 0 reads the target's hidden
    state; pass p at row r the head's own output of pass p - 1 at row r - 1, as the drafter chains it
    (`rows`: where the outputs are needed; each chain runs at the depth - 2 rows before those too)."""
    idx, real, place = chain_rows(rows, depth)
    visible = chain_visibility(mask, idx, real, place, depth)
    g = head(embeds, hidden, positions, mask)
    out = [(g, torch.arange(hidden.shape[1]).expand(hidden.shape[0], -1), mask.bool())]
    n, width = hidden.shape[1], idx.shape[1]
    inputs = [(embeds, hidden, positions)]
    previous = gather_rows(g, idx - 1)           # pass 0's output at row r - 1, for pass 1's row r
    for p in range(1, depth):
        inputs.append((gather_rows(embeds, idx), previous, gather_rows(positions, idx, dim=2)))
        size = n + p * width
        g = head(torch.cat([e for e, _, _ in inputs], 1), torch.cat([h for _, h, _ in inputs], 1),
                 torch.cat([q for _, _, q in inputs], 2), visible=visible[:, :size, :size])[:, n + (p - 1) * width:]
        out.append((g, idx, real))
        # pass p's output at row r - 1 (its place among the chained rows), for pass p + 1's row r
        previous = gather_rows(g, place.gather(1, idx - 1).clamp(min=0))
    return out


def step_loss(head: TransformersMtp, target: Qwen3_5ForConditionalGeneration, batch: B.Batch, depth: int,
              blind: torch.Tensor) -> torch.Tensor:
    """Mean over the `depth` passes (`chained_passes`) of the cross-entropy of the head's distribution at row
    t against the target's at row t+1, on the rows whose token after next is an answer token (the chained
    passes read the world's tokens, which the target says at answer rows). In the examples `blind` `[B]`
    names, the head's attention reads no visual row (the target's hidden states still carry them): the
    drafter never observes deferred rows."""
    with torch.no_grad():
        _, out = B.language_model(target, batch)
        teacher = target.lm_head(out.last_hidden_state[:, 1:]).softmax(-1)
        ids = torch.cat([batch.flat_ids, batch.flat_ids.new_zeros(1)])[batch.gather]
        embeds = target.model.language_model.embed_tokens(ids[:, 1:])
        rows = batch.targets[:, 1:] != -100
        seen = batch.mask[:, :-1] * ~(blind[:, None] & torch.isin(batch.gather[:, :-1], batch.flat_visual))
    losses = []
    for g, at, real in chained_passes(head, embeds, out.last_hidden_state[:, :-1], batch.positions[:, :, :-1],
                                      seen, rows, depth):
        logp = F.log_softmax(target.lm_head(g), -1)
        where = gather_rows(rows, at) & real
        losses.append(-(gather_rows(teacher, at) * logp).sum(-1)[where].mean())
    return sum(losses) / len(losses)


def write_head(head: TransformersMtp, folder: Path) -> dict[str, int]:
    """Add the head to the folder's checkpoint, every other tensor unchanged; returns its tensor count and
    the file's size before and after."""
    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    before = path.stat().st_size
    tensors = {k: v for k, v in load_file(str(path)).items() if not k.startswith("mtp.")}   # a rerun replaces it
    mtp = head.checkpoint()
    save_file({**tensors, **mtp}, str(path), metadata=metadata)
    kept = load_file(str(path))
    if not all(torch.equal(kept[k], v) for k, v in tensors.items()):
        raise RuntimeError(f"writing the MTP head changed a tensor of {path}")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return {"tensors": len(mtp), "bytes_before": before, "bytes_after": path.stat().st_size}


def train(args: argparse.Namespace) -> dict:
    from transformers import Qwen3_5ForConditionalGeneration

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed + MTP_SEED_OFFSET)
    blind_rng = random.Random(args.seed + MTP_SEED_OFFSET + 1)    # its own stream: the dialogues stay put
    folder = Path(args.model)
    target = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    target.requires_grad_(False)
    head = TransformersMtp(target.config.text_config)
    warm_start(head, target)
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    fmt = formatter()
    t0, cpu0 = time.perf_counter(), time.process_time()
    log, recent = [], []
    bar = tqdm(range(args.steps), desc="train mtp", dynamic_ncols=True)
    for step in bar:
        families = [FAMILIES[(step * args.batch + i) % len(FAMILIES)] for i in range(args.batch)]
        dialogues, layouts = examples(rng, fmt, families)
        batch = B.collate(dialogues, layouts, [torch.arange(len(lay.ids)) for lay in layouts])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        blind = torch.tensor([blind_rng.random() < args.blind for _ in dialogues])
        loss = step_loss(head, target, batch, args.depth, blind)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        recent.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % args.log_every == 0:
            log.append({"step": step + 1, "loss": sum(recent) / len(recent),
                        "cpu_minutes": (time.process_time() - cpu0) / 60})
            recent = []
    cpu_train = (time.process_time() - cpu0) / 60
    written = write_head(head.eval(), folder)
    acceptance = {"every_row": measure(folder, args.eval_n, args.eval_seed),
                  "no_visual_row": measure(folder, args.eval_n, args.eval_seed, visual=False)}
    summary = {"args": vars(args), "steps_run": args.steps, "train_cpu_minutes": cpu_train,
               "wall_minutes": (time.perf_counter() - t0) / 60, "written": written, "acceptance": acceptance,
               "log": log}
    tqdm.write(json.dumps({"acceptance": acceptance, "train_cpu_minutes": round(cpu_train, 2)}))
    log_path = folder / "training_log.json"
    training_log = json.loads(log_path.read_text()) if log_path.is_file() else {}
    training_log["mtp"] = summary
    log_path.write_text(json.dumps(training_log, indent=1) + "\n")
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/demo-v2", help="the checkpoint folder: read, and the head written in")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=6)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--depth", type=int, default=3,
                   help="passes per example: 1 trains the first draft only, each more one more chained draft")
    p.add_argument("--blind", type=float, default=0.5,
                   help="share of examples in which the head's attention reads no visual row (deferred rows)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-n", type=int, default=32, help="held-out dialogues per family for the acceptance")
    p.add_argument("--eval-seed", type=int, default=7)
    return p.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
