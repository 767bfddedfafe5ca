"""The paper's tables that this machine can measure, in one run (docs/paper.md sets them beside the paper's).

    python -m bench.paper [--quick] [--only table4,table5,table7,table8,fig4,fig9] [--json PATH] [--img DIR]

Sections, each a key of `--json` (the markdown printed names the same keys):
- `table4`: first-turn TTFT, mean TPOT and E2E of full / hard / raincheck (bench.latency's policy comparison:
  one 1,024-token image, random `bench` checkpoints of both families, CPU clock, best of the repeats);
- `table5`: per family and input (that image; an 8-patch video of 2,048 visual tokens, many deferred rows),
  raincheck turns with answers of several lengths: TPOT during restoration, the share of turns with deferred
  rows unfinished when the answer ended, and the post-response completion time (mean and P95 over all turns,
  0 for those restored before the end);
- `table7`: bytes per component read from the engine after one image and one video turn (Qwen3.5 `bench`):
  KV after recovery, deferred input features held while pending, GDN join state (maps, lead, buffers, prefix
  checkpoint), scheduling metadata (slot labels, restored-slot lists) and the packed inputs of the largest step;
- `table8`: the GDN state map on the Qwen3.5-9B layer shape (32 heads, Dk = Dv = 128): storage per layer, online
  update µs/token, join µs, relative error against token-by-token re-application, suffixes of 64 to 4,096;
- `fig4`: on demo-v2's single family, the share of dialogues whose first-question selection omits more than x%
  of the second question's (same image), MMTok and query_topk at 30% retention (a PNG);
- `fig9` and `table2`: demo-v2 quality (exact match, later answers and per turn T1 / T2 / T3+) at retention
  0.1 / 0.3 / 0.5 / 0.7 (hard and raincheck) and chunk 7 / 15 / 31 / 63 (raincheck, 0.3), MMTok, all three
  families (a PNG); table2 is the 0.3 / 31 cell per turn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from raincheck_core import DeferralConfig, Engine, Message, Prompt, SamplingParams, VisualInput
from raincheck_core.deferral.partition import partition_turn
from raincheck_core.engine.plan import StepPlan
from raincheck_demo.world import FAMILIES

from . import latency, quality
from .common import FAMILIES as MODEL_FAMILIES
from .common import build_engine, gdn_join_bench, image_prompt, run_turn, setup_torch, use_clock
from .quality_control import turn_input

SECTIONS = ("table4", "table5", "table7", "table8", "fig4", "fig9")
RETENTIONS = (0.1, 0.3, 0.5, 0.7)
CHUNKS = (7, 15, 31, 63)
SUFFIXES = (64, 256, 1024, 4096)


def video_prompt(engine: Engine, patches: int = 8, side: int = 16, seed: int = 1) -> Prompt:
    """A video of `patches` temporal patches of side×side merged tokens, each after a timestamp token."""
    cfg = engine.model_config
    n = patches * side * side
    g = torch.Generator().manual_seed(seed)
    visual = VisualInput("video", torch.randn(n, cfg.hidden_size, generator=g), (patches, 2 * side, 2 * side),
                         [torch.randn(n, cfg.hidden_size, generator=g) for _ in range(cfg.deepstack_levels)])
    ids = list(range(16, 48))
    for p in range(patches):
        ids += [100 + p, cfg.vision_start_token_id, *[cfg.video_token_id] * (side * side), cfg.vision_end_token_id]
    return Prompt([*ids, *range(48, 80)], [visual])


# ---------------------------------------------------------------------------- latency and memory (bench models)
def table4(engines: dict[str, Engine], args: argparse.Namespace) -> dict:
    largs = latency.parse_args(["--quick"] if args.quick else [])
    out = {}
    for family, engine in engines.items():
        res = latency.policies(engine, image_prompt(engine), largs, family)
        out[family] = {arm: {k: res[arm][k] for k in ("ttft_s", "tpot_s", "e2e_s", "ttft_ratio", "tpot_ratio",
                                                      "e2e_ratio")} for arm in ("full", "hard", "raincheck")}
    out["setting"] = {"repeats": largs.repeats, "max_new": largs.max_new, "visual_tokens": 1024}
    return out


def table5(engines: dict[str, Engine], args: argparse.Namespace) -> dict:
    lengths = (16, 48, 96) if args.quick else (16, 32, 64, 96, 128, 192)
    cfg = DeferralConfig("raincheck", selector="uniform", retention=0.3)
    out = {}
    for family, engine in engines.items():
        for name, prompt in (("image", image_prompt(engine)), ("video", video_prompt(engine))):
            turns = [run_turn(engine, prompt, cfg, n) for n in lengths]
            post = [t.completion_s for t in turns]
            restoring = [t.tpot_restoring_s for t in turns if t.tpot_restoring_s is not None]
            out[f"{family}/{name}"] = {
                "deferred_tokens": turns[0].deferred_tokens, "answers": list(lengths),
                "tpot_restoring_s": statistics.mean(restoring) if restoring else None,
                "unfinished": sum(t.deferred_pending > 0 for t in turns), "turns": len(turns),
                "post_response_mean_s": statistics.mean(post), "post_response_p95_s": float(np.percentile(post, 95))}
    return out


def table7(engine: Engine, args: argparse.Namespace) -> dict:
    out = {}
    kv_slot = engine.kv.k[:, 0].nbytes + engine.kv.v[:, 0].nbytes     # one token, every attention layer
    for name, prompt in (("image", image_prompt(engine)), ("video", video_prompt(engine))):
        for policy in ("full", "hard", "raincheck"):
            largest = [0]

            def step_bytes(plan: StepPlan, largest: list[int] = largest) -> None:
                rows = plan.rows
                lists = sum(s.read_slots.nbytes + s.write_slots.nbytes for s in plan.segments)
                largest[0] = max(largest[0], rows * engine.model_config.hidden_size * 4 + rows * 3 * 8 + lists)

            remove = engine.on_plan(step_bytes)
            session = engine.open_session(deferral=DeferralConfig(policy, selector="uniform", retention=0.3))
            try:
                session.turn(prompt, SamplingParams(max_new_tokens=32, ignore_eos=True)).result()
                rec = session.cache.recovery
                features = join = pending = 0
                if rec is not None:
                    pending = rec.pending
                    rows = rec.rows
                    features = rows.embeds.nbytes + rows.positions.nbytes + sum(d.nbytes for d in rows.deepstack)
                    join = rec.join.nbytes if rec.join is not None else 0
                metadata = session.cache.metadata_nbytes
                session.complete_recovery()
                out[f"{name}/{policy}"] = {"kv_after_recovery": session.cache.length * kv_slot,
                                           "deferred_features": features, "gdn_join": join,
                                           "scheduling_metadata": metadata, "step_inputs": largest[0],
                                           "pending_at_answer_end": pending}
            finally:
                session.close()
                remove()
    return out


def table8(args: argparse.Namespace) -> dict:
    rows = [r for r in gdn_join_bench(SUFFIXES, 2 if args.quick else 5) if r["shape"].startswith("qwen3.5-9b")]
    for r in rows:
        r["map_mib"] = r["heads"] * r["dk"] * r["dk"] * 4 / 2**20
    return {"rows": rows}


# ---------------------------------------------------------------------------- demo-v2 (selection and quality)
def fig4(engine: Engine, args: argparse.Namespace) -> dict:
    """Per selector: each dialogue's share of the second question's kept cells that the first question's
    selection (same image, 30%) omits; the curve is the share of dialogues above each threshold."""
    dialogues = quality.held_out("single", args.fig4_dialogues)
    out = {}
    with torch.no_grad():
        for sel in ("mmtok", "query_topk"):
            cfg = DeferralConfig("hard", selector=sel, selector_options=engine.selector_options.get(sel, {}),
                                 retention=0.3)
            omitted = []
            for d in dialogues:
                first = d.message(0)
                second = Message(d.questions[1].text, images=first.images, videos=first.videos)
                a, b = (_kept_cells(engine, m, cfg) for m in (first, second))
                omitted.append(len(b - a) / len(b))
            xs = list(range(0, 101, 5))
            out[sel] = {"mean_omitted": float(np.mean(omitted)), "dialogues": len(omitted), "x_percent": xs,
                        "share_above": [float(np.mean(np.array(omitted) > x / 100)) for x in xs]}
    return out


def _kept_cells(engine: Engine, message: Message, cfg: DeferralConfig) -> set[int]:
    """Indices within the first visual span of the cells a turn's selection keeps."""
    full, visuals = turn_input(engine, message, True, cfg)
    keep = set(partition_turn(full, visuals, cfg, engine.model_config.spatial_merge_size).keep_rows.tolist())
    span = full.layout.spans[0].token_indices.tolist()
    return {i for i, row in enumerate(span) if row in keep}


