"""The device run's parts, each on its own: a part's result (or its exception with the traceback, or
`{"skipped": "budget"}` once the run's deadline has passed) is stored under its key and the JSON written
as soon as it ends, so one failure or a kill loses nothing measured before it. `timeline` says how long
each part took, which is what the next run's plan is sized from. A run resumed from an earlier one's JSON
keeps the parts that succeeded there and runs the rest (a lease is short: a rerun spends it on what is
missing)."""

from __future__ import annotations

import gc
import json
import logging
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("bench.gpu")


class Parts:
    def __init__(self, result: dict, path: Path, budget_s: float,
                 derive: Callable[[dict], None] | None = None):
        self.result = result
        self.path = path
        self.started = time.perf_counter()
        self.deadline = self.started + budget_s
        self.derive = derive            # fills in what is computed from parts' results (before each save)
        result.setdefault("timeline", [])
        self.run_index = 1 + max((p.get("run", 0) for p in result["timeline"]), default=0)

    def done(self, key: tuple[str, ...]) -> bool:
        """An earlier run (the result this one resumed) measured `key`: neither failed nor skipped."""
        node = self.result
        for k in key:
            if not isinstance(node, dict) or k not in node:
                return False
            node = node[k]
        return not (isinstance(node, dict) and ("error" in node or "skipped" in node))

    def run(self, key: tuple[str, ...], fn: Callable[[], Any], record: Callable[[Any], Any] | None = None
            ) -> Any | None:
        """`fn()`, stored at `key` (a path into the result) as `record` writes it (default: as it is);
        None where it failed or was skipped."""
        name = " / ".join(key)
        ok = False
        if self.done(key):
            log.info("%s: kept from an earlier run", name)
            return None
        if time.perf_counter() >= self.deadline:
            value = {"skipped": "budget"}
            log.info("%s: skipped (past the budget)", name)
        else:
            t = time.perf_counter()
            try:
                value, ok = fn(), True
            except Exception as e:      # recorded, and the run goes on with the next part
                log.exception("%s failed", name)
                value = {"error": repr(e), "traceback": traceback.format_exc()}
            seconds = time.perf_counter() - t
            log.info("%s: %.1f s%s", name, seconds, "" if ok else " (failed)")
            self.result["timeline"].append(dict(part=name, s=round(seconds, 2), ok=ok, run=self.run_index,
                                                at_s=round(time.perf_counter() - self.started, 1)))
        node = self.result
        for k in key[:-1]:
            node = node.setdefault(k, {})
        node[key[-1]] = record(value) if ok and record is not None else value
        self.save()
        free_memory()
        return value if ok else None

    def save(self) -> None:
        if self.derive is not None:
            try:
                self.derive(self.result)
            except Exception:       # a derived figure never costs the measured ones
                log.exception("deriving figures failed")
        self.path.write_text(json.dumps(self.result, indent=1, default=str))


def free_memory() -> None:
    """What a finished part held (engines, graphs, models) goes back before the next part allocates."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
