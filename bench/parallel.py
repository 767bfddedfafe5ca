"""Tensor parallelism on the CPU: TP = 1 vs TP = 2 (gloo, one process per rank, one thread each).

For the random `bench` checkpoint of a family, each run starts its ranks fresh (raincheck_core.parallel
.launch) and reports, per rank: the peak resident memory the decoder's load added (VmHWM over the resident size
before it: the weights this rank read, and whatever it touched of the memory-mapped files while reading
its slices: file pages, shared and reclaimable), the anonymous memory the load left resident (the
rank's own copy of its weights) and the most it reached during the load (sampled every millisecond: a
rank that read a whole tensor before slicing it would show it), the decoder's parameter bytes it holds;
and, from rank 0, the decode step time
(median wall-clock gap between the tokens of a greedy text turn) and the bytes each rank put into the
collectives per prompt token and per decode step (all-reduce: one hidden vector per row after every
mixer and MLP and after the embedding; all-gather: the sampled rows' logits). On NVLink the all-reduce
volume per token is what matters; on a two-core CPU the step time mostly shows the ranks competing for
the cores.

`engine_started`: `Engine.from_pretrained(folder, tensor_parallel_size=N)` as a user calls it, in a fresh
process that becomes rank 0 and starts the other ranks itself; per process (rank 0, then the workers),
after the load and the same greedy turn, its peak RSS (VmHWM) and resident anonymous memory, at N = 1
and 2; and rank 0's decode step time, to set beside the ranks above that run the same calls themselves
(the difference is what sending each call to the workers costs). Every process also holds the
interpreter, torch and the engine's buffers: the difference to N = 1 is the part of the weights and
pools a process does not hold.

    python -m bench.parallel [--quick] [--json] [--family qwen3_5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from raincheck_core import Engine, Prompt, SamplingParams, TokenEvent
from raincheck_core.config import EngineConfig, ModelConfig
from raincheck_core.models import build_decoder
from raincheck_core.models.loader import load_decoder_weights
from raincheck_core.models.random_init import save_random_checkpoint
from raincheck_core.parallel import RankGroup
from raincheck_core.parallel.launch import spawn


def _memory(field: str, pid: int | str = "self") -> int:
    """`field` of /proc/<pid>/status (VmRSS: resident now, VmHWM: its peak, RssAnon: anonymous), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


