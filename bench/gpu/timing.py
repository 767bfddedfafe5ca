"""Latency on the device: policies with decode graphs on and off, transformers' prefill and decode at the
same shape, the decode step over its physical floor, the GDN map update and join, a profile of a fused
step."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from raincheck_core import SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.models import build_decoder
from raincheck_core.ops.gdn import l2norm
from raincheck_core.ops.gdn_state_map import extend_map_, identity_map, join_state
from raincheck_core.speculative.config import SpeculativeConfig

from .. import spec
from ..common import TurnStats, run_turn
from .models import Shape, image_prompt, random_engine, transformers_model

if TYPE_CHECKING:
    from transformers.modeling_outputs import BaseModelOutputWithPast

POLICIES = {
    "full": DeferralConfig("full"),
    "hard": DeferralConfig("hard"),
    "raincheck": DeferralConfig("raincheck", tpot_slo=None, chunk_size=31, guard=16),
    "raincheck_objective": DeferralConfig("raincheck", chunk_size=31, guard=16),     # the default TPOT objective
    "post_answer": DeferralConfig("post_answer"),
}
GDN_LAYER = (32, 128)          # Qwen3.5-9B GDN layer: value heads, Dk = Dv


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Best of `repeats` calls (seconds), after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def policies(shape: Shape, device: str, dtype: str, visual: int, text: int, answer: int, graphs: bool,
             backend: str, guard: int = 16, warm_up: bool = True, repeats: int = 3) -> dict:
    """{policy: ttft, tpot, tpot_restoring, e2e, completion (s): medians of `repeats` timed turns, with
    their spread ((max - min) / median) and ratios to full} on one engine
    (`guard`: the raincheck policies', 16 unless a short dry run needs chunks within its answer;
    `warm_up`: one untimed turn per policy first, as long as the timed one, which compiles kernels and
    captures every decode-step skeleton the timed turn meets: a shorter one left chunk buckets and key
    buckets of the answer's end to be captured inside the timed turn, on the device 3 captures there
    put the fused TPOT at 115 ms instead of ~20). One turn is not enough: on the device, single TTFTs of
    the same turn were 38 and 64 ms in two runs)."""
    engine = random_engine(shape, device, dtype, backend=backend, cuda_graphs=graphs)
    if graphs and torch.device(device).type == "cpu":
        engine.use_step_graphs(capture=False)     # the same padded path, run eagerly
    prompt = image_prompt(engine, visual, text)
    step_graphs = engine.step_graphs
    out = {}
    for name, cfg in POLICIES.items():
        cfg = dataclasses.replace(cfg, guard=min(cfg.guard, guard))
        if warm_up:
            run_turn(engine, prompt, cfg, answer)
        before = 0 if step_graphs is None else len(step_graphs.graphs)
        turns = [run_turn(engine, prompt, cfg, answer) for _ in range(repeats)]
        t = turns[0]
        out[name] = dict(median(turns, "ttft_s", "tpot_s", "tpot_restoring_s", "e2e_s", "completion_s"),
                         deferred=t.deferred_tokens, pending=t.deferred_pending, restoring_steps=t.restoring_steps,
                         repeats=repeats, spread={k: spread([getattr(x, k + "_s") for x in turns])
                                                  for k in ("ttft", "tpot")},
                         # decode-step skeletons first met (and captured) inside the timed turns
                         new_skeletons=0 if step_graphs is None else len(step_graphs.graphs) - before)
    full = out["full"]
    for row in out.values():
        for key in ("ttft", "tpot", "e2e"):
            row[key + "_ratio"] = row[key] / full[key] if full[key] else None
    kept = [] if step_graphs is None else list(step_graphs.graphs.values())
    out["skeletons"] = len(kept)          # bucketed decode-step shapes met (padded, static buffers)
    out["captured"] = sum(1 for c in kept if c is not None and c.graph is not None)
    out["not_captured"] = sum(1 for c in kept if c is None)      # a capture raised: those steps ran eagerly
    out["replays"] = 0 if step_graphs is None else step_graphs.replays
    del engine
    return out


def median(turns: list[TurnStats], *fields: str) -> dict:
    """{field without its `_s`: the median over `turns`} (None where a turn has none)."""
    out = {}
    for f in fields:
        values = [getattr(t, f) for t in turns]
        out[f.removesuffix("_s")] = None if None in values else statistics.median(values)
    return out


def spread(values: list[float]) -> float | None:
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else None


def transformers_timing(shape: Shape, device: str, dtype: str, visual: int, text: int, answer: int) -> dict:
    """transformers' own prefill of the same rows (inputs_embeds) and greedy decode with its cache."""
    model = transformers_model(shape, device, getattr(torch, dtype))
    cfg = shape.model_config
    rows = visual + text + 2
    embeds = torch.randn(1, rows, cfg.hidden_size, device=device, dtype=getattr(torch, dtype))
    lm = model.model.language_model

    def prefill() -> BaseModelOutputWithPast:
        return lm(inputs_embeds=embeds, use_cache=True)

    with torch.no_grad():
        ttft = timed(prefill, device, 2)
        cache = prefill().past_key_values
        token = torch.zeros(1, 1, dtype=torch.long, device=device)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(answer):
            out = lm(input_ids=token, past_key_values=cache, use_cache=True)
            token = model.lm_head(out.last_hidden_state[:, -1:]).argmax(-1)
        sync(device)
    del model
    return dict(ttft=ttft, tpot=(time.perf_counter() - t0) / answer)


