"""Tables (Markdown) and PNG plots of `bench.quality` results."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes

KIND_COLUMNS = ("colour", "shape", "relation", "count", "list")


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def sweep_arm(out: dict, policy: str, retention: float | None = None, chunk: int | None = None) -> str:
    """The arm name of the sweep selector at `retention` (default 0.3) or `chunk` (default 31)."""
    r0, c0 = out["default"]["retention"], out["default"]["chunk_size"]
    name = f"{policy}/{out['sweep']['selector']}"
    if retention is not None and retention != r0:
        name += f"@{retention}"
    if chunk is not None and chunk != c0:
        name += f"/c{chunk}"
    return name


def table2(out: dict) -> str:
    """The paper's Table 2 shape: Full / Hard / Ours per turn and overall, relative change from Full."""
    arms = out["arms"]
    full = arms["full"]
    lines = [f"Exact match (%) per turn at retention {out['default']['retention']}, chunk "
             f"{out['default']['chunk_size']}; parentheses: relative change from full", "",
             "| selector | policy | T1 | T2 | T3+ | overall |", "|---|---|---|---|---|---|"]

    def cell(s: dict, key: str, relative: bool) -> str:
        if not relative or not full[key]:
            return _pct(s[key])
        return f"{_pct(s[key])} ({100 * (s[key] / full[key] - 1):+.1f}%)"

    lines.append("| – | full | " + " | ".join(cell(full, k, False) for k in ("T1", "T2", "T3+", "all")) + " |")
    for sel in out["per_selector"]:
        for policy, label in (("hard", "hard"), ("raincheck", "raincheck (ours)")):
            s = arms[f"{policy}/{sel}"]
            lines.append(f"| {sel} | {label} | " + " | ".join(cell(s, k, True) for k in ("T1", "T2", "T3+", "all"))
                         + " |")
    return "\n".join(lines)


FAMILY_TITLES = {"single": "one image with the first question", "multi": "1–3 images arriving at any turn",
                  "video": "a video of 2–4 frames (4–8 sent)"}


def _arm_table(rep: dict) -> list[str]:
    """Every arm of one family: per turn (single) or per age of the asked-about visual (others)."""
    arms = rep["arms"]
    kinds = [k for k in (*KIND_COLUMNS, "change", "text") if k in arms["full"]]
    if rep["family"] == "single":
        cols = ["all", "T1", "T2", "T3+", *kinds, "list_items_T1", "list_items_T2+"]
        names = ["all", "T1", "T2", "T3+", *kinds, "list items T1", "list items T2+"]
    else:
        cols = ["all", "arrival", "later", *kinds, "list_items_arrival", "list_items_later"]
        names = ["all", "arrival turn", "later turns", *kinds, "list items arrival", "list items later"]
    lines = ["| arm | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {name} | " + " | ".join(_pct(s.get(c)) for c in cols) + " |" for name, s in arms.items()]
    return lines


