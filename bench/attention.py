"""The FlexAttention path (the GPU path's CPU twin) against the native CPU kernels, and its accounting.

    python -m bench.attention [--repeats 15] [--threads 2] [--sessions 1,16] [--json PATH] [--quick]

- decode steps: B = 1 and 16 sessions (`--sessions`), each decoding over its own 1,536-token context, on the `bench`
  Qwen3-VL checkpoint (8 attention layers), one engine per backend over the same weights; the two
  engines step in turn (a step of one, a step of the other), and each side's time is the median of its
  steps. With each: the bytes a step allocates (torch's profiler) over the K+V bytes its attention layers
  must read, and the flex step's accounting;
- the accounting of decode, fused-chunk (a 31-row deferred chunk that skips its turn's 8 generated slots,
  with its decode row, per session) and prefill (a 1,024-row chunk over the context) steps at B = 1, 16,
  64 and 1-4K contexts, from the layout alone (ops/attention_accounting.py), with the host time of the
  layout; and what one attention layer's call allocates against the K/V bytes it reads.
`--quick` runs B = 1 and 16 at 1K only in the accounting table. `--against REV` times the layout of
ops/flex_layout.py (before it had a module of its own: ops/flex_attention.py) as it was at git revision
REV beside the current one, in turn on the same inputs (the fastest of `LAYOUT_REPEATS` builds each: the
build is the same work every time, and the fastest is the one a loaded host disturbed least).
`python -m bench.gpu` runs the accounting table on its device too (the quick one with `--tiny`).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.cache.kv_pool import KVPool, PageTable
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.models.random_init import save_random_checkpoint
from raincheck_core.ops import backend
from raincheck_core.ops.attention_accounting import StepAccounting, allocated_bytes, flex_accounting
from raincheck_core.ops.flex_attention import flex_varlen_attention
from raincheck_core.ops.flex_layout import FlexLayout, flex_layout

from .common import setup_torch

CONTEXT = 1536
LAYOUT_REPEATS = 9
LONG_CONTEXT = 32768      # the accounting table's video-length rows: 4 sessions
PAGE = 16
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 64          # the bench checkpoint's attention layers


def _acc_row(acc: StepAccounting) -> dict:
    return {"score_ratio": round(acc.score_ratio, 4), "kv_ratio": round(acc.kv_ratio, 4),
            "kv_tile_ratio": round(acc.kv_tile_reads / max(1, acc.kv_visible), 3),
            "kv_visible_mb": round(acc.kv_visible / 2**20, 3), "metadata_kb": round(acc.metadata / 2**10, 1)}


def decode_steps(workdir: Path, sessions: int, repeats: int) -> dict:
    """Flex and native decode steps of `sessions` sessions over CONTEXT-token contexts, side by side."""
    folder = save_random_checkpoint(workdir / "qwen3_vl", "qwen3_vl", "bench")
    layouts, original = [], backend.FLEX_ATTENTION

    def recording(*args: object, **kwargs: object) -> FlexLayout:      # the engine's layout, kept for accounting
        layouts.append(original.layout(*args, **kwargs))
        return layouts[-1]

    engines = {name: Engine.from_pretrained(folder, backend=name, max_rows_per_step=8192, num_pages=4096,
                                            max_pages_per_session=256, prefix_cache=False)
               for name in ("native", "flex")}
    g = torch.Generator().manual_seed(0)
    for engine in engines.values():
        streams = [engine.open_session().turn(Prompt(torch.randint(16, 2000, (CONTEXT,), generator=g).tolist()),
                                              SamplingParams(max_new_tokens=1000, ignore_eos=True),
                                              deferral=DeferralConfig("full")) for _ in range(sessions)]
        while any(s.request.input_remaining for s in streams):      # prefill every session
            engine.step()
    cfg = engines["flex"].model_config
    kv_bytes = sessions * CONTEXT * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * cfg.num_attention_layers
    backend.FLEX_ATTENTION = dataclasses.replace(original, layout=recording)
    try:
        for _ in range(3):               # compile, and settle
            for engine in engines.values():
                engine.step()
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(repeats):
            for name, engine in engines.items():
                t = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - t)
        alloc = {name: allocated_bytes(engine.step) for name, engine in engines.items()}
    finally:
        backend.FLEX_ATTENTION = original
    acc = flex_accounting(layouts[-1], cfg.num_kv_heads, cfg.head_dim, 4)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return {"sessions": sessions, "context": CONTEXT, "flex_ms": round(ms["flex"], 2),
            "native_ms": round(ms["native"], 2), "ratio": round(ms["flex"] / ms["native"], 2),
            "alloc_over_kv": {name: round(b / kv_bytes, 4) for name, b in alloc.items()}, **_acc_row(acc)}


def _sessions(pool: KVPool, n: int, context: int, g: torch.Generator) -> list[PageTable]:
    """`n` sessions of `context` filled slots, their pages interleaved in the pool as sessions that grew
    together would have them."""
    tables = [PageTable(pool, 1 << 16) for _ in range(n)]
    for _ in range(0, context, PAGE):
        for t in [tables[i] for i in torch.randperm(n, generator=g).tolist()]:
            t.append(min(PAGE, context - t.length))
    return tables


def layout_at(rev: str) -> Callable[..., object]:
    """`flex_layout` as it was at git revision `rev` (ops/flex_layout.py; at revisions before it had a module
    of its own, ops/flex_attention.py), loaded as a module of its own (it imports torch, numpy and, since
    they moved out, ops/flex_runs.py, ops/flex_blocks.py, ops/flex_groups.py and ops/uploads.py, loaded from the
    same revision beside it), with slot tables of its own."""
    root = Path(__file__).resolve().parent.parent

    def show(path: str) -> str | None:
        shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True)
        return shown.stdout if shown.returncode == 0 else None

    package = types.ModuleType(f"flex_at_{rev}")
    package.__path__ = []
    sys.modules[package.__name__] = package
    modules = {}
    for name, paths in (("uploads", ["raincheck_core/ops/uploads.py"]),
                        ("flex_runs", ["raincheck_core/ops/flex_runs.py"]),
                        ("flex_blocks", ["raincheck_core/ops/flex_blocks.py"]),
                        ("flex_groups", ["raincheck_core/ops/flex_groups.py"]),
                        ("flex_layout", ["raincheck_core/ops/flex_layout.py", "raincheck_core/ops/flex_attention.py"])):
        source = next((text for text in map(show, paths) if text is not None), None)
        if source is None:
            continue
        module = modules[name] = types.ModuleType(f"{package.__name__}.{name}")
        module.__package__ = package.__name__
        sys.modules[module.__name__] = module         # dataclasses look their module up; `from .x` finds it
        exec(compile(source, f"{rev}:{name}", "exec"), module.__dict__)
    if "flex_layout" not in modules:
        raise ValueError(f"no flex layout at {rev}")
    return modules["flex_layout"].flex_layout


def _timed(build: Callable[[], object]) -> tuple[float, object]:
    t = time.perf_counter()
    out = build()
    return time.perf_counter() - t, out


def layout_rows(sessions: int, context: int, kind: str, g: torch.Generator, device: str = "cpu",
                against: Callable[..., object] | None = None) -> dict:
    """One step's layout of `kind` over `sessions` sessions of `context` slots, its accounting, the host
    time of building it (the fastest of `LAYOUT_REPEATS`; with `against`, that builder's too, in turn on
    the same inputs), and what one layer's call allocates over the K/V bytes it reads (on the CPU; elsewhere
    the profiler's CPU memory says nothing of the device's, and the column is left out)."""
    pages = sessions * (context + 1100) // PAGE + 8
    pool = KVPool(1, pages, PAGE, KV_HEADS, HEAD_DIM, torch.float32, device)
    tables = _sessions(pool, sessions, context, g)
    # prefixes, and the pages decode rows carry: as the engine marks them (engine/plan.py)
    q_lens, reads, writes, prefixes, carried = [], [], [], [], []
    for t in tables:
        if kind == "decode":
            writes.append(t.ahead(0, 1))
            reads.append(t.reserved_slots(0, t.length + 1))
            q_lens.append(1)
            prefixes.append(True)
            carried.append(t.page_ids)
        elif kind == "fused":       # the chunk skips the last 8 generated slots, its decode row sees it
            chunk, row = t.ahead(0, 31), t.ahead(31, 1)
            past = t.reserved_slots(0, t.length)
            keep = torch.ones(t.length, dtype=torch.bool)
            keep[torch.arange(t.length - 8 * 40, t.length, 40)] = False
            reads += [torch.cat([past[keep], chunk]), t.reserved_slots(0, t.length + 32)]
            writes += [chunk, row]
            q_lens += [31, 1]
            prefixes += [(~keep).nonzero().flatten().numpy(), True]
            carried += [None, t.page_ids]
        else:
            writes.append(t.ahead(0, 1024))
            reads.append(t.reserved_slots(0, t.length + 1024))
            q_lens.append(1024)
            prefixes.append(True)
            carried.append(None)
    write = torch.cat(writes)
    current = partial(flex_layout, prefixes=prefixes, pages=carried)
    if against is not None and "prefixes" in inspect.signature(against).parameters:
        # a revision whose layout takes no positions left out marked a chunk's list as any list
        takes_skips = "Prefix" in against.__globals__
        against = partial(against, prefixes=[p if takes_skips or isinstance(p, bool) else False for p in prefixes],
                          **({"pages": carried} if "pages" in inspect.signature(against).parameters else {}))
    builders = {"layout_host_ms": current, **({"layout_host_ms_against": against} if against else {})}
    times: dict[str, list[float]] = {name: [] for name in builders}
    for _ in range(LAYOUT_REPEATS):
        for name, build in builders.items():
            took, layout = _timed(lambda build=build: build(q_lens, reads, write, device, pool))
            times[name].append(1e3 * took)
    layout = current(q_lens, reads, write, device, pool)
    acc = flex_accounting(layout, KV_HEADS, HEAD_DIM, 4)
    rows = sum(q_lens)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g).to(device)
    k = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g).to(device)
    v = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g).to(device)

    def call() -> torch.Tensor:
        return flex_varlen_attention(q, k, v, pool.k[0], pool.v[0], layout)

    call()
    row = {"kind": kind, "sessions": sessions, "context": context,
           **{name: round(min(t), 2) for name, t in times.items()}, **_acc_row(acc)}
    if torch.device(device).type == "cpu":
        row["alloc_over_kv_read"] = round(allocated_bytes(call) / acc.kv_read, 4)
    return row


def accounting_table(device: str, quick: bool, against: Callable[..., object] | None = None) -> list[dict]:
    """`layout_rows` for decode, fused-chunk and prefill steps at B = 1, 16, 64 and 1-4K contexts, and decode
    and fused steps of 4 sessions over video-length 32K contexts (`quick`: decode and fused, B = 1 and 16 at
    1K)."""
    g = torch.Generator().manual_seed(0)
    batches, contexts = ((1, 16), (1024,)) if quick else ((1, 16, 64), (1024, 2048, 4096))
    rows = []
    for kind in ("decode", "fused") if quick else ("decode", "fused", "prefill"):
        for sessions in batches:
            for context in contexts:
                if kind == "prefill" and sessions * (context + 1024) > 64 * 2048:
                    continue        # the prefill rows alone would be past any step's row budget
                rows.append(layout_rows(sessions, context, kind, g, device, against))
                print(json.dumps(rows[-1]), flush=True)
    for kind in () if quick else ("decode", "fused"):
        rows.append(layout_rows(4, LONG_CONTEXT, kind, g, device, against))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sessions", default="1,16", help="the decode steps' batch sizes, comma-separated")
    p.add_argument("--skip-decode", action="store_true", help="the accounting table only")
    p.add_argument("--skip-accounting", action="store_true", help="the decode steps only")
    p.add_argument("--against", metavar="REV", help="time the layout at this git revision too")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    setup_torch(args.threads)
    result: dict = {"threads": args.threads, "decode": [], "accounting": []}
    if not args.skip_decode:
        with tempfile.TemporaryDirectory() as tmp:
            for sessions in (int(n) for n in args.sessions.split(",")):
                row = decode_steps(Path(tmp), sessions, args.repeats)
                print(json.dumps(row), flush=True)
                result["decode"].append(row)
    if not args.skip_accounting:
        result["accounting"] = accounting_table("cpu", args.quick, layout_at(args.against) if args.against else None)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
