"""Batched decode on the device (issue 39): B sessions, each decoding over its own long text context, with
decode graphs on, so the step's attention reads each session's pages in place and the GDN states stay in
the pool. Per B: the steady step's wall time, decode tokens/s, and the device's kernel time per step (the
profiler sees kernels inside graph replays too), so wall - device is the host time the GPU waits on; and the
most host-to-device copies a steady step's metadata made (ops/uploads.py: one)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from raincheck_core import Engine, Prompt, SamplingParams

from .models import Shape, random_engine
from .timing import sync


def decode_round(engine: Engine, batch: list[Prompt], answer: int, device: str,
                 around: Callable[[bool], None] | None = None) -> list[float]:
    """Wall seconds of each steady decode step (every turn of the batch decoding) of one batch of turns;
    `around(True)` is called before the first steady step and `around(False)` after the last."""
    sessions = [engine.open_session() for _ in batch]
    params = SamplingParams(max_new_tokens=answer, ignore_eos=True)
    walls: list[float] = []
    started = False
    try:
        turns = [s.turn(p, params).request for s, p in zip(sessions, batch, strict=True)]
        while not all(t.finished for t in turns):
            steady = all(t.decoding and not t.finished for t in turns)
            if steady and not started and around is not None:
                around(True)
            started = started or steady
            sync(device)
            t0 = time.perf_counter()
            engine.step()
            sync(device)
            if steady:
                walls.append(time.perf_counter() - t0)
        if started and around is not None:
            around(False)
        failed = next((t.error for t in turns if t.error is not None), None)
        if failed is not None:
            raise failed
    finally:
        for s in sessions:
            s.close()
    return walls


def _prompts(engine: Engine, b: int, context: int, seed: int) -> list[Prompt]:
    """`b` distinct text prompts of `context` ids (distinct, so the prefix cache shares nothing)."""
    g = torch.Generator().manual_seed(seed)
    top = min(2000, engine.model_config.vocab_size - 16)
    return [Prompt(torch.randint(16, top, (context,), generator=g).tolist()) for _ in range(b)]


def _device_time(engine: Engine, prompts: list[Prompt], answer: int, device: str) -> dict:
    """{device_ms: kernel time per steady step, host_gap_ms: wall - device} from a round of `prompts` under
    the profiler."""
    prof = profile(activities=[ProfilerActivity.CUDA])
    profiled = decode_round(engine, prompts, answer, device,
                            around=lambda start: prof.start() if start else prof.stop())
    if not profiled:
        return {}
    kernels_us = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    device_ms = 1e-3 * kernels_us / len(profiled)
    return dict(device_ms=device_ms, host_gap_ms=1e3 * statistics.fmean(profiled) - device_ms)


def batched_decode(shape: Shape, device: str, dtype: str, backend: str, tiny: bool) -> dict:
    """{B: wall_ms, tokens_per_s, device_ms (kernel time per steady step), host_gap_ms (wall - device),
    staged_copies (the most a steady step's metadata made), staged_ahead (steps planned and staged during the last
    one's forward: engine/ahead.py, on by default on CUDA), steps; at the largest B also host_gap_ms_in_turn, the
    host gap with each step planned after the last} for B = 1, 16, 64 sessions over 1,536-token
    contexts (tiny: 1 and 64 over 24), each B after a warm-up batch of the same shape (compiles and captures
    what the timed batch meets)."""
    sizes, context, answer = ((1, 64), 24, 6) if tiny else ((1, 16, 64), 1536, 24)
    on_cuda = torch.device(device).type == "cuda"
    pages = max(sizes) * -(-(context + answer + 16) // 16) + 256
    # a GDN state slot per open session, and a few the engine keeps (the padding rows' scratch slot, cached
    # prefixes' states)
    engine = random_engine(shape, device, dtype, backend=backend, cuda_graphs=on_cuda, num_pages=pages,
                           max_gdn_slots=max(sizes) + 8)
    if not on_cuda:
        engine.use_step_graphs(capture=False)          # the same padded path, eagerly
    out: dict = {"context": context, "answer": answer, "graphs": on_cuda}
    for b in sizes:
        decode_round(engine, _prompts(engine, b, context, seed=3 * b), answer, device)
        copies: list[int] = []
        # the staging buffer of the step being read (steps staged ahead alternate between two)
        remove = engine.on_read(lambda plan, copies=copies, engine=engine: copies.append(engine.uploads.copies)
                                if all(s.rows == 1 for s in plan.segments) else None)
        launched = engine.ahead_counts.launched
        walls = decode_round(engine, _prompts(engine, b, context, seed=3 * b + 1), answer, device)
        remove()
        wall = statistics.median(walls)
        row = dict(steps=len(walls), wall_ms=1e3 * wall, tokens_per_s=b / wall, device_ms=None, host_gap_ms=None,
                   staged_copies=max(copies, default=None),
                   staged_ahead=engine.ahead_counts.launched - launched)     # steps launched as staged (CUDA)
        if on_cuda:      # on the CPU the host's time is all there is: no round of its own
            row.update(_device_time(engine, _prompts(engine, b, context, seed=3 * b + 2), answer, device))
            if b == max(sizes) and row.get("host_gap_ms") is not None:
                # the host gap with each step planned after the last (engine/ahead.py off), side by side
                engine.stage_ahead(False)
                gap = _device_time(engine, _prompts(engine, b, context, seed=3 * b + 2), answer, device)
                engine.stage_ahead(True)
                row["host_gap_ms_in_turn"] = gap.get("host_gap_ms")
        out[str(b)] = row
    first = out[str(sizes[0])]["tokens_per_s"]
    for b in sizes:
        out[str(b)]["scaling"] = out[str(b)]["tokens_per_s"] / first
    del engine
    return out
