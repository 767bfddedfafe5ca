"""Tensor parallelism on the CPU: TP = 1 vs TP = 2 (gloo, one process per rank, one thread each).

For the random `bench` checkpoint of a family, each run starts its ranks fresh (raincheck_core.parallel
.launch) and reports, per rank: the peak resident memory the decoder's load added (VmHWM over the resident size
before it: the weights this rank read, and whatever it touched of the memory-mapped files while reading
its slices: file pages, shared and reclaimable), the anonymous memory the load left resident (the
rank's own copy of its weights), the decoder's parameter bytes it holds; and, from rank 0, the decode step time
(median wall-clock gap between the tokens of a greedy text turn) and the bytes each rank put into the
collectives per prompt token and per decode step (all-reduce: one hidden vector per row after every
mixer and MLP and after the embedding; all-gather: the sampled rows' logits). On NVLink the all-reduce
volume per token is what matters; on a two-core CPU the step time mostly shows the ranks competing for
the cores.

    python -m bench.parallel [--quick] [--json] [--family qwen3_5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from raincheck_core import Engine, Prompt, SamplingParams, TokenEvent
from raincheck_core.config import EngineConfig, ModelConfig
from raincheck_core.models import build_decoder
from raincheck_core.models.loader import load_decoder_weights
from raincheck_core.models.random_init import save_random_checkpoint
from raincheck_core.parallel import RankGroup
from raincheck_core.parallel.launch import spawn


def _memory(field: str) -> int:
    """`field` of /proc/self/status (VmRSS: resident now, VmHWM: its peak), in bytes."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> None:
    """Start VmHWM again from the resident size now (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Traffic:
    """Bytes each rank sends into all-reduces and all-gathers (counted at torch.distributed's calls)."""

    def __init__(self) -> None:
        self.bytes = {"all_reduce": 0, "all_gather": 0}
        for name in self.bytes:
            original = getattr(dist, name)

            def counted(*args, _name=name, _original=original, **kw):
                tensor = args[0] if _name == "all_reduce" else args[1]
                self.bytes[_name] += tensor.numel() * tensor.element_size()
                return _original(*args, **kw)

            setattr(dist, name, counted)


def rank_run(group: RankGroup | None, folder: str, world: int, tokens: int, prompt_len: int) -> dict:
    torch.set_flush_denormal(True)
    traffic = Traffic()
    cfg = ModelConfig.from_folder(folder)
    # the decoder's load alone (what Engine.from_pretrained does first), its peak over the resident size
    # before it: the imports and the rest of the engine's start-up are the same at any TP
    _reset_peak()
    before, anon = _memory("VmRSS"), _memory("RssAnon")
    model = build_decoder(cfg, group).to(dtype=torch.float32)
    load_decoder_weights(model, Path(folder), cfg.tie_word_embeddings)
    load_peak, anon = _memory("VmHWM") - before, _memory("RssAnon") - anon
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = Engine(model, cfg, EngineConfig(tensor_parallel_size=world, num_pages=256, max_gdn_slots=4,
                                             prefix_cache=False))
    prompt = Prompt(torch.randint(16, 2000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist())
    session = engine.open_session()
    session.turn(Prompt(prompt.token_ids[:8]), SamplingParams(max_new_tokens=2)).result()   # warm-up
    session.close()
    session = engine.open_session()
    start = dict(traffic.bytes)
    stamps, prefilled = [], {}
    for event in session.turn(prompt, SamplingParams(max_new_tokens=tokens, ignore_eos=True)):
        if isinstance(event, TokenEvent):
            stamps.append(time.perf_counter())
            prefilled = prefilled or dict(traffic.bytes)
    session.close()
    steps = len(stamps) - 1
    return dict(load_peak_rss_mib=load_peak / 2**20, load_anon_mib=anon / 2**20, param_mib=params / 2**20,
                step_ms=1e3 * statistics.median(b - a for a, b in itertools.pairwise(stamps)),
                prefill_bytes_per_token={k: (prefilled[k] - start[k]) / prompt_len for k in start},
                decode_bytes_per_step={k: (traffic.bytes[k] - prefilled[k]) / steps for k in start})


def _run(folder: str, world: int, tokens: int, prompt_len: int) -> list[dict]:
    if world == 1:      # a fresh process too, so the resident sizes compare
        return spawn(_single, 1, folder, tokens, prompt_len, threads=1)
    return spawn(rank_run, world, folder, world, tokens, prompt_len, threads=1)


def _single(group: RankGroup, folder: str, tokens: int, prompt_len: int) -> dict:
    return rank_run(None, folder, 1, tokens, prompt_len)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="TP = 1 vs 2 on the CPU: step time, load memory, bytes per token")
    ap.add_argument("--family", default="qwen3_5")
    ap.add_argument("--quick", action="store_true", help="fewer tokens")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    tokens, prompt_len = (8, 16) if args.quick else (40, 64)
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(save_random_checkpoint(Path(tmp) / args.family, args.family, "bench"))
        checkpoint_mib = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / 2**20
        res = dict(family=args.family, size="bench", checkpoint_mib=checkpoint_mib, tokens=tokens,
                   prompt_tokens=prompt_len, tp={w: _run(folder, w, tokens, prompt_len) for w in (1, 2)})
    if args.json:
        print(json.dumps(res, indent=2))
        return
    cmd = " ".join(["python -m bench.parallel", *(argv if argv is not None else sys.argv[1:])])
    print(f"`{cmd}`: {args.family} bench checkpoint ({checkpoint_mib:.1f} MiB), gloo, one thread per rank\n")
    print("| TP | rank | params MiB | load peak RSS MiB | load anon MiB | decode step ms | "
          "prefill all-reduce B/token | decode all-reduce B/step | decode all-gather B/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for world, ranks in res["tp"].items():
        for rank, r in enumerate(ranks):
            p, d = r["prefill_bytes_per_token"], r["decode_bytes_per_step"]
            print(f"| {world} | {rank} | {r['param_mib']:.1f} | {r['load_peak_rss_mib']:.1f} | "
                  f"{r['load_anon_mib']:.1f} | {r['step_ms']:.2f} | "
                  f"{p['all_reduce']:.0f} | {d['all_reduce']:.0f} | {d['all_gather']:.0f} |")


if __name__ == "__main__":
    main()