def family_markdown(rep: dict) -> str:
    """One family's tables: arms, recovered fraction per selector, negative control, selection overlap."""
    later = "turns 2+" if rep["family"] == "single" else "later turns (the visual arrived in an earlier turn)"
    lines = [f"**{rep['family']}** ({FAMILY_TITLES.get(rep['family'], '')}): exact match (%), {rep['dialogues']} "
             f"held-out dialogues, {rep['answers']} answers, {rep['later_answers']} on {later}; control arms: "
             f"first {rep['control_dialogues']}", "", *_arm_table(rep),
             "", f"{later[0].upper() + later[1:]}: exact match (%) and recovered fraction (raincheck − hard) / "
             "(full − hard), paired bootstrap 95% interval", "",
             "| selector | full | hard | raincheck | post_answer | recovered | 95% interval |",
             "|---|---|---|---|---|---|---|"]
    for sel, s in rep["per_selector"].items():
        lo, hi = s["ci95"]
        lines.append(f"| {sel} | {_pct(s['full_acc'])} | {_pct(s['hard_acc'])} | {_pct(s['raincheck_acc'])} | "
                     f"{_pct(s['post_answer_acc'])} | {_pct(s['recovered_fraction'])} | {_pct(lo)} – {_pct(hi)} |")
    lo, hi = rep["paper_selectors_ci95"]
    mean = _pct(rep["paper_selectors_recovered_fraction"])
    paper = rep.get("paper_selectors", ["mmtok", "hiprune", "divprune", "visionzip"])
    which = "the four paper selectors" if len(paper) == 4 else ", ".join(paper)
    lines.append(f"| **mean of {which}** | | | | | **{mean}** | {_pct(lo)} – {_pct(hi)} |")
    b = rep.get("bounded")
    if b:
        lines += ["", f"Bounded barrier (`barrier_timeout_s=0`, think time 0, {b['selector']}): {later} "
                  f"{_pct(b['acc'])} vs {_pct(b['raincheck_acc'])} waiting; recovered {_pct(b['recovered_fraction'])} "
                  f"vs {_pct(b['raincheck_recovered_fraction'])}; longest barrier wait "
                  f"{1e3 * b['barrier_wait_s_max']:.1f} ms vs {1e3 * b['raincheck_barrier_wait_s_max']:.1f} ms."]
    c = rep["control"]
    lines += ["", f"Negative control ({later}, first {rep['control_dialogues']} dialogues, default selector at 0.3): "
              f"full {_pct(c['full_acc_same_dialogues'])}, deferred tokens moved after the question with their "
              f"original positions {_pct(c['kept_acc'])}, with fresh sequential positions {_pct(c['fresh_acc'])}."]
    if rep.get("overlap"):
        pairs = rep["overlap"]
        first = next(iter(pairs.values()))
        above = next(k for k in first if k.startswith("above_"))
        lines += ["", f"Selection overlap: Jaccard index of the kept rows per visual ({first['visuals']} visuals), "
                  f"mean / max / share above {above.removeprefix('above_')}", "",
                  "| pair | mean | max | share above |", "|---|---|---|---|"]
        lines += [f"| {pair} | {v['mean']:.3f} | {v['max']:.3f} | {_pct(v[above])} |" for pair, v in pairs.items()]
    return "\n".join(lines)


def overview(out: dict) -> str:
    """One line per family: full, hard and raincheck on later answers (mean over the paper selectors)."""
    n = len(next(iter(out["families"].values()))["per_selector"])
    lines = [f"| family | full, all answers | full, later | hard, later (mean of {n}) | raincheck, later (mean of {n}) "
             f"| recovered (mean of {n}) | 95% interval | control kept / fresh |", "|---|---|---|---|---|---|---|---|"]
    for fam, rep in out["families"].items():
        sel = rep["per_selector"]
        paper = [s for s in sel if s in ("mmtok", "hiprune", "divprune", "visionzip")]
        hard = sum(sel[s]["hard_acc"] for s in paper) / len(paper)
        rc = sum(sel[s]["raincheck_acc"] for s in paper) / len(paper)
        lo, hi = rep["paper_selectors_ci95"]
        c = rep["control"]
        lines.append(f"| {fam} | {_pct(rep['full_acc_all'])} | {_pct(rep['full_acc'])} | {_pct(hard)} | {_pct(rc)} | "
                     f"{_pct(rep['paper_selectors_recovered_fraction'])} | {_pct(lo)} – {_pct(hi)} | "
                     f"{_pct(c['kept_acc'])} / {_pct(c['fresh_acc'])} |")
    return "\n".join(lines)


def markdown(out: dict) -> str:
    parts = [overview(out)]
    parts += [family_markdown(rep) for rep in out["families"].values()]
    if "single" in out["families"]:
        parts.append(table2(out["families"]["single"] | {"default": out["default"]}))
    return "\n\n".join(parts)


