"""Starting an engine's tensor-parallel ranks: the rank group of this process, and the worker ranks an
engine starts itself when the caller did not (docs/design.md, Parallelism)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import EngineConfig, ModelConfig
from ..errors import InvalidInputError
from ..models import build_decoder
from ..parallel.group import RankGroup, joined_group
from ..parallel.workers import WorkerRanks


def rank_group(folder: Path, model_config: ModelConfig, config: EngineConfig, options: dict,
               serve: Callable[..., None]) -> tuple[WorkerRanks | None, RankGroup | None]:
    """This process's rank group at tensor_parallel_size > 1 (None at 1), and the worker ranks it started
    for it when the caller did not start the ranks itself (this process is then rank 0; each worker runs
    `serve(group, commands, folder, device, dtype, options)`)."""
    world = config.tensor_parallel_size
    if world == 1:
        return None, None
    if dist.is_initialized():
        return None, joined_group(world)
    if torch.device(config.device).index is not None:
        raise InvalidInputError(f"device {config.device!r} at tensor_parallel_size {world}: give 'cuda' (rank r takes "
                                "the r-th visible GPU; choose them with CUDA_VISIBLE_DEVICES)")
    # a head count or width that does not split raises here, before any rank starts: rank 0's decoder is
    # built once without memory (the meta device), which checks every split the real build makes
    with torch.device("meta"):
        build_decoder(model_config, RankGroup(0, world), config.expert_parallel)
    threads = config.num_threads
    if threads is None and config.device == "cpu":      # the ranks share this machine's cores
        threads = max(1, (os.cpu_count() or 1) // world)
    options = {**options, "tensor_parallel_size": world}
    return WorkerRanks.start(world, serve, (str(folder), config.device, config.dtype, options),
                             device=config.device, threads=threads)
