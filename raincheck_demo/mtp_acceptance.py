"""How often a checkpoint's MTP head drafts what the target would say, measured offline through the engine's
own drafter (raincheck_core/speculative/mtp.py) on held-out dialogues.

Each decode step of an answer (history ids[:H], H past the answer's first token, which the prefill
samples) verifies the drafts proposed after the drafter observed rows 0..H-2 with the target's hidden
states (transformers' forward over the whole dialogue, every visual shown). The drafts are compared with
the target's greedy continuation, known teacher-forced while the target agrees with the reference answer
(a token where it does not ends the comparison) and up to the answer's `<|im_end|>`. Per k: the share of
drafted tokens a greedy verifier accepts (accepted / drafted, as vLLM counts it) and the mean tokens a
verify step yields (accepted + the target's own), over the steps with at least k tokens left to say.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tqdm import tqdm

from raincheck_core.config import ModelConfig
from raincheck_core.models import build_decoder
from raincheck_core.models.loader import load_decoder_weights
from raincheck_core.models.mtp import load_mtp_head
from raincheck_core.speculative.mtp import MtpDrafter

from . import batch as B
from .data import formatter, layout
from .world import FAMILIES, make

KS = (1, 2, 3)


def continuation(ids: torch.Tensor, greedy: torch.Tensor, h: int, end: int, k: int) -> list[int]:
    """The target's next (up to) k greedy tokens after history ids[:h], none past token `end - 1`: token
    h + m is greedy[h - 1 + m], known while the target agreed with ids on the tokens before it."""
    out: list[int] = []
    for m in range(min(k, end - h)):
        if m and out[-1] != int(ids[h - 1 + m]):
            break
        out.append(int(greedy[h - 1 + m]))
    return out


@torch.no_grad()
def measure(folder: Path, per_family: int = 32, seed: int = 7, progress: bool = True, visual: bool = True) -> dict:
    """`visual=False`: the drafter observes no visual row (as if every one were deferred; the target still
    saw them all)."""
    from transformers import Qwen3_5ForConditionalGeneration

    hf = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = ModelConfig.from_folder(folder)
    target = build_decoder(cfg)
    load_decoder_weights(target, folder, cfg.tie_word_embeddings)
    drafter = MtpDrafter(load_mtp_head(cfg, folder), target, num_pages=256)
    fmt = formatter()
    rng = random.Random(seed)
    drafted = {k: 0 for k in KS}
    accepted = {k: 0 for k in KS}
    steps = {k: 0 for k in KS}
    dialogues = [(f, make(f, rng)) for f in FAMILIES for _ in range(per_family)]
    for family, dialogue in tqdm(dialogues, desc="acceptance", disable=not progress):
        lay = layout(fmt, dialogue)
        batch = B.collate([dialogue], [lay], [torch.arange(len(lay.ids))])
        _, out = B.language_model(hf, batch)
        hidden = out.last_hidden_state[0]
        greedy = hf.lm_head(hidden).argmax(-1)
        ids, pos = lay.ids, lay.positions
        observed = torch.ones(len(ids), dtype=torch.bool)
        if not visual:
            observed[lay.visual_rows] = False
        seen = 0
        for start, end in lay.answers:
            for h in range(start + 1, end):
                # rows seen..h-2 (those observed): the next token of row i is ids[i + 1]
                rows = torch.arange(seen, h - 1)[observed[seen:h - 1]]
                drafter.observe(family, ids[rows + 1], pos[:, rows], hidden[rows])
                seen = h - 1
                # draft m stands for token h + m, which the verify step's row h - 1 + m computes
                want = continuation(ids, greedy, h, end, max(KS))
                drafts = drafter.propose(family, ids[:h].tolist(), max(KS))
                for k in KS:
                    if len(want) < k:
                        continue      # the answer ends (or the target leaves it) before k drafts would matter
                    run = next((m for m in range(k) if drafts[m] != want[m]), k)
                    drafted[k] += k
                    accepted[k] += run
                    steps[k] += 1
        drafter.release(family)
    return {f"k={k}": {"acceptance": accepted[k] / max(1, drafted[k]),
                       "tokens_per_step": 1 + accepted[k] / max(1, steps[k]), "verify_steps": steps[k]}
            for k in KS}