def plot(out: dict, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    arms, sel = out["arms"], out["default"]["selector"]
    names = ["full", f"hard/{sel}", f"raincheck/{sel}", f"post_answer/{sel}", "control/fresh"]
    names = [n for n in names if n in arms]
    turns = ("T1", "T2", "T3+")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([t + i * width for t in range(len(turns))], [100 * (arms[name][t] or 0) for t in turns], width,
               label=name)
    ax.set_xticks([t + 0.4 - width / 2 for t in range(len(turns))], turns)
    ax.set_ylabel("exact match (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"Demo model: accuracy per turn ({sel}, retention {out['default']['retention']})")
    ax.legend(fontsize=8, ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    per_turn = folder / "quality_per_turn.png"
    fig.savefig(per_turn, dpi=110)
    plt.close(fig)

    fams = out["families"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    xs = list(next(iter(fams.values()))["per_selector"])
    width = 0.8 / len(fams)
    for i, (fam, rep) in enumerate(fams.items()):
        per_sel = rep["per_selector"]
        vals = [100 * per_sel[s]["recovered_fraction"] for s in xs]
        errs = [[v - 100 * per_sel[s]["ci95"][0] for s, v in zip(xs, vals, strict=True)],
                [100 * per_sel[s]["ci95"][1] - v for s, v in zip(xs, vals, strict=True)]]
        ax.bar([x + i * width for x in range(len(xs))], vals, width, yerr=errs, capsize=3, label=fam)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(xs))], xs)
    ax.axhline(90, color="grey", ls="--", lw=1)
    ax.set_ylabel("recovered fraction, later turns (%)")
    ax.set_title("(raincheck − hard) / (full − hard) per family, 95% paired bootstrap interval")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    recovered = folder / "quality_recovered.png"
    fig.savefig(recovered, dpi=110)
    plt.close(fig)
    paths = [per_turn, recovered]
    if sweep_arm(out, "raincheck", chunk=out["sweep"]["chunks"][0]) in arms:
        paths.append(figure9(out, folder, plt))
    return paths


def figure9(out: dict, folder: Path, plt: ModuleType) -> Path:
    """The paper's Figure 9 shape: turns-2+ quality across retention ratios and chunk sizes (sweep
    selector), shading the 95% marginal bootstrap interval."""
    arms, sweep = out["arms"], out["sweep"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)

    def line(ax: Axes, xs: Sequence[float], names: list[str], label: str, style: str) -> None:
        ys = [100 * arms[n]["T2+"] for n in names]
        lo, hi = zip(*[[100 * v for v in arms[n]["T2+_ci95"]] for n in names], strict=True)
        ax.plot(xs, ys, style, label=label)
        ax.fill_between(xs, lo, hi, alpha=0.2)

    rs = list(sweep["retentions"])
    for policy, style in (("hard", "o-"), ("raincheck", "s-"), ("post_answer", "^--")):
        line(left, rs, [sweep_arm(out, policy, retention=r) for r in rs], policy, style)
    left.axhline(100 * arms["full"]["T2+"], color="grey", ls=":", label="full")
    left.set_xticks(rs)
    left.set_xlabel("initial retention")
    left.set_ylabel("exact match, turns 2+ (%)")
    right.set_ylabel("%")
    left.legend(fontsize=8)
    cs = list(sweep["chunks"])
    names = [sweep_arm(out, "raincheck", chunk=c) for c in cs]
    line(right, range(len(cs)), names, "raincheck: exact match, turns 2+", "s-")
    # Turns 2+ start after the completion barrier, whatever the chunk; the chunk size shows in how much of
    # a first-turn long answer the fused chunks restore in time.
    right.plot(range(len(cs)), [100 * arms[n]["list_items_T1"] for n in names], "d-.", color="tab:purple",
               label="raincheck: list items, turn 1")
    right.axhline(100 * arms[sweep_arm(out, "hard")]["list_items_T1"], color="tab:purple", ls=(0, (1, 3)),
                  label="hard: list items, turn 1")
    right.axhline(100 * arms[sweep_arm(out, "hard")]["T2+"], color="tab:blue", ls="--",
                  label="hard: exact match, turns 2+")
    right.axhline(100 * arms["full"]["T2+"], color="grey", ls=":", label="full")
    right.set_xticks(range(len(cs)), [str(c) for c in cs])
    right.set_xlabel(f"chunk size (retention {out['default']['retention']})")
    right.legend(fontsize=8)
    fig.suptitle(f"Demo model, {sweep['selector']}: quality across retention and chunk size")
    fig.tight_layout()
    path = folder / "quality_sweeps.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