def fig9(engine: Engine, args: argparse.Namespace) -> dict:
    sel, options = "mmtok", engine.selector_options
    arms = [quality.Arm("full", "full")]
    arms += [quality.Arm(f"{p}@{r}", p, sel, r) for r in RETENTIONS for p in ("hard", "raincheck")]
    arms += [quality.Arm(f"raincheck/c{c}", "raincheck", sel, 0.3, c) for c in CHUNKS if c != 31]
    out = {}
    for family in FAMILIES:
        dialogues = quality.held_out(family, args.dialogues)
        messages = [[d.message(t) for t in range(len(d.questions))] for d in dialogues]
        scored = {a.name: quality.score(dialogues, [quality.run_engine_arm(engine, a.config(options), d, m)
                                                    for d, m in zip(dialogues, messages, strict=True)])
                  for a in arms}
        summary = {name: quality.summarise(s) for name, s in scored.items()}
        full = quality.later_answers(scored["full"])
        rec = {r: quality.recovered(full, quality.later_answers(scored[f"hard@{r}"]),
                                    quality.later_answers(scored[f"raincheck@{r}"])) for r in RETENTIONS}
        out[family] = {"dialogues": len(dialogues), "later": {n: s["later"] for n, s in summary.items()},
                       "all": {n: s["all"] for n, s in summary.items()}, "recovered_fraction": rec,
                       "turns": {n: {t: summary[n][t] for t in ("T1", "T2", "T3+")}
                                 for n in ("full", "hard@0.3", "raincheck@0.3")}}
    return out


