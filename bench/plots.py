"""PNG plots of `python -m bench.latency` results (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

POLICY_COLORS = {"hard": "#9e9e9e", "raincheck": "#1f77b4", "post_answer": "#ff7f0e"}
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
    width = 0.26
    for ax, (family, res) in zip(axes[0], results.items(), strict=True):
        for i, policy in enumerate(POLICY_COLORS):
            values = [res[policy][key] for key, _ in RATIOS]
            xs = [j + (i - 1) * width for j in range(len(RATIOS))]
            bars = ax.bar(xs, values, width, label=policy, color=POLICY_COLORS[policy])
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(RATIOS)), [label for _, label in RATIOS])
        ax.set_title(f"{family} (bench size), ratio to full")
    axes[0][0].set_ylabel("policy / full (best of repeats)")
    axes[0][0].legend(fontsize=8)
    return _save(fig, path)


def chunk_plot(sweep: dict, path: Path, max_new: int) -> Path:
    """Mean TPOT ratio (fused, serial) and restoring step time vs the chunk size."""
    rows = sweep["rows"]
    cs = [r["chunk"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for mode, style, color in (("fused", "o-", "C0"), ("serial", "s--", "C1")):
        left.plot(cs, [r[mode]["tpot_ratio"] for r in rows], style, color=color, label=f"{mode}, best of N")
        left.plot(cs, [r[mode]["tpot_steps_ratio"] for r in rows], style, color=color, alpha=0.45,
                  mfc="none", label=f"{mode}, step estimate")
        right.plot(cs, [1e3 * r[mode]["restoring_step_s"] for r in rows], style, color=color,
                   label=f"step with a chunk, {mode}")
    left.plot(cs, [r["fused"]["tpot_floor"] for r in rows], "^:", color="gray", label="compute floor")
    right.plot(cs, [1e3 * r["fused"]["plain_step_s"] for r in rows], "k:", label="plain decode step")
    left.axhline(1.10, color="red", lw=0.8, ls=":", label="goal 1.10")
    left.axhline(1.0, color="black", lw=0.8, ls="--")
    left.set_ylabel("raincheck mean TPOT / full")
    right.set_ylabel("ms per step (20th percentile)")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("deferred chunk size c (rows per step = c + 1)")
        ax.legend(fontsize=8)
    left.set_title(f"chunk size sweep ({max_new}-token answer)")
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


def save_all(folder: Path, results: dict[str, dict], chunk: dict | None, retention: dict | None,
             max_new: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [policies_plot(results, folder / "latency_policies.png")] if results else []
    if chunk:
        paths.append(chunk_plot(chunk, folder / "latency_chunk_sweep.png", max_new))
    if retention:
        paths.append(retention_plot(retention, folder / "latency_retention_sweep.png"))
    return paths
