"""The worker ranks an engine starts for itself: this process is rank 0, ranks 1..N-1 are child processes
(torch multiprocessing, spawn start method) joined over a loopback rendezvous.

Each worker runs `target(group, commands, *args)` (a module-level function, so the child can import it):
it builds its own replica and then serves what rank 0 sends through `commands` (`next_command`) until rank
0 says stop or is gone. Rank 0 sends with `WorkerRanks.send` (bytes, in order, to every worker) and
watches its workers (`failure`): a worker that exited makes every later send raise `RankFailedError`.
`close()` stops them; an engine that is never closed still leaves no process behind (the workers are
daemonic, which multiprocessing ends at exit, and a worker whose parent is gone stops by itself).
"""

from __future__ import annotations

import gc
import logging
import queue
from collections.abc import Callable
from multiprocessing.process import BaseProcess, parent_process
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import RankFailedError
from .group import DEFAULT_TIMEOUT_S, RankGroup, init_rank_group, leave_rank_group
from .launch import free_port

log = logging.getLogger(__name__)

STOP = b""               # the command that ends a worker's loop
POLL_S = 1.0             # how often a waiting worker checks that rank 0 is still there


def _worker_main(rank: int, world: int, address: str, device: str, timeout_s: float, threads: int | None,
                 target: Callable[..., None], commands: Any, args: tuple) -> None:
    if threads:
        torch.set_num_threads(threads)
    group = init_rank_group(rank, world, address, device, timeout_s)
    try:
        target(group, commands, *args)
    finally:
        leave_rank_group()
        # what is left of the process groups (gloo's C++ side, its threads) is destroyed now, while the
        # interpreter runs: destroyed during its finalization instead (an object left in a reference cycle),
        # it can abort the process (SIGABRT, "terminate called without an active exception"), which a worker
        # rank did once at the end of a test under load
        del group
        gc.collect()


def next_command(commands: Any) -> bytes | None:
    """A worker's next command from rank 0 (waiting as long as rank 0 lives); None once rank 0 said stop
    or exited."""
    parent = parent_process()
    while True:
        try:
            message = commands.get(timeout=POLL_S)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return None
            continue
        return None if message == STOP else message


class WorkerRanks:
    """Rank 0's handle on its worker ranks."""

    def __init__(self, world: int, procs: list[BaseProcess], commands: list[Any]):
        self.world = world
        self.procs = procs
        self.commands = commands
        self.closed = False

    @classmethod
    def start(cls, world: int, target: Callable[..., None], args: tuple, device: str = "cpu",
              timeout_s: float = DEFAULT_TIMEOUT_S, threads: int | None = None) -> tuple[WorkerRanks, RankGroup]:
        """Start ranks 1..world-1 running `target(group, commands, *args)`, join them as rank 0, and
        return the handle and this process's group. `threads`: torch intra-op threads per worker."""
        ctx = mp.get_context("spawn")
        address = f"tcp://127.0.0.1:{free_port()}"
        commands = [ctx.Queue() for _ in range(1, world)]
        procs = [ctx.Process(target=_worker_main, name=f"raincheck-rank-{r}", daemon=True,
                             args=(r, world, address, device, timeout_s, threads, target, commands[r - 1], args))
                 for r in range(1, world)]
        for p in procs:       # a spawned child gets this process's sys.path: it imports the same package
            p.start()
        ranks = cls(world, procs, commands)
        try:
            group = init_rank_group(0, world, address, device, timeout_s)
        except BaseException as e:
            why = ranks.failure()
            ranks.close()
            if why is not None:     # the rendezvous waited for a rank that died starting (its error is on stderr)
                raise RankFailedError(f"a worker rank failed to start: {why}") from e
            raise
        return ranks, group

    def failure(self) -> str | None:
        """Which worker exited, and how (None while all run)."""
        dead = [f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(self.procs, 1) if not p.is_alive()]
        return "; ".join(dead) or None

    def send(self, message: bytes) -> None:
        """`message` to every worker, after the ones sent before. RankFailedError when a worker is gone."""
        if self.closed:
            raise RankFailedError("the engine's worker ranks were stopped (the engine is closed)")
        if (why := self.failure()) is not None:
            raise RankFailedError(f"a worker rank is gone: {why}")
        for q in self.commands:
            q.put(message)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (those that do not end within `timeout_s` are terminated) and leave the group."""
        if self.closed:
            return
        self.closed = True
        for q, p in zip(self.commands, self.procs, strict=True):
            if p.is_alive():
                q.put(STOP)
        for p in self.procs:
            p.join(timeout_s)
            if p.is_alive():
                log.warning("worker rank %s did not stop within %.0f s: terminating it", p.name, timeout_s)
                p.terminate()
                p.join(timeout_s)
        for q in self.commands:
            q.close()
            q.cancel_join_thread()
        if dist.is_initialized():
            leave_rank_group()
