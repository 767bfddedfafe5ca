"""`python -m bench.gpu [--device cuda] [--tiny] [--json PATH]`: see bench/gpu/__init__.py. Each part's
results are written as soon as it ends, so a run cut short keeps what it measured."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from raincheck_core.ops import fla_adapter

from . import exact, timing
from .models import shapes

log = logging.getLogger("bench.gpu")


def parse(argv: list[str] | None) -> argparse.Namespace:
    out = Path(os.environ.get("OUT", "bench/out"))
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and short turns (the CPU dry run)")
    p.add_argument("--json", type=Path, default=out / "gpu.json")
    p.add_argument("--log", type=Path, default=None, help="default: the JSON's name with .log")
    return p.parse_args(argv)


def backends(device: str, tiny: bool) -> tuple[list[str], str]:
    """(the backends checked for exactness, the backend timed)."""
    if torch.device(device).type == "cpu":
        return ["auto", "flex"], "auto"
    return ["torch", "flex", *(["fla"] if fla_adapter.available() else [])], "auto"


def run(args: argparse.Namespace) -> dict:
    tiny, device = args.tiny, args.device
    visual, text, answer, guard = ([16], 8, 6, 1) if tiny else ([1024, 4096], 64, 128, 16)
    dtype = "float32" if tiny and torch.device(device).type == "cpu" else "bfloat16"
    checked, timed_backend = backends(device, tiny)
    result: dict = {"device": device if device == "cpu" else torch.cuda.get_device_name(device), "tiny": tiny,
                    "dtype": dtype, "backend": timed_backend, "fla": fla_adapter.available(), "shapes": {}}

    def save(part: str, started: float) -> None:
        log.info("%s: %.1f s", part, time.perf_counter() - started)
        args.json.write_text(json.dumps(result, indent=1, default=str))

    t = time.perf_counter()
    result["exactness"] = exact.exactness(device, checked, ["float32"] if tiny else ["float32", "bfloat16"])
    save("exactness", t)
    for shape in shapes(tiny):
        for v in visual:
            t = time.perf_counter()
            row = result["shapes"].setdefault(shape.name, {})[f"{v}_visual"] = {}
            for graphs in (True, False):
                row["graphs_on" if graphs else "graphs_off"] = timing.policies(
                    shape, device, dtype, v, text, answer, graphs, timed_backend, guard, warm_up=not tiny)
            row["transformers"] = timing.transformers_timing(shape, device, dtype, v, text, answer)
            row["floor"] = fl = timing.floor(shape, device, dtype, tiny)
            plain, fused = row["graphs_on"]["full"]["tpot"], row["graphs_on"]["raincheck"]["tpot_restoring"]
            row["tpot_over_floor"] = dict(plain=plain / fl["floor_s"], fused=fused / fl["floor_s"] if fused else None)
            save(f"{shape.name} {v} visual tokens", t)
            torch.cuda.empty_cache() if torch.device(device).type == "cuda" else None
    t = time.perf_counter()
    result["gdn"] = timing.gdn_update_and_join(device, tiny)
    save("gdn", t)
    t = time.perf_counter()
    big = shapes(tiny)[0]
    result["profile"] = timing.profile_fused_step(big, device, dtype, visual[0], text, timed_backend)
    save("profile", t)
    log.info("fused c = 31 step profile:\n%s", result["profile"])
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    handlers = [logging.StreamHandler(sys.stderr), logging.FileHandler(args.log or args.json.with_suffix(".log"))]
    for h in handlers:
        h.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(h)
    log.setLevel(logging.INFO)
    try:
        run(args)
    finally:
        for h in handlers:
            log.removeHandler(h)
            h.close()


if __name__ == "__main__":
    main()
