"""Start the ranks of a tensor-parallel engine: one process per rank, on this machine, with a rendezvous
on loopback. `spawn(fn, world, *args)` runs `fn(group, *args)` in every rank and returns each rank's
result, in rank order; a rank that raises or dies makes `spawn` raise `RankFailedError` (the others,
blocked in a collective, fail on its timeout or on the closed connection)."""

from __future__ import annotations

import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from ..errors import RankFailedError
from .group import DEFAULT_TIMEOUT_S, init_rank_group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, address: str, device: str, timeout_s: float, threads: int | None,
               fn: Callable[..., Any], args: tuple, results: Any) -> None:
    if threads:
        torch.set_num_threads(threads)
    try:
        group = init_rank_group(rank, world, address, device, timeout_s)
        # pickled here, not by the queue: torch's queue would pass tensors as shared memory, which is gone
        # once this process exits
        results.put((rank, True, pickle.dumps(fn(group, *args))))
    except BaseException as e:      # reported to the parent, which raises for every rank's failure
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise


def spawn(fn: Callable[..., Any], world: int, *args: Any, device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S,
          threads: int | None = None) -> list[Any]:
    """`fn(group, *args)` in `world` fresh processes (torch multiprocessing, spawn start method), each
    joined to one rank group; their return values (picklable) in rank order. `threads`: torch intra-op
    threads per rank (ranks sharing a few cores should take one each)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    address = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, world, address, device, timeout_s, threads, fn, args, results),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    failed: dict[int, str] = {}
    deadline = None     # once a rank failed: when the others, if still running, are stopped
    # results are read while the ranks run: a result larger than the pipe's buffer blocks its rank until read
    while len(got) + len(failed) < world:
        try:
            rank, ok, value = results.get(timeout=0.5)
        except queue.Empty:
            for rank, p in enumerate(procs):
                if rank not in got and rank not in failed and not p.is_alive() and results.empty():
                    failed[rank] = f"exited with code {p.exitcode}"
            if failed and deadline is None:
                deadline = time.monotonic() + timeout_s
            if deadline is not None and time.monotonic() > deadline:
                # their collectives time out by then: a rank still running is stuck outside them
                for rank, p in enumerate(procs):
                    if rank not in got and rank not in failed:
                        p.terminate()
                        failed[rank] = f"stopped {timeout_s:.0f} s after another rank failed"
            continue
        if ok:
            got[rank] = pickle.loads(value)
        else:
            failed[rank] = value
    for p in procs:
        p.join()
    if failed:
        raise RankFailedError("; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items())))
    return [got[r] for r in range(world)]