def copy_bandwidth(device: str, tiny: bool) -> float:
    """Bytes read + written per second by a device-to-device copy (1 GiB on a GPU: far past its caches)."""
    n = (1 << 20) if tiny else (1 << 28)
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, 5)
    return 2 * 4 * n / seconds


def floor(shape: Shape, device: str, dtype: str, tiny: bool) -> dict:
    """The decode step's physical floor: the weight bytes a step reads (every layer, the LM head) over the
    device-to-device copy bandwidth measured here (bytes read + written per second)."""
    cfg = shape.model_config
    item = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    with torch.device("meta"):
        decoder = build_decoder(cfg)
    weights = sum(p.numel() for n, p in decoder.named_parameters() if not n.startswith("embed_tokens"))
    if cfg.tie_word_embeddings:
        weights += cfg.vocab_size * cfg.hidden_size
    bandwidth = copy_bandwidth(device, tiny)
    return dict(weight_bytes=weights * item, copy_bandwidth=bandwidth, floor_s=weights * item / bandwidth)


def gdn_update_and_join(device: str, tiny: bool) -> dict:
    """At the Qwen3.5-9B GDN layer shape: the online map update of one generated token (us) and the join
    `S + P·ΔS` (us), fp32 as the engine keeps them."""
    heads, d = (4, 16) if tiny else GDN_LAYER
    g = torch.Generator(device="cpu").manual_seed(0)
    k = l2norm(torch.randn(1, heads, d, generator=g)).to(device)
    gate, beta = -torch.rand(1, heads, generator=g).to(device), torch.rand(1, heads, generator=g).to(device)
    p = identity_map(heads, d, device)
    live, delta = (torch.randn(heads, d, d, generator=g).to(device) for _ in range(2))
    repeats = 3 if tiny else 50
    return dict(heads=heads, dk=d, update_us_per_token=1e6 * timed(lambda: extend_map_(p, k, gate, beta), device,
                                                                    repeats),
                join_us=1e6 * timed(lambda: join_state(live, p, delta), device, repeats))


def profile_fused_step(shape: Shape, device: str, dtype: str, visual: int, text: int, backend: str,
                       steps: int = 8) -> dict:
    """The decode steps of a raincheck turn that each carry a c = 31 chunk (guard 0), eager (decode graphs
    off, so each kernel shows by name): per step, the top kernels by device time (on the CPU: the top ops by
    their own time), the device time and the wall time. The prompt's prefill and the first decode step are
    not in the profile."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    engine = random_engine(shape, device, dtype, backend=backend, cuda_graphs=False)
    prompt = image_prompt(engine, visual, text)
    cfg = dataclasses.replace(POLICIES["raincheck"], guard=0)
    run_turn(engine, prompt, cfg, 3)          # compiles what the turn needs
    on_cuda = torch.device(device).type == "cuda"
    session = engine.open_session(deferral=cfg)
    events = iter(session.turn(prompt, SamplingParams(max_new_tokens=steps + 3, ignore_eos=True)))
    next(events), next(events)                # the prefill's token and one decode step, outside the profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            next(events)
        sync(device)
    wall = time.perf_counter() - t0
    for _ in events:
        pass
    session.close()
    averages = prof.key_averages()
    if on_cuda:
        rows = [(e.key, getattr(e, "self_device_time_total", None) or e.self_cuda_time_total, e.count)
                for e in averages if e.device_type == DeviceType.CUDA]
    else:
        rows = [(e.key, e.self_cpu_time_total, e.count) for e in averages]
    rows.sort(key=lambda r: -r[1])
    total_us = sum(r[1] for r in rows)
    return dict(steps=steps, graphs=False, wall_ms_per_step=1e3 * wall / steps,
                device_ms_per_step=1e-3 * total_us / steps if on_cuda else None,
                top=[dict(name=name[:120], us_per_step=us / steps, calls_per_step=count / steps,
                          share=us / total_us if total_us else None) for name, us, count in rows[:20]],
                table=averages.table(sort_by="self_cuda_time_total" if on_cuda else "self_cpu_time_total",
                                     row_limit=20))


def speculation(shape: Shape, device: str, dtype: str, visual: int, text: int, answer: int, backend: str,
                repeats: int) -> dict:
    """bench.spec's arms on one engine of `shape` (speculation off; n-gram and replayed drafts, k = 1-3;
    full and raincheck): {policy: {arm: TPOT, tokens/s, ratio to off, acceptance, tokens per step}}. Decode
    steps are captured as usual; verify steps run eagerly (not captured yet), which this prices."""
    drafter = spec.BenchDrafter()
    engine = random_engine(shape, device, dtype, drafter=drafter, backend=backend,
                           speculative=SpeculativeConfig("ngram"))
    prompt = image_prompt(engine, visual, text)
    out = spec.measure(engine, drafter, [prompt], repeats, SamplingParams(max_new_tokens=answer, ignore_eos=True))
    del engine
    return out
