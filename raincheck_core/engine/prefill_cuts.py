"""Where a prefill's rows are cut for the prefix cache: the GDN checkpoints a hybrid model's prefill keeps
inside its step, the attention splits where prefix hits resume, and the step ends kept only where the GDN
rows would not run token by token (docs/mechanism.md §11). Pure functions of slots and page sizes."""

from __future__ import annotations


def aligned(start: int, n: int, page: int, last_mark: list[int]) -> int:
    """`n` rows from slot `start`, cut at the page boundary at or before the input's last message boundary
    (`last_mark`: its slot, or none) where they cross it, else back to the last page boundary before their
    last row: where a prefix hit of a new question after the same conversation, or of a repeat, resumes,
    for a step whose GDN rows would not run token by token (`Scheduler.cut_for_hits`). The rest then runs
    as the same steps as in the cold run and gets bit-identical results."""
    end = start + n
    for mark in last_mark:
        cut = mark // page * page
        if start < cut < end:
            return cut - start
    boundary = (end - 1) // page * page
    return boundary - start if start < boundary else n


def attention_splits(start: int, n: int, page: int, hits: list[int]) -> tuple[int, ...]:
    """The rows of a prefill of `n` rows from slot `start` where its attention runs as separate segments: the
    page boundaries at or before `hits` (slots: the input's last message boundary, its last row), where a
    prefix-cache hit of a new question after the same conversation, or of a repeat, resumes. The rows after
    such a boundary then get the arithmetic the hit's step gives them (the same attention call over the
    same keys), so a hit is bit-identical to its cold run without ending the cold run's step there: the
    linear layers and the GDN recurrence give a row the same result whatever rows run beside it."""
    return tuple(sorted({m // page * page - start for m in hits if start < m // page * page < start + n}))


def checkpoint_rows(start: int, n: int, align: tuple[int, int | None], marks: list[int]) -> tuple[int, ...]:
    """The rows of a prefill of `n` rows from slot `start` after which a hybrid model's prefix cache keeps
    the GDN state, taken inside the step (ops/gdn_rows.py): at the page boundaries at or before each message
    boundary `marks` (slots) and at every multiple of `every` (`align = (page, every)`; `every` None: no GDN
    layers, none). A boundary where the step ends keeps the step's own final state (engine/core.py)."""
    page, every = align
    if every is None:
        return ()
    end = start + n
    at = {m // page * page for m in marks} | set(range((start // every + 1) * every, end, every))
    return tuple(sorted(c - start - 1 for c in at if start < c < end))