def plot(out: dict, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    if "fig4" in out:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for sel, r in out["fig4"].items():
            ax.plot(r["x_percent"], [100 * v for v in r["share_above"]], marker="o", ms=3, label=sel)
        ax.set_xlabel("x: % of the second question's selection omitted by the first's")
        ax.set_ylabel("dialogues omitting more than x (%)")
        ax.set_title("Selection change between questions (demo-v2, 30%)")
        ax.legend()
        fig.tight_layout()
        paths.append(folder / "paper_fig4_selection.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    if "fig9" in out:
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
        for family, r in out["fig9"].items():
            line = left.plot(RETENTIONS, [100 * r["later"][f"raincheck@{x}"] for x in RETENTIONS], marker="o",
                             label=f"{family} raincheck")[0]
            left.plot(RETENTIONS, [100 * r["later"][f"hard@{x}"] for x in RETENTIONS], ls="--",
                      color=line.get_color(), label=f"{family} hard")
            later = [r["later"]["raincheck@0.3" if c == 31 else f"raincheck/c{c}"] for c in CHUNKS]
            right.plot(CHUNKS, [100 * v for v in later], marker="o", color=line.get_color(), label=family)
        left.set_xlabel("initial retention")
        left.set_ylabel("exact match, later answers (%)")
        right.set_xlabel("chunk size (retention 0.3)")
        right.set_xscale("log", base=2)
        right.set_xticks(CHUNKS, [str(c) for c in CHUNKS])
        left.legend(fontsize=7)
        right.legend(fontsize=7)
        fig.suptitle("Quality across retention and chunk size (demo-v2, MMTok)")
        fig.tight_layout()
        paths.append(folder / "paper_fig9_sweeps.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="bench.latency --quick sizes, 3 answer lengths, 24 "
                                                        "dialogues per family, 2 repeats of the GDN timings")
    ap.add_argument("--only", default=",".join(SECTIONS), help="sections to run, comma-separated")
    ap.add_argument("--model", default="models/demo-v2", help="the demo model (fig4, fig9)")
    ap.add_argument("--dialogues", type=int, help="fig9 dialogues per family (default 160; --quick 24)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--img", type=Path, help="folder for the PNGs (e.g. docs/img)")
    args = ap.parse_args(argv)
    args.only = args.only.split(",")
    if unknown := set(args.only) - set(SECTIONS):
        ap.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    args.dialogues = args.dialogues or (24 if args.quick else 160)
    args.fig4_dialogues = 40 if args.quick else 160
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    setup_torch(args.threads)
    out: dict = {"quick": args.quick}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if {"table4", "table5", "table7"} & set(args.only):
            engines = {f: build_engine(f, Path(tmp)) for f in MODEL_FAMILIES}
            for engine in engines.values():
                use_clock(engine, time.thread_time, calibrate=True)
            for name in ("table4", "table5"):
                if name in args.only:
                    out[name] = globals()[name](engines, args)
            if "table7" in args.only:
                out["table7"] = table7(engines["qwen3_5"], args)
            del engines
    if "table8" in args.only:
        out["table8"] = table8(args)
    if {"fig4", "fig9"} & set(args.only):
        demo = Engine.from_pretrained(args.model, num_threads=args.threads)
        for name in ("fig4", "fig9"):
            if name in args.only:
                out[name] = globals()[name](demo, args)
    out["wall_s"] = time.perf_counter() - t0
    print(json.dumps(out, indent=1))
    if args.img:
        for path in plot(out, args.img):
            print(f"wrote {path}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