class AnonPeak:
    """The most anonymous memory this process held while the context ran (sampled every millisecond)."""

    def __enter__(self) -> AnonPeak:
        self.peak = _memory("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _memory("RssAnon"))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _memory("RssAnon"))


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

            def counted(*args: Any, _name: str = name, _original: Callable[..., Any] = original, **kw: Any) -> Any:
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
    with AnonPeak() as peak:
        model = build_decoder(cfg, group).to(dtype=torch.float32)
        load_decoder_weights(model, Path(folder), cfg.tie_word_embeddings)
    load_peak, anon_peak, anon = _memory("VmHWM") - before, peak.peak - anon, _memory("RssAnon") - anon
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
    return dict(load_peak_rss_mib=load_peak / 2**20, load_anon_mib=anon / 2**20,
                load_peak_anon_mib=anon_peak / 2**20, param_mib=params / 2**20,
                step_ms=1e3 * statistics.median(b - a for a, b in itertools.pairwise(stamps)),
                prefill_bytes_per_token={k: (prefilled[k] - start[k]) / prompt_len for k in start},
                decode_bytes_per_step={k: (traffic.bytes[k] - prefilled[k]) / steps for k in start})


def _run(folder: str, world: int, tokens: int, prompt_len: int) -> list[dict]:
    if world == 1:      # a fresh process too, so the resident sizes compare
        return spawn(_single, 1, folder, tokens, prompt_len, threads=1)
    return spawn(rank_run, world, folder, world, tokens, prompt_len, threads=1)


def _single(group: RankGroup, folder: str, tokens: int, prompt_len: int) -> dict:
    return rank_run(None, folder, 1, tokens, prompt_len)


def engine_started(folder: str, world: int, tokens: int, prompt_len: int, device: str = "cpu") -> list[dict]:
    """In a fresh process: the engine loaded as a user loads it and a greedy turn run (so every worker rank
    has loaded too); per process, rank 0 first, its peak RSS and resident anonymous memory, and rank 0's
    median decode step."""
    torch.set_num_threads(1)
    engine = Engine.from_pretrained(folder, device=device, tensor_parallel_size=world, num_threads=1,
                                    num_pages=256, max_gdn_slots=4, prefix_cache=False)
    with engine:
        session = engine.open_session()
        session.turn(Prompt(list(range(16, 24))), SamplingParams(max_new_tokens=2)).result()     # warm-up
        session.close()
        session = engine.open_session()
        top = min(2000, ModelConfig.from_folder(folder).vocab_size)
        prompt = torch.randint(16, top, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
        stamps = [time.perf_counter() for e in session.turn(Prompt(prompt), SamplingParams(
            max_new_tokens=tokens, ignore_eos=True)) if isinstance(e, TokenEvent)]
        session.close()
        pids = [os.getpid(), *(p.pid for p in (engine.ranks.procs if engine.ranks is not None else []))]
        out = [dict(peak_rss_mib=_memory("VmHWM", pid) / 2**20, anon_mib=_memory("RssAnon", pid) / 2**20)
               for pid in pids]
    out[0]["step_ms"] = 1e3 * statistics.median(b - a for a, b in itertools.pairwise(stamps))
    return out


def _engine_started(folder: str, world: int, tokens: int, prompt_len: int, device: str = "cpu") -> list[dict]:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(engine_started, folder, world, tokens, prompt_len, device).result()


def device_run(device: str, tiny: bool) -> dict:
    """`bench.gpu`'s part: the engine-started measurement on `device` at TP = 1 and, where the machine has
    two accelerators, TP = 2 (NCCL); with one, it says that TP = 1 is all it ran. The CPU dry run stays at
    TP = 1 (this module's own run and tests measure TP = 2 with gloo)."""
    count = torch.cuda.device_count() if torch.device(device).type == "cuda" else 0
    worlds = (1, 2) if count >= 2 else (1,)
    tokens, prompt_len = (8, 16) if tiny else (40, 64)
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(save_random_checkpoint(Path(tmp) / "qwen3_5", "qwen3_5", "tiny" if tiny else "bench"))
        runs = {w: _engine_started(folder, w, tokens, prompt_len, device) for w in worlds}
    note = None if count >= 2 else f"{count or 'no'} accelerator(s) here: ran at tensor_parallel_size 1 only"
    return dict(devices=count, engine_started=runs, note=note)


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
                   prompt_tokens=prompt_len, tp={w: _run(folder, w, tokens, prompt_len) for w in (1, 2)},
                   engine_started={w: _engine_started(folder, w, tokens, prompt_len) for w in (1, 2)})
    if args.json:
        print(json.dumps(res, indent=2))
        return
    cmd = " ".join(["python -m bench.parallel", *(argv if argv is not None else sys.argv[1:])])
    print(f"`{cmd}`: {args.family} bench checkpoint ({checkpoint_mib:.1f} MiB), gloo, one thread per rank\n")
    print("| TP | rank | params MiB | load peak RSS MiB | load peak anon MiB | load anon MiB | decode step ms | "
          "prefill all-reduce B/token | decode all-reduce B/step | decode all-gather B/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for world, ranks in res["tp"].items():
        for rank, r in enumerate(ranks):
            p, d = r["prefill_bytes_per_token"], r["decode_bytes_per_step"]
            print(f"| {world} | {rank} | {r['param_mib']:.1f} | {r['load_peak_rss_mib']:.1f} | "
                  f"{r['load_peak_anon_mib']:.1f} | {r['load_anon_mib']:.1f} | {r['step_ms']:.2f} | "
                  f"{p['all_reduce']:.0f} | {d['all_reduce']:.0f} | {d['all_gather']:.0f} |")
    print("\nEngine.from_pretrained(tensor_parallel_size=N) in a fresh process (rank 0 starts the others):\n")
    print("| TP | process | peak RSS MiB | resident anon MiB | anon less TP = 1's | decode step ms |")
    print("|---|---|---|---|---|---|")
    (alone,) = res["engine_started"][1]
    for world, procs in res["engine_started"].items():
        for rank, r in enumerate(procs):
            step = f"{r['step_ms']:.2f}" if "step_ms" in r else ""
            print(f"| {world} | rank {rank} | {r['peak_rss_mib']:.1f} | {r['anon_mib']:.1f} | "
                  f"{r['anon_mib'] - alone['anon_mib']:+.1f} | {step} |")


if __name__ == "__main__":
    main()
