"""`python -m bench.gpu.report RESULT.json`: a device run's JSON as the markdown tables docs/BENCHMARKS.md
carries (exactness, the policies per shape beside the paper's Table 4, TPOT over its floor, the GDN
kernels, the fused step's top kernels, FlexAttention over the pool alone and batched decode steps)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .timing import POLICIES

# the paper's Table 4 (raincheck against full, at its own settings): TTFT and TPOT change
PAPER_TABLE_4 = {"qwen3-vl-8b": (-24.1, +0.13), "qwen3.5-9b": (-17.9, +0.47)}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * (ratio - 1):+.1f}%"


def exactness(result: dict) -> list[str]:
    lines = ["| family | dtype | backend | max abs logit error, full | raincheck |", "|---|---|---|---|---|"]
    for family, by_dtype in result.get("exactness", {}).items():
        for dtype, by_backend in by_dtype.items():
            if not isinstance(by_backend, dict):
                continue
            for backend, e in by_backend.items():
                if "full" in e:
                    lines.append(f"| {family} | {dtype} | {backend} | {e['full']:.2e} | {e['raincheck']:.2e} |")
                else:
                    lines.append(f"| {family} | {dtype} | {backend} | {e.get('error', e)} | |")
    return lines


def policies(result: dict) -> list[str]:
    lines = ["| shape | visual | graphs | policy | TTFT ms | TPOT ms | TPOT fused ms | E2E ms | completion ms "
             "| TTFT vs full | TPOT vs full |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rows in result.get("shapes", {}).items():
        for visual, row in rows.items():
            for graphs in ("graphs_on", "graphs_off"):
                block = row.get(graphs, {})
                for policy in POLICIES:
                    p = block.get(policy)
                    if p is None:
                        continue
                    lines.append(f"| {name} | {visual.split('_')[0]} | {graphs[7:]} | {policy} | {_ms(p['ttft'])} "
                                 f"| {_ms(p['tpot'])} | {_ms(p['tpot_restoring'])} | {_ms(p['e2e'])} "
                                 f"| {_ms(p['completion'])} | {_pct(p['ttft_ratio'])} | {_pct(p['tpot_ratio'])} |")
            hf = row.get("transformers", {})
            if "ttft" in hf:
                lines.append(f"| {name} | {visual.split('_')[0]} | eager | transformers | {_ms(hf['ttft'])} "
                             f"| {_ms(hf['tpot'])} | | | | | |")
        ttft, tpot = PAPER_TABLE_4.get(name, (None, None))
        if ttft is not None:
            lines.append(f"| {name} | paper | | raincheck (Table 4) | | | | | | {ttft:+.1f}% | {tpot:+.2f}% |")
    return lines


def floors(result: dict) -> list[str]:
    lines = ["| shape | visual | weight GB | copy TB/s | floor ms | plain TPOT / floor | fused TPOT / floor |",
             "|---|---|---|---|---|---|---|"]
    for name, rows in result.get("shapes", {}).items():
        for visual, row in rows.items():
            f, over = row.get("floor", {}), row.get("tpot_over_floor", {})
            if "floor_s" in f:
                fused = over.get("fused")
                lines.append(f"| {name} | {visual.split('_')[0]} | {f['weight_bytes'] / 1e9:.2f} "
                             f"| {f['copy_bandwidth'] / 1e12:.2f} | {1e3 * f['floor_s']:.2f} "
                             f"| {over.get('plain', 0):.2f} | {'-' if fused is None else f'{fused:.2f}'} |")
    return lines


def kernels(result: dict) -> list[str]:
    lines = []
    smoke = result.get("fla_smoke", {})
    if "adapter_fp32" in smoke:
        lines += ["| fla chunk kernel (H = 32, D = 128) | rel. error o | final | split | first call s | warm ms |",
                  "|---|---|---|---|---|---|"]
        for case in ("adapter_fp32", "adapter_bf16_inputs", "direct_bf16"):
            c = smoke[case]
            e = c["errors"]
            split = "-" if e.get("split") is None else f"{e['split']:.1e}"
            lines.append(f"| {case} | {e['o']:.1e} | {e['final']:.1e} | {split} | {c['cold_s']:.1f} "
                         f"| {c['warm_ms']:.2f} |")
        lines.append(f"| torch rule (fp32) | | | | | {smoke['torch_rule_ms']:.2f} |")
    gdn = result.get("gdn", {})
    if "join_us" in gdn:
        lines += ["", f"GDN map update {gdn['update_us_per_token']:.1f} us/token, join {gdn['join_us']:.1f} us "
                      f"(H = {gdn['heads']}, Dk = {gdn['dk']})."]
    prof = result.get("profile", {})
    if "top" in prof:
        lines += ["", f"Fused c = 31 decode step, eager: {prof['wall_ms_per_step']:.1f} ms wall, "
                      f"{prof['device_ms_per_step'] or 0:.1f} ms of kernels per step.", "",
                  "| kernel | us / step | calls / step | share |", "|---|---|---|---|"]
        for k in prof["top"][:12]:
            lines.append(f"| `{k['name'][:70]}` | {k['us_per_step']:.0f} | {k['calls_per_step']:.1f} "
                         f"| {100 * (k['share'] or 0):.1f}% |")
    return lines


def attention(result: dict) -> list[str]:
    """FlexAttention over the pool on its own (flex_check) and batched decode steps (batched_decode)."""
    lines = []
    check = result.get("flex_check", {})
    for case, c in check.get("groups", {}).items():
        lines.append(f"FlexAttention groups, {case}: query buckets {c['buckets']}, max error / max |ref| "
                     f"{c['max_error']:.1e}, first call {c['first_s']:.1f} s.")
    if check.get("decode"):
        lines += ["", "| decode, B x context | ms / call | layout host ms | K+V visible MB | read / visible | GB/s "
                      "| over copy bandwidth |", "|---|---|---|---|---|---|---|"]
        for r in check["decode"]:
            over = "-" if r["over_copy_bandwidth"] is None else f"{r['over_copy_bandwidth']:.2f}"
            lines.append(f"| {r['sessions']} x {r['context']} | {r['ms']:.3f} | {r['layout_host_ms']:.2f} "
                         f"| {r['kv_visible_mb']:.1f} | {r['kv_read_over_visible']:.3f} | {r['gb_per_s']:.0f} "
                         f"| {over} |")
    batched = {name: r for name, r in result.get("batched_decode", {}).items() if "context" in r}
    if batched:
        lines += ["", "| shape | B | step ms | tokens/s | scaling | device ms | wall - device ms | staged copies "
                  "| steps staged ahead |", "|---|---|---|---|---|---|---|---|---|"]
        for name, r in batched.items():
            for b, row in r.items():
                if isinstance(row, dict):
                    dev = "-" if row["device_ms"] is None else f"{row['device_ms']:.2f}"
                    gap = "-" if row["host_gap_ms"] is None else f"{row['host_gap_ms']:.2f}"
                    lines.append(f"| {name} | {b} | {row['wall_ms']:.2f} | {row['tokens_per_s']:.0f} "
                                 f"| {row['scaling']:.2f} | {dev} | {gap} | {row.get('staged_copies', '-')} "
                                 f"| {row.get('staged_ahead', '-')} |")
                    if row.get("host_gap_ms_in_turn") is not None:
                        lines.append(f"| {name} | {b}, planned in turn | | | | | "
                                     f"{row['host_gap_ms_in_turn']:.2f} | | 0 |")
    return lines


def parallel(result: dict) -> list[str]:
    par = result.get("parallel", {})
    if "engine_started" not in par:
        return []
    lines = ["| TP | process | peak RSS MiB | decode step ms |", "|---|---|---|---|"]
    for world, procs in par["engine_started"].items():
        for rank, proc in enumerate(procs):
            step = "" if "step_ms" not in proc else f"{proc['step_ms']:.2f}"
            lines.append(f"| {world} | rank {rank} | {proc['peak_rss_mib']:.0f} | {step} |")
    return lines + ([f"({par['note']})"] if par.get("note") else [])


def report(result: dict) -> str:
    head = (f"{result.get('device')}, torch {result.get('versions', {}).get('torch')}, backend "
            f"{result.get('backend')} (auto on CUDA: {result.get('auto_on_cuda')}), reference GDN "
            f"`{result.get('reference_gdn')}`")
    return "\n".join([head, "", *exactness(result), "", *policies(result), "", *floors(result), "",
                      *kernels(result), "", *attention(result), "",
                      *parallel(result)]) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.report", description=__doc__)
    p.add_argument("result", type=Path)
    print(report(json.loads(p.parse_args(argv).result.read_text())), end="")


if __name__ == "__main__":
    main()
