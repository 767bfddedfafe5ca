"""Tables (Markdown) and PNG plots of `bench.quality` results."""

from __future__ import annotations

from pathlib import Path

KIND_COLUMNS = ("colour", "shape", "relation", "count", "list")


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def markdown(out: dict) -> str:
    arms = out["arms"]
    kinds = [k for k in KIND_COLUMNS if k in arms["full"]]
    head = "| arm | all | T1 | T2 | T3+ | " + " | ".join(kinds) + " | list items T1 | list items T2+ |"
    lines = [f"Exact match (%), {out['dialogues']} held-out dialogues (control arms: {out['control_dialogues']})",
             "", head, "|" + "---|" * (head.count("|") - 1)]
    for name, s in arms.items():
        cells = [s["all"], s["T1"], s["T2"], s["T3+"], *(s.get(k) for k in kinds), s["list_items_T1"],
                 s["list_items_T2+"]]
        lines.append(f"| {name} | " + " | ".join(_pct(c) for c in cells) + " |")
    lines += ["", "Turns 2+: exact match (%) and recovered fraction (raincheck − hard) / (full − hard), "
              "paired bootstrap 95% interval", "",
              "| selector | full | hard | raincheck | post_answer | recovered | 95% interval |",
              "|---|---|---|---|---|---|---|"]
    for sel, s in out["per_selector"].items():
        lo, hi = s["ci95"]
        lines.append(f"| {sel} | {_pct(s['full_acc'])} | {_pct(s['hard_acc'])} | {_pct(s['raincheck_acc'])} | "
                     f"{_pct(s['post_answer_acc'])} | {_pct(s['recovered_fraction'])} | "
                     f"{_pct(lo)} – {_pct(hi)} |")
    lo, hi = out["paper_selectors_ci95"]
    mean = _pct(out["paper_selectors_recovered_fraction"])
    lines.append(f"| **mean of the four paper selectors** | | | | | **{mean}** | {_pct(lo)} – {_pct(hi)} |")
    c = out["control"]
    lines += ["", f"Negative control (turns 2+, first {out['control_dialogues']} dialogues, "
              f"{out['default']['selector']} at {out['default']['retention']}): full "
              f"{_pct(c['full_acc_same_dialogues'])}, deferred tokens moved after the question with their original "
              f"positions {_pct(c['kept_acc'])}, with fresh sequential positions {_pct(c['fresh_acc'])}."]
    return "\n".join(lines)


def plot(out: dict, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    arms, sel = out["arms"], out["default"]["selector"]
    names = ["full", f"hard/{sel}", f"raincheck/{sel}", f"post_answer/{sel}", "control/fresh"]
    names = [n for n in names if n in arms]
    turns = ("T1", "T2", "T3+")
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([t + i * width for t in range(len(turns))], [100 * (arms[name][t] or 0) for t in turns], width,
               label=name)
    ax.set_xticks([t + 0.4 - width / 2 for t in range(len(turns))], turns)
    ax.set_ylabel("exact match (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"Demo model: accuracy per turn ({sel}, retention {out['default']['retention']})")
    ax.legend(fontsize=8, ncols=2)
    fig.tight_layout()
    per_turn = folder / "quality_per_turn.png"
    fig.savefig(per_turn, dpi=110)
    plt.close(fig)

    per_sel = out["per_selector"]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    xs = list(per_sel)
    vals = [100 * per_sel[s]["recovered_fraction"] for s in xs]
    errs = [[v - 100 * per_sel[s]["ci95"][0] for s, v in zip(xs, vals, strict=True)],
            [100 * per_sel[s]["ci95"][1] - v for s, v in zip(xs, vals, strict=True)]]
    ax.bar(xs, vals, yerr=errs, capsize=4, color="tab:green")
    ax.axhline(85, color="grey", ls="--", lw=1)
    ax.set_ylabel("recovered fraction, turns 2+ (%)")
    ax.set_title("(raincheck − hard) / (full − hard), 95% paired bootstrap interval")
    fig.tight_layout()
    recovered = folder / "quality_recovered.png"
    fig.savefig(recovered, dpi=110)
    plt.close(fig)
    return [per_turn, recovered]
