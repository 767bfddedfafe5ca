"""Prefix cache and encoder cache: what a new session saves when its prefix, or its image, was seen before.

    python -m bench.prefix [--quick] [--threads N] [--repeats N] [--json PATH] [--cold-only]

On the random `bench` checkpoints of both families, each a new session's first turn, TTFT cold (empty
caches) and warm (what the scenario shares is cached), on the engine's clock (thread CPU time, one
torch thread: a step's own cost, not moved by other processes on the machine):
- `system`: a shared 1,024-token system prompt and a 32-token question (warm: another question);
- `image_full`, `image_raincheck`: 32 text tokens, an image of 16×16 merged tokens and the same
  32-token first question (raincheck: uniform selector, 30% kept; warm: the same turn again);
- `regenerate`: a 6-turn conversation (64-token questions, 16-token answers), then a new session sent the
  whole conversation with its last question again (what the HTTP API does for a regenerate whose session
  was freed): the rows it prefills, against the new turn's own;
- `encoder`: an image (PNG) through the vision tower, then again (another session's): encoder cache hits
  and time.
Plus the memory the caches hold after the system-prompt scenario, and the cold TTFT with prefill steps
cut anywhere: what the aligned cuts cost (a step ending at the prompt's last page boundary, where a repeat
resumes, and the one before its last message boundary; the GDN checkpoints are taken inside the steps).
`--cold-only`: only the cold TTFT of a 1,024-token prompt, as the engine runs it and with steps cut anywhere,
alternated repeat by repeat (`cold_1024`). Cold and warm runs alternate;
each figure is the best of the repeats. `--json` keys: `warm_over_cold_ttft` (per family, the shared system prompt),
`regenerate_prefilled_rows` (per family), `encoder_cache_hits` (per family).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from raincheck_core import Engine, Prompt, SamplingParams, VisualInput
from raincheck_core.deferral.policy import DeferralConfig

from .common import FAMILIES, build_engine, setup_torch, use_clock

FULL = DeferralConfig("full")
RAINCHECK = DeferralConfig("raincheck", tpot_slo=None, selector="uniform")


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(16, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _first_turn(engine: Engine, prompt: Prompt | list[int], cfg: DeferralConfig = FULL, max_new: int = 2):
    """TTFT and prompt rows served from the prefix cache of a new session's first turn."""
    session = engine.open_session(deferral=cfg)
    try:
        m = session.turn(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True)).result().metrics
        session.complete_recovery()
        return m.ttft_s, m.cached_prompt_tokens, m.prompt_tokens
    finally:
        session.close()


def _image_prompt(engine: Engine, visual: VisualInput, seed: int) -> Prompt:
    mc = engine.model_config
    n = visual.embeddings.shape[0]
    return Prompt([*_ids(32, seed), mc.vision_start_token_id, *[mc.image_token_id] * n, mc.vision_end_token_id,
                   *_ids(32, seed + 1)], [visual])


