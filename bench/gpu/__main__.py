"""`python -m bench.gpu [--device cuda] [--tiny] [--json PATH] [--budget-s S]`: see bench/gpu/__init__.py.
Each part's result is written as soon as it ends and a failing part is recorded and passed over
(bench/gpu/parts.py), so a run cut short or broken keeps what it measured."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
from functools import partial
from importlib import metadata
from pathlib import Path

import torch

from raincheck_core.ops import backend, fla_adapter

from .. import attention, parallel
from . import batched, exact, flex_check, kernels, timing
from .models import Shape, import_reference_models, shapes
from .parts import Parts

log = logging.getLogger("bench.gpu")


def parse(argv: list[str] | None) -> argparse.Namespace:
    out = Path(os.environ.get("OUT", "bench/out"))
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and short turns (the CPU dry run)")
    p.add_argument("--json", type=Path, default=out / "gpu.json")
    p.add_argument("--log", type=Path, default=None, help="default: the JSON's name with .log")
    p.add_argument("--budget-s", type=float, default=270.0,
                   help="no part starts after this many seconds (the one running finishes)")
    p.add_argument("--resume", type=Path, default=None,
                   help="an earlier run's JSON: its successful parts are kept, the others run")
    return p.parse_args(argv)


def backends(device: str) -> tuple[list[str], str]:
    """(the backends checked for exactness, the backend timed). On the CPU the timed backend is flex, so
    the dry run goes through the padded, bucketed decode path (eagerly: nothing is captured there)."""
    if torch.device(device).type == "cpu":
        return ["auto", "flex"], "flex"
    return ["torch", "flex", *(["fla"] if fla_adapter.available() else [])], "auto"


def versions() -> dict:
    """What the numbers were measured with."""
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("transformers", "triton", "fla-core", "llguidance", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def derive(result: dict) -> None:
    """Each row's decode TPOT over its floor, plain and with fused chunks, where both are measured."""
    for rows in result["shapes"].values():
        for row in rows.values():
            fl, on = row.get("floor", {}), row.get("graphs_on", {})
            if "floor_s" not in fl or "full" not in on:
                continue
            fused = on.get("raincheck", {}).get("tpot_restoring")
            row["tpot_over_floor"] = dict(plain=on["full"]["tpot"] / fl["floor_s"],
                                          fused=fused / fl["floor_s"] if fused else None)


def run(args: argparse.Namespace) -> dict:
    reference_gdn = import_reference_models()          # before anything imports fla
    tiny, device = args.tiny, args.device
    on_cpu = torch.device(device).type == "cpu"
    visual, text, answer, guard = ([16], 8, 6, 1) if tiny else ([1024, 4096], 64, 64, 16)
    dtype = "float32" if tiny and on_cpu else "bfloat16"
    checked, timed_backend = backends(device)
    result: dict = json.loads(args.resume.read_text()) if args.resume else {}
    result |= {
        "device": device if on_cpu else torch.cuda.get_device_name(device), "tiny": tiny, "dtype": dtype,
        "backend": timed_backend, "auto_on_cuda": backend.accelerated_backend(),
        "fla": fla_adapter.available(), "fla_import_error": fla_adapter.import_error(),
        "reference_gdn": reference_gdn, "versions": versions(), "budget_s": args.budget_s,
        "visual": visual, "text": text, "answer": answer, "guard": guard}
    result.setdefault("shapes", {})
    parts = Parts(result, args.json, args.budget_s, derive)
    parts.save()
    models = shapes(tiny)          # the one with GDN layers first

    if fla_adapter.available():
        parts.run(("fla_smoke",), lambda: kernels.fla_smoke(device, tiny))
    elif not parts.done(("fla_smoke",)):
        result["fla_smoke"] = {"skipped": f"fla does not import: {fla_adapter.import_error()}"}

    # the attention every engine step runs, on its own first: a failure here names the group kind at fault
    parts.run(("flex_check",), lambda: flex_check.flex_check(device, tiny, timing.copy_bandwidth(device, tiny)))

    def timings(shape: Shape, v: int, graphs: bool) -> None:
        parts.run(("shapes", shape.name, f"{v}_visual", "graphs_on" if graphs else "graphs_off"),
                  lambda: timing.policies(shape, device, dtype, v, text, answer, graphs, timed_backend, guard,
                                          warm_up=not tiny, repeats=1 if tiny else 3))

    def floor(shape: Shape, v: int) -> None:
        parts.run(("shapes", shape.name, f"{v}_visual", "floor"), lambda: timing.floor(shape, device, dtype, tiny))

    def hf(shape: Shape, v: int) -> None:
        parts.run(("shapes", shape.name, f"{v}_visual", "transformers"),
                  lambda: timing.transformers_timing(shape, device, dtype, v, text, answer))

    # by value: the GDN model's timing, exactness, the attention model's timing, transformers beside both,
    # the GDN kernels' own figures and the profile, then graphs off, then 4,096 visual tokens
    first, *more = visual
    timings(models[0], first, True)
    floor(models[0], first)
    exactness(parts, device, checked, ["float32"] if tiny else ["float32", "bfloat16"])
    for shape in models[1:]:
        timings(shape, first, True)
        floor(shape, first)
    for shape in models:
        hf(shape, first)
    for shape in models:     # B sessions over their own pages: the step's attention and GDN states in place
        parts.run(("batched_decode", shape.name), lambda shape=shape: batched.batched_decode(
            shape, device, dtype, timed_backend, tiny))
    parts.run(("gdn",), lambda: timing.gdn_update_and_join(device, tiny))
    parts.run(("attention_accounting",), lambda: {"rows": attention.accounting_table(device, tiny)})
    parts.run(("profile",), lambda: timing.profile_fused_step(models[0], device, dtype, first, text, timed_backend))
    for shape in models:
        timings(shape, first, False)
    for shape in models:     # speculative decoding: what verify rows cost where a decode step is memory-bound
        parts.run(("speculation", shape.name), lambda shape=shape: timing.speculation(
            shape, device, dtype, first, text, answer, timed_backend, 1 if tiny else 3))
    # tensor parallelism: TP = 2 over NCCL where two accelerators are lent (one today: TP = 1, said so)
    parts.run(("parallel",), lambda: parallel.device_run(device, tiny))
    for v in more:
        for shape in models:
            timings(shape, v, True)
            floor(shape, v)
            hf(shape, v)
    return result


def exactness(parts: Parts, device: str, checked: list[str], dtypes: list[str]) -> None:
    """Each family x dtype x backend as a part of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("qwen3_5", "qwen3_vl"):
            folder = Path(tmp) / family
            if all(parts.done(("exactness", family, dtype, name)) for dtype in dtypes for name in checked):
                continue
            parts.result.get("exactness", {}).get(family, {}).pop("reference", None)     # built again here
            model = parts.run(("exactness", family, "reference"), partial(exact.reference, family, folder),
                              record=lambda m: type(m).__name__)
            if model is None:
                continue
            for dtype in dtypes:
                for name in checked:
                    parts.run(("exactness", family, dtype, name),
                              partial(exact.case, model, folder, device, dtype, name))


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    handlers = [logging.StreamHandler(sys.stderr), logging.FileHandler(args.log or args.json.with_suffix(".log"))]
    for h in handlers:
        h.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(h)
    log.setLevel(logging.INFO)
    log.info("python %s on %s", platform.python_version(), platform.machine())
    try:
        run(args)
    finally:
        for h in handlers:
            log.removeHandler(h)
            h.close()


if __name__ == "__main__":
    main()
