"""The markdown tables `python -m bench.latency` prints (bench/latency.py measures; this formats)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .common import markdown_table, ratio

if TYPE_CHECKING:
    from .latency import GapRow


def _ms(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{1e3 * x:.{digits}f}"


def _x(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def _slo(x: float | None) -> str:
    return "None (c = 31)" if x is None else f"{x:g}"


def policy_table(results: dict[str, dict]) -> str:
    header = ["model", "arm", "prefill rows", "TTFT ms (×full)", "mean TPOT ms (×full; paired; step est.)",
              "TPOT restoring ms", "E2E ms (×full)", "D restored before end", "completion ms"]
    return markdown_table(header, (
        [family, a, s["prompt_tokens"], f"{_ms(s['ttft_s'])} ({_x(s['ttft_ratio'])})",
         f"{_ms(s['tpot_s'], 2)} ({_x(s['tpot_ratio'])}; {_x(s['tpot_ratio_paired'])}; {_x(s['tpot_steps_ratio'])})",
         _ms(s["tpot_restoring_s"], 2), f"{_ms(s['e2e_s'], 0)} ({_x(s['e2e_ratio'])})",
         f"{_pct(s['restored_before_end'])} of {s['deferred_tokens']}", _ms(s["completion_s"])]
        for family, res in results.items() for a, s in res.items()))


def objective_table(sweep: dict) -> str:
    """Also the TPOT over the turn's own median plain step, what the objective bounds (a turn with D
    pending has dearer plain steps than full's: the ratio to full is the objective times that)."""
    full_plain = sweep["full"]["plain_median_s"]
    header = ["tpot_slo", "mean TPOT ×full (paired; step est.)", "median TPOT ÷ own plain step",
              "own plain step ×full", "D restored before end", "chunk steps", "TTFT ×full", "completion ms"]
    return markdown_table(header, (
        [_slo(row["objective"]),
         f"{_x(row['tpot_ratio'])} ({_x(row['tpot_ratio_paired'])}; {_x(row['tpot_steps_ratio'])})",
         _x(ratio(row["tpot_s_median"], row["plain_median_s"])), _x(ratio(row["plain_median_s"], full_plain)),
         _pct(row["restored_before_end"]), row["restoring_steps"], _x(row["ttft_ratio"]), _ms(row["completion_s"])]
        for row in sweep["rows"]))


def chunk_table(sweep: dict) -> str:
    header = ["c (rows/step)", "mean TPOT ×full (step est.), fused / serial", "compute floor", "plain step ms",
              "c-row step ms, fused / serial", "extra ms (fused)", "fused/serial (p20)", "chunk steps"]

    def cells(row: dict) -> list[object]:
        f, s = row["fused"], row.get("serial")
        serial = f"{_x(s['tpot_ratio'])} ({_x(s['tpot_steps_ratio'])})" if s else "–"
        return [f"{row['chunk']} ({row['chunk'] + 1})",
                f"{_x(f['tpot_ratio'])} ({_x(f['tpot_steps_ratio'])}) / {serial}", _x(f["tpot_floor"]),
                _ms(row["plain_median_s"], 2),
                f"{_ms(row['chunk_median_s'], 2)} / {_ms(row.get('serial_chunk_median_s'), 2)}",
                _ms(row["extra_s"], 2),
                f"{_x(row.get('fused_over_serial'))} ({_x(row.get('fused_over_serial_steps'))})", f["restoring_steps"]]
    return markdown_table(header, map(cells, sweep["rows"]))


def retention_table(sweep: dict) -> str:
    header = ["retention", "prefill rows / deferred", "TTFT ×full", "mean TPOT ×full (step est.)",
              "D restored before end", "E2E ×full", "completion ms"]
    return markdown_table(header, (
        [row["retention"], f"{row['prompt_tokens']} / {row['deferred_tokens']}", _x(row["ttft_ratio"]),
         f"{_x(row['tpot_ratio'])} ({_x(row['tpot_steps_ratio'])})", _pct(row["restored_before_end"]),
         _x(row["e2e_ratio"]), _ms(row["completion_s"])]
        for row in sweep["rows"]))


def think_table(rows: list[GapRow]) -> str:
    header = ["arm", "think time s", "turn-1 TTFT ms", "turn-1 mean TPOT ms", "D restored before end",
              "barrier wait ms, turn 2 / 3"]
    return markdown_table(header, (
        [r.arm, f"{r.think_s:g}", _ms(r.ttft_s), _ms(r.tpot_s, 2), _pct(r.restored_before_end),
         f"{_ms(r.barrier_wait_s[0])} / {_ms(r.barrier_wait_s[1])}"]
        for r in rows))


def gdn_table(rows: list[dict]) -> str:
    header = ["layer (value heads × Dk × Dv)", "suffix n", "online P update µs/token (1-token call)",
              "GDN state step µs", "join µs", "join rel. error", "error without join"]
    return markdown_table(header, (
        [f"{r['shape']} ({r['heads']}×{r['dk']}×{r['dv']})", r["suffix"],
         f"{r['extend_us_per_token']:.0f} ({r['extend_call_us']:.0f})", f"{r['state_step_us']:.0f}",
         f"{r['join_us']:.0f}", f"{r['join_rel_err']:.1e}", f"{r['stale_rel_err']:.2f}"]
        for r in rows))


CROSS_CHECKS = {"ttft_ratio": ("ttft_ratio_paired", "median of same-round ratios"),
                "tpot_ratio": ("tpot_ratio_paired", "median of same-round ratios"),
                "fixed_chunk_cost_ms": (None, ""),
                "tpot_ratio_fixed": ("tpot_ratio_fixed_paired", "median of same-round ratios"),
                "barrier_wait_s_think_ge_1s": (None, ""),
                "fused_over_serial": ("fused_over_serial_steps", "chunk step p20 ratio"),
                "join_rel_err": (None, "")}


def goal_table(head: dict, goals: dict[str, float]) -> str:
    """Each goal (`goals`: name -> upper bound) the run measured, its cross-check, and whether both meet it."""
    rows = []
    for key, target in goals.items():
        if head.get(key) is None:
            continue
        other, what = CROSS_CHECKS[key]
        values = [head[key]] + ([head[other]] if other and head.get(other) is not None else [])
        fmt = "{:.1e}" if key == "join_rel_err" else "{:.3f}" if key.startswith("barrier") else "{:.2f}"
        met = sum(v <= target for v in values)
        verdict = "yes" if met == len(values) else "no" if met == 0 else "on one of the two"
        check = f"{fmt.format(values[1])} ({what})" if len(values) > 1 else "–"
        rows.append([key, f"≤ {target:g}", fmt.format(values[0]), check, verdict])
    return markdown_table(["goal", "target", "measured", "cross-check", "met"], rows)