def _png(seed: int, side: int = 448) -> bytes:
    g = torch.Generator().manual_seed(seed)
    img = Image.new("RGB", (side, side), "white")
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x, y, r = (int(v) for v in torch.randint(0, side, (3,), generator=g))
        color = tuple(torch.randint(0, 255, (3,), generator=g).tolist())
        draw.ellipse([x, y, x + r // 4 + 8, y + r // 4 + 8], fill=color)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def cold_warm(engine: Engine, repeats: int, cold: Callable[[int], tuple[float, int, int]],
              warm: Callable[[int], tuple[float, int, int]]) -> dict:
    """Best-of-`repeats` TTFT of `cold()` on empty caches and of `warm()` right after it."""
    colds, warms, hits = [], [], []
    for r in range(repeats):
        engine.clear_caches()
        colds.append(cold(r)[0])
        ttft, cached, prompt = warm(r)
        warms.append(ttft)
        hits.append(cached / prompt)
    c, w = min(colds), min(warms)
    return {"cold_ttft_ms": 1e3 * c, "warm_ttft_ms": 1e3 * w, "warm_over_cold": w / c, "hit_share": min(hits),
            "memory": memory(engine)}


def unaligned_cold(engine: Engine, repeats: int, cold: Callable[[int], tuple[float, int, int]]) -> float | None:
    """The cold TTFT with prefill steps cut anywhere (`Engine.prefill_alignment` off): what its aligned cuts cost."""
    align = engine.prefill_alignment
    if align is None:
        return None
    engine.prefill_alignment = None
    try:
        times = []
        for r in range(repeats):
            engine.clear_caches()
            times.append(cold(r)[0])
        return 1e3 * min(times)
    finally:
        engine.prefill_alignment = align


def cold_prompt(engine: Engine, repeats: int, rows: int = 1024) -> dict:
    """Best-of-`repeats` cold TTFT of a `rows`-token prompt as the engine runs it (its aligned cuts and GDN
    checkpoints) and with prefill steps cut anywhere, one after the other in each repeat, so that both see
    the same machine."""
    use_clock(engine, time.thread_time)
    align = engine.prefill_alignment
    times: dict[str, list[float]] = {"aligned": [], "anywhere": []}
    try:
        for r in range(repeats):
            for name, cuts in (("aligned", align), ("anywhere", None)):
                engine.prefill_alignment = cuts
                engine.clear_caches()
                times[name].append(_first_turn(engine, _ids(rows, 100 + r))[0])
    finally:
        engine.prefill_alignment = align
    best = {name: min(t) for name, t in times.items()}
    return {"cold_ttft_ms": 1e3 * best["aligned"], "cold_anywhere_ttft_ms": 1e3 * best["anywhere"],
            "aligned_over_anywhere": best["aligned"] / best["anywhere"]}


def regenerate(engine: Engine, turns: int = 6) -> dict:
    engine.clear_caches()
    session = engine.open_session(deferral=FULL)
    questions = [_ids(64, 100 + t) for t in range(turns)]
    for q in questions[:-1]:
        session.turn(q, SamplingParams(max_new_tokens=16, ignore_eos=True)).result()
    history = list(session.cache.tokens) + list(session.cache.pending_ids)
    session.turn(questions[-1], SamplingParams(max_new_tokens=16, ignore_eos=True)).result()
    session.close()
    _, cached, prompt = _first_turn(engine, history + questions[-1])
    return {"prompt_rows": prompt, "new_turn_rows": len(questions[-1]), "prefilled_rows": prompt - cached,
            "cached_rows": cached}


def encoder(engine: Engine) -> dict:
    engine.clear_caches()
    image = _png(7)
    times = []
    for _ in range(2):
        t0 = time.thread_time()
        (visual,) = engine.vision.encode_images([image])
        times.append(time.thread_time() - t0)
    stats = engine.encoder_cache_stats()
    # the encoded image in two new sessions: the second finds its rows in the prefix cache too
    _first_turn(engine, _image_prompt(engine, visual, 5))
    _, cached, prompt = _first_turn(engine, _image_prompt(engine, visual, 5))
    return {"encoder_cache_hits": stats.hits, "tower_runs": stats.misses, "encode_cold_ms": 1e3 * times[0],
            "encode_warm_ms": 1e3 * times[1], "visual_tokens": visual.embeddings.shape[0],
            "second_session_cached_rows": cached, "second_session_prompt_rows": prompt}


def memory(engine: Engine) -> dict:
    prefix = engine.prefix_stats()
    mc = engine.model_config
    page_bytes = 2 * mc.num_attention_layers * engine.config.page_size * mc.num_kv_heads * mc.head_dim * 4
    enc = engine.encoder_cache_stats()
    return {"prefix_pages": prefix.cached_pages, "prefix_kv_mib": prefix.cached_pages * page_bytes / 2**20,
            "gdn_checkpoints": prefix.checkpoints, "gdn_checkpoint_mib": prefix.checkpoint_bytes / 2**20,
            "encoder_mib": enc.bytes / 2**20 if enc is not None else 0.0}


def run_family(engine: Engine, repeats: int) -> dict:
    use_clock(engine, time.thread_time)
    system = _ids(1024, 1)
    cold = lambda r: _first_turn(engine, system + _ids(32, 10 + r))    # noqa: E731
    out = {"system": cold_warm(engine, repeats, cold, lambda r: _first_turn(engine, system + _ids(32, 50 + r)))}
    out["system"]["cold_unaligned_ttft_ms"] = unaligned_cold(engine, repeats, cold)
    side = 16
    mc = engine.model_config
    g = torch.Generator().manual_seed(3)
    visual = VisualInput("image", torch.randn(side * side, mc.hidden_size, generator=g), (1, 2 * side, 2 * side),
                         [torch.randn(side * side, mc.hidden_size, generator=g) for _ in range(mc.deepstack_levels)])
    for name, cfg in (("image_full", FULL), ("image_raincheck", RAINCHECK)):
        prompt = _image_prompt(engine, visual, 20)
        out[name] = cold_warm(engine, repeats, lambda r, p=prompt, c=cfg: _first_turn(engine, p, c),
                              lambda r, p=prompt, c=cfg: _first_turn(engine, p, c))
    out["regenerate"] = regenerate(engine)
    out["encoder"] = encoder(engine)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 repeats instead of 5")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--cold-only", action="store_true", help="only the cold TTFT of a 1,024-token prompt")
    args = p.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 5)
    setup_torch(args.threads)
    if args.cold_only:
        with tempfile.TemporaryDirectory() as tmp:
            cold = {f: cold_prompt(build_engine(f, Path(tmp), prefix_cache=True), repeats) for f in FAMILIES}
        for family, c in cold.items():
            print(f"{family}: cold 1,024-token prompt {c['cold_ttft_ms']:.1f} ms, steps cut anywhere "
                  f"{c['cold_anywhere_ttft_ms']:.1f} ms ({c['aligned_over_anywhere']:.3f}x)")
        if args.json:
            args.json.write_text(json.dumps({"cold_1024": cold}, indent=1))
        return {"cold_1024": cold}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            results[family] = run_family(build_engine(family, Path(tmp), prefix_cache=True), repeats)
    report = {
        "warm_over_cold_ttft": {f: r["system"]["warm_over_cold"] for f, r in results.items()},
        "regenerate_prefilled_rows": {f: r["regenerate"]["prefilled_rows"] for f, r in results.items()},
        "encoder_cache_hits": {f: r["encoder"]["encoder_cache_hits"] for f, r in results.items()},
        "families": results,
    }
    for family, r in results.items():
        print(f"{family}:")
        for name in ("system", "image_full", "image_raincheck"):
            s = r[name]
            print(f"  {name:16s} cold {s['cold_ttft_ms']:8.1f} ms  warm {s['warm_ttft_ms']:8.1f} ms  "
                  f"warm/cold {s['warm_over_cold']:.3f}  hit {s['hit_share']:.0%}")
        g = r["regenerate"]
        print(f"  regenerate       {g['prefilled_rows']} of {g['prompt_rows']} rows prefilled "
              f"(new turn: {g['new_turn_rows']})")
        e = r["encoder"]
        print(f"  encoder          {e['encoder_cache_hits']} hit(s), {e['tower_runs']} tower run(s), "
              f"{e['encode_cold_ms']:.1f} -> {e['encode_warm_ms']:.1f} ms")
        if r["system"]["cold_unaligned_ttft_ms"] is not None:
            print(f"  system, cold with prefill steps cut anywhere: {r['system']['cold_unaligned_ttft_ms']:.1f} ms")
        memory_held = r["system"]["memory"]
        print(f"  memory (system)  {json.dumps({k: round(v, 2) for k, v in memory_held.items()})}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
