"""The ranks of one tensor-parallel engine, on torch.distributed: gloo on the CPU, NCCL on CUDA.

The layers only reduce (`all_reduce`, after a row-parallel projection or the experts) and gather
(`all_gather`, the vocabulary-parallel LM head's logits). The engine compares digests across ranks
(`check_same`: of each step's plan, of each turn's input ids) and measures with rank 0's clock
(`shared`); `broadcast_object` carries plain data from rank 0, `gather_object` to it. Every collective has the group's
timeout: a rank that died makes the others fail with `RankFailedError` instead of waiting for it forever;
so does a collective begun after this process left the group (its engine was closed by another thread
meanwhile, which torch reports as a `ValueError`).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import InvalidInputError, RankFailedError
from .shard import Shard

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RankGroup:
    """This process's place among the engine's ranks, and their collectives."""

    rank: int
    world: int
    group: Any = None        # the activations' torch.distributed ProcessGroup; None: the default one
    # the group of the host-side checks (digests, clock readings, objects): gloo over the CPU, so on GPUs
    # they neither move to the device nor wait for it (None: the default group, already gloo on CPUs)
    control: Any = None

    @property
    def shard(self) -> Shard:
        return Shard(self.rank, self.world)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `t`, in place."""
        with collective(f"all-reduce across {self.world} ranks"):
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `t` (all the same shape), concatenated along `dim` in rank order."""
        parts = [torch.empty_like(t) for _ in range(self.world)]
        with collective(f"all-gather across {self.world} ranks"):
            dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def check_same(self, value: int, what: str) -> None:
        """Every rank passed the same `value` (a digest of `what`); RankFailedError where they differ."""
        t = torch.tensor([value, -value], dtype=torch.int64)
        with collective(f"comparing {what} across {self.world} ranks"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        if int(t[0]) != -int(t[1]):
            raise RankFailedError(f"the {self.world} ranks disagree on {what}")

    def shared(self, clock: Callable[[], float]) -> Callable[[], float]:
        """`clock` as rank 0 reads it, on every rank. The engine measures with it (step costs, the TPOT
        objective, turn metrics), so ranks running the same calls schedule the same steps whatever their
        own timings. Each reading is a collective: every rank must read it at the same points, as ranks
        running the same calls on one thread do."""
        def read() -> float:
            t = torch.tensor([clock() if self.rank == 0 else 0.0], dtype=torch.float64)
            with collective("reading rank 0's clock"):
                dist.broadcast(t, src=0, group=self.control)
            return float(t[0])
        return read

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """`obj` as rank `src` has it (pickled: plain data only)."""
        box = [obj]
        with collective(f"broadcast from rank {src}"):
            dist.broadcast_object_list(box, src=src, group=self.control)
        return box[0]

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` (pickled: plain data, CPU tensors), in rank order, on rank 0; None elsewhere."""
        out = [None] * self.world if self.rank == 0 else None
        with collective(f"gathering from {self.world} ranks"):
            dist.gather_object(obj, out, dst=0, group=self.control)
        return out


@contextmanager
def collective(what: str) -> Iterator[None]:
    """Run a collective, `what` it does naming it: a failure of the ranks' communication (a rank died or
    timed out), or a call after this process left the group, raises RankFailedError."""
    try:
        yield
    except (RuntimeError, dist.DistBackendError) as e:
        raise RankFailedError(f"{what} failed: {e}") from e
    except ValueError as e:
        if dist.is_initialized():       # a caller's mistake, not the ranks'
            raise
        raise RankFailedError(f"{what} failed: this rank has left the group (its engine was closed)") from e


def init_rank_group(rank: int, world: int, address: str, device: str = "cpu",
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> RankGroup:
    """Join the engine's `world` ranks at `address` (`tcp://host:port`, rank 0 listening) and return this
    process's group: NCCL for CUDA devices (one GPU per rank, by rank, with a gloo group for the host-side
    checks), gloo otherwise."""
    cuda = torch.device(device).type == "cuda"
    if cuda:        # "cuda" then means this rank's device
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", init_method=address, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _joined["group"] = RankGroup(rank, world, control=_control_group(timeout_s))
    return _joined["group"]


def _control_group(timeout_s: float) -> Any:
    """A gloo group beside an NCCL default group (a collective call: every rank makes it); None on gloo."""
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


# this process's group, as init_rank_group made it (one process is one rank)
_joined: dict[str, RankGroup] = {}


def joined_group(world: int) -> RankGroup:
    """This process's rank group, when it is one of `world` ranks already joined (`init_rank_group`, or a
    default group initialised by the caller)."""
    if dist.get_world_size() != world:
        raise InvalidInputError(f"tensor_parallel_size {world}, but this process's group has "
                                f"{dist.get_world_size()} ranks")
    if "group" not in _joined:
        _joined["group"] = RankGroup(dist.get_rank(), world, control=_control_group(DEFAULT_TIMEOUT_S))
    return _joined["group"]


def leave_rank_group() -> None:
    """Leave the group this process joined (its engine stopped): another engine may start ranks afresh."""
    _joined.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
