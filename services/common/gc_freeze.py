"""Keep Python's cyclic garbage collector off what a serving process holds for its whole life.

A loaded, warmed decode worker holds a few hundred thousand long-lived objects (the modules and their
parameters, the pools' bookkeeping, the gRPC and metrics machinery). Python runs a full collection
whenever the long-lived objects have grown by a quarter since the last one, and a full collection walks
them all: ~130 ms with ~367K objects (the `bench` checkpoint's qwen3_vl engine after 64 sessions), a
stall of every running session's next token. `freeze()` after the warm-up moves what exists then into a
permanent generation that no collection walks (vLLM does the same after its start-up); what is made later
(sessions, turns, step temporaries) is collected as before. A frozen object is still freed when its
last reference goes; only cycles among frozen objects would stay, so when a worker replaces its engine,
`refreeze()` thaws and collects first. Only a worker's own process freezes (services/launch.py): a worker
embedded in another program (the tests, a notebook) leaves that program's collector alone.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze() -> int:
    """Collect, then freeze every object alive now; returns how many were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d long-lived objects out of the garbage collector's reach", frozen)
    return frozen


def refreeze() -> None:
    """After the engine was replaced (its old objects may be garbage now, cycles included): thaw,
    collect and freeze again, where `freeze` ran in this process; elsewhere nothing."""
    if gc.get_freeze_count():
        gc.unfreeze()
        freeze()
