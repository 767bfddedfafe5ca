"""PNG plots of `python -m bench.latency` results (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

POLICY_COLORS = {"hard": "#9e9e9e", "raincheck": "#1f77b4", "raincheck_fixed": "#aec7e8", "post_answer": "#ff7f0e"}
RATIOS = (("ttft_ratio", "TTFT"), ("tpot_ratio", "mean TPOT"), ("tpot_steps_ratio", "mean TPOT\n(step est.)"),
          ("e2e_ratio", "E2E"))


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def policies_plot(results: dict[str, dict], path: Path) -> Path:
    """Grouped bars: per family, TTFT / mean TPOT / E2E of each policy relative to `full`."""
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 3.8), squeeze=False, sharey=True)
    shown = [p for p in POLICY_COLORS if all(p in res for res in results.values())]
    width = 0.8 / len(shown)
    for ax, (family, res) in zip(axes[0], results.items(), strict=True):
        for i, policy in enumerate(shown):
            values = [res[policy][key] for key, _ in RATIOS]
            xs = [j + (i - (len(shown) - 1) / 2) * width for j in range(len(RATIOS))]
            bars = ax.bar(xs, values, width, label=policy, color=POLICY_COLORS[policy])
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(RATIOS)), [label for _, label in RATIOS])
        ax.set_title(f"{family} (bench size), ratio to full")
    axes[0][0].set_ylabel("policy / full (best of repeats)")
    axes[0][0].legend(fontsize=8)
    return _save(fig, path)


def chunk_plot(sweep: dict, path: Path, max_new: int) -> Path:
    """Mean TPOT ratio (fused, serial where measured) and the median step time vs the chunk size, with
    the fitted fixed + per-row extra cost of a chunk step when the sweep has it."""
    rows = sweep["rows"]
    cs = [r["chunk"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for mode, style, color in (("fused", "o-", "C0"), ("serial", "s--", "C1")):
        measured = [r for r in rows if mode in r]
        xs = [r["chunk"] for r in measured]
        left.plot(xs, [r[mode]["tpot_ratio"] for r in measured], style, color=color, label=f"{mode}, best of N")
        left.plot(xs, [r[mode]["tpot_steps_ratio"] for r in measured], style, color=color, alpha=0.45,
                  mfc="none", label=f"{mode}, step estimate")
        key = "chunk_median_s" if mode == "fused" else "serial_chunk_median_s"
        right.plot(xs, [1e3 * (r.get(key) or r[mode]["restoring_step_s"]) for r in measured], style, color=color,
                   label=f"step with a chunk, {mode}")
    left.plot(cs, [r["fused"]["tpot_floor"] for r in rows], "^:", color="gray", label="compute floor")
    plain = [1e3 * (r.get("plain_median_s") or r["fused"]["plain_step_s"]) for r in rows]
    right.plot(cs, plain, "k:", label="plain decode step")
    if "fixed_chunk_cost_s" in sweep:
        fixed, per_row = 1e3 * sweep["fixed_chunk_cost_s"], 1e3 * sweep["per_row_cost_s"]
        right.plot(cs, [p + fixed + per_row * c for p, c in zip(plain, cs, strict=True)], "-", color="gray",
                   alpha=0.6, label=f"plain + {fixed:.1f} ms + {per_row:.2f} ms/row (fit)")
    left.axhline(1.10, color="red", lw=0.8, ls=":", label="goal 1.10")
    left.axhline(1.0, color="black", lw=0.8, ls="--")
    left.set_ylabel("raincheck mean TPOT / full")
    right.set_ylabel("ms per step")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("deferred chunk size c (rows per step = c + 1)")
        ax.legend(fontsize=8)
    left.set_title(f"fixed chunk size (tpot_slo=None), {max_new}-token answer")
    right.set_title("time of a step carrying a chunk")
    return _save(fig, path)


def retention_plot(sweep: dict, path: Path) -> Path:
    rows = sweep["rows"]
    rs = [r["retention"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.2, 3.6))
    for key, label in RATIOS:
        ax.plot(rs, [r[key] for r in rows], "o-", label=label.replace("\n", " "))
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.axhline(0.45, color="red", lw=0.8, ls=":", label="TTFT goal 0.45")
    ax.set_xticks(rs)
    ax.set_xlabel("retention r (first-prefill share of visual tokens)")
    ax.set_ylabel("raincheck / full")
    ax.set_title("retention sweep (c = 31)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return _save(fig, path)


def objective_plot(sweep: dict, path: Path, max_new: int, goal: float = 1.10) -> Path:
    """The TPOT objective's trade-off: raincheck's mean TPOT / full vs the share of the deferred tokens
    restored during the answer, one point per `tpot_slo` (None: fixed c = 31), with the objective itself."""
    rows = sweep["rows"]
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    for key, style, label in (("tpot_ratio", "o-", "best of N"), ("tpot_ratio_paired", "s--", "paired median")):
        xs = [100 * r["restored_before_end"] for r in rows]
        ax.plot(xs, [r[key] for r in rows], style, color="C0", alpha=1.0 if key == "tpot_ratio" else 0.45,
                mfc=None if key == "tpot_ratio" else "none", label=f"mean TPOT / full, {label}")
    for r in rows:
        x = 100 * r["restored_before_end"]
        name = "None (c = 31)" if r["objective"] is None else f"{r['objective']:g}"
        ax.annotate(name, (x, r["tpot_ratio"]), textcoords="offset points", xytext=(5, -12), fontsize=8)
        if r["objective"] is not None:
            ax.plot([x], [r["objective"]], "_", color="red", ms=14, mew=1.5)
    ax.plot([], [], "_", color="red", ms=14, mew=1.5, label="the objective (tpot_slo)")
    ax.axhline(goal, color="red", lw=0.8, ls=":", label=f"goal {goal:g} (default objective)")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xlabel("share of the deferred tokens restored before the answer ended (%)")
    ax.set_ylabel("raincheck mean TPOT / full")
    ax.set_title(f"TPOT objective trade-off ({max_new}-token answer), one point per tpot_slo")
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, path)


def save_all(folder: Path, results: dict[str, dict], chunk: dict | None, retention: dict | None,
             max_new: int, objective: dict | None = None) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [policies_plot(results, folder / "latency_policies.png")] if results else []
    if objective:
        paths.append(objective_plot(objective, folder / "latency_objective.png", max_new))
    if chunk:
        paths.append(chunk_plot(chunk, folder / "latency_chunk_sweep.png", max_new))
    if retention:
        paths.append(retention_plot(retention, folder / "latency_retention_sweep.png"))
    return paths


def batch_plot(results: dict[str, dict], path: Path) -> Path:
    """`python -m bench.batch`: per family, decode tokens/s (CPU time) vs the number of concurrent
    sessions N, text-only and image (raincheck) turns, with perfect scaling from N = 1 for reference."""
    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 3.8), squeeze=False)
    for ax, (family, res) in zip(axes[0], results.items(), strict=True):
        for (name, rows), color in zip(res["scaling"].items(), ("C0", "C2"), strict=False):
            ns = [r["n"] for r in rows]
            tps = [r["tokens_per_s"] for r in rows]
            ax.plot(ns, tps, "o-", color=color, label=name)
            ax.plot(ns, [tps[0] * n / ns[0] for n in ns], ":", color=color, alpha=0.5, label=f"{name}, ×N ideal")
            for n, t, r in zip(ns, tps, (row["ratio"] for row in rows), strict=True):
                ax.annotate(f"{r:.1f}×", (n, t), textcoords="offset points", xytext=(4, -11), fontsize=7, color=color)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("concurrent sessions N")
        ax.set_title(f"{family} (bench size), 1 thread")
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("decode tokens/s (thread CPU time)")
    return _save(fig, path)
