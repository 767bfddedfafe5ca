"""A serving process freezes its long-lived objects after the warm-up (services/common/gc_freeze.py): no
full collection walks them afterwards, what is made later is still collected, and after an engine is
replaced the old one's cycles are collected too. Run in a child process: freezing would change the test
process's own collector."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import gc, weakref
    from services.common import gc_freeze

    class Node:
        pass

    def cycle(freed):
        a, b = Node(), Node()
        a.other, b.other = b, a
        weakref.finalize(a, freed.append, 1)
        return a

    gc_freeze.refreeze()                      # nothing frozen yet: nothing happens
    assert gc.get_freeze_count() == 0

    old_freed, new_freed = [], []
    old = cycle(old_freed)                    # held across the freeze, like a replaced engine's objects
    assert gc_freeze.freeze() > 0
    del old
    new = cycle(new_freed)                    # made after the freeze, like a session's objects
    del new
    gc.collect()
    assert new_freed == [1], "objects made after the freeze are collected as before"
    assert old_freed == [], "a frozen cycle is out of the collector's reach"
    assert len(gc.get_objects(generation=2)) < 1000, "the long-lived objects are not walked"

    gc_freeze.refreeze()
    assert old_freed == [1], "after a refreeze the old cycle is collected"
    assert gc.get_freeze_count() > 0
    print("ok")
""")


def test_freeze_keeps_long_lived_objects_out_and_refreeze_collects_the_old_ones() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
