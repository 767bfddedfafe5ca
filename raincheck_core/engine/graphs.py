"""Graph-captured decode steps: the forward of a decode step padded to its bucket (engine/padding.py, the
runner's) replays a CUDA graph captured from the first step of the same shape, instead of launching every
layer's kernels from Python. Only `model(batch)` is captured, as in vLLM's graph runner: the runner pads,
prepares the batch and collects the outputs.

A prepared batch (`ForwardBatch`: the packed rows, the attention layout, the GDN layouts) is a tree of
tensors and plain values (the flex layout keeps its block lists as tensors and makes each call's
BlockMask from them, so the static batch's tensors are what a replay reads). Two batches whose trees have
the same *skeleton* (every plain value, every tensor's shape and dtype) run the same kernels on the same
shapes: only tensor contents differ. So the first batch of a skeleton becomes the graph's static buffers
(views of session tensors cloned, so that nothing of a session is a graph buffer) and is captured; a
later batch of that skeleton copies each of its tensors into the static tensor at the same place in the
tree and replays. The runner reads the logits and new states from the static batch's output buffers and
clones them, so a later replay never changes what an update applied.

Capture is on for CUDA devices with ops that do not take the native CPU kernels (they read the step's
bounds, plain values, as their read limits). On the CPU the same path runs with `capture=False`: the
static batch's forward runs eagerly where a replay would be, which is how the tests check the padding,
the skeleton and the copying (tests/engine/test_graphs.py). Prefill, post-answer chunks and any step
that is not a bucketed decode step run eagerly as planned.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable
from functools import cache, cached_property
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..layers.batch import ForwardBatch
    from ..ops.backend import OpSet

log = logging.getLogger(__name__)

MAX_GRAPHS = 64        # captured skeletons kept; later new ones run eagerly
# what the forward writes, not what it reads (outputs, the model's per-step cos/sin, the prepared op)
OUTPUT_FIELDS = frozenset({"out", "op", "cos", "sin"})
# the native kernel's read bounds (ops/gdn_kernel.py PackedSequences): values, not shapes; never used here
BOUND_FIELDS = frozenset({"step_rows_needed", "slots_needed", "seed_hists_needed", "seed_states_needed"})


def leaves(tree: Any) -> list[tuple[Any, Any, Tensor | Any]]:
    """(container, key, value) of every tensor and plain value the forward reads in a prepared batch:
    dataclass fields (and computed cached properties, which are computed here first), list and tuple
    items. Objects of other classes (the pools, the model, op functions, the flex layout's slot tables)
    are shared by every step and not entered. Appended to one list, not yielded through nested generators:
    a replayed step walks its tree (~130 leaves at B = 64) every time."""
    out: list[tuple[Any, Any, Any]] = []
    if _kind(type(tree)) is _CONTAINER:
        _enter(tree, out)
    return out


_LEAF, _CONTAINER, _SHARED = "leaf", "container", "shared"
_LEAF_TYPES = (Tensor, int, float, bool, str, slice, torch.device, type(None))


@cache
def _kind(cls: type) -> str:
    """How `leaves` takes a value of type `cls`, found once per type (a walk asks per leaf): a leaf (tensors,
    plain values), a container it enters (dataclass instances, lists, tuples), or an object it does not."""
    if issubclass(cls, _LEAF_TYPES):
        return _LEAF
    return _CONTAINER if dataclasses.is_dataclass(cls) or issubclass(cls, (list, tuple)) else _SHARED


def _enter(tree: Any, out: list[tuple[Any, Any, Any]]) -> None:
    if isinstance(tree, (list, tuple)):
        for i, item in enumerate(tree):
            _entry(tree, i, item, out)
    else:
        for name in _names(type(tree)):
            _entry(tree, name, getattr(tree, name), out)


@cache
def _names(cls: type) -> tuple[str, ...]:
    """What `leaves` enters of a dataclass type: its fields and computed cached properties, less outputs and
    bounds (found once per type)."""
    names = [f.name for f in dataclasses.fields(cls)]
    names += [n for n, v in vars(cls).items() if isinstance(v, cached_property)]
    return tuple(n for n in names if n not in OUTPUT_FIELDS and n not in BOUND_FIELDS)


def _entry(owner: Any, key: Any, value: Any, out: list[tuple[Any, Any, Any]]) -> None:
    kind = _kind(type(value))
    if kind is _LEAF:
        out.append((owner, key, value))
        return
    out.append((owner, key, type(value).__name__))
    if kind is _CONTAINER:
        _enter(value, out)


def skeleton(tree: Any) -> tuple:
    """What must be equal for two prepared batches to run as one graph: every plain value, and every tensor's
    shape, dtype and device."""
    return _skeleton(leaves(tree))


def _skeleton(flat: list[tuple[Any, Any, Any]]) -> tuple:
    return tuple([(type(owner), key, _plain(v)) for owner, key, v in flat])


def _plain(v: Any) -> Any:
    if isinstance(v, Tensor):
        return v.shape, v.dtype, v.device      # torch.Size: a tuple, hashed and compared as one
    return (v.start, v.stop, v.step) if isinstance(v, slice) else v


def make_static(tree: Any) -> None:
    """Give `tree` tensors of its own where its fields and lists hold views (a lone join's P_rest is a
    view of the session's): a graph's static buffers are written by every later step of its skeleton.
    Tuples hold only what a layout derived from its own tensors, and are left as they are."""
    for owner, key, v in leaves(tree):
        if isinstance(v, Tensor) and v._base is not None and not isinstance(owner, tuple):
            _set(owner, key, v.clone())


def values(tree: Any) -> list[Any]:
    """The values of `tree`'s leaves, in `leaves` order."""
    return [v for _, _, v in leaves(tree)]


def copy_into(static: list[Any], new: list[tuple[Any, Any, Any]]) -> None:
    """Each tensor of a batch (`new`, its `leaves`) into the tensor at the same place of a static batch of its
    skeleton (`static`, its `values`), in one call: torch's foreach copy launches a kernel per group of
    tensors (by device and dtype) on a GPU, not one per tensor (~50 at B = 64, each a launch of host time)."""
    targets, sources = [], []
    for s, (_, _, n) in zip(static, new, strict=True):
        if isinstance(s, Tensor) and s is not n:
            targets.append(s)
            sources.append(n)
    if targets:
        torch._foreach_copy_(targets, sources)


def _set(owner: Any, key: Any, value: Tensor) -> None:
    if isinstance(owner, list):
        owner[key] = value
    elif not isinstance(vars(type(owner)).get(key), cached_property):
        setattr(owner, key, value)
    else:
        vars(owner)[key] = value


class NotCaptured(Exception):
    """A batch's capture failed half-way (an op of its skeleton cannot be captured): the batch holds part
    of that attempt's outputs. Later batches of its skeleton run eagerly."""


@dataclasses.dataclass
class Captured:
    batch: ForwardBatch                   # the static batch
    graph: torch.cuda.CUDAGraph | None    # None: replayed eagerly (capture off)
    logits: Tensor | None = None          # the graph's output buffer

    @cached_property
    def values(self) -> list[Any]:
        """The static batch's leaves' values, in `leaves` order (its tree does not change)."""
        return values(self.batch)


@dataclasses.dataclass
class Walked:
    """A prepared batch's walk (`StepGraphs.walk`): the graph it takes and its leaves."""

    key: tuple[Hashable, tuple]           # (bucket, skeleton)
    flat: list[tuple[Any, Any, Any]]      # `leaves(batch)`


class StepGraphs:
    """The model's forward over bucketed decode steps, replayed from a captured graph (`capture`) or, with
    capture off, run eagerly over the same static buffers."""

    def __init__(self, model: Callable[[ForwardBatch], Tensor], capture: bool):
        self.model = model
        self.capture = capture
        self.graphs: dict[tuple[Hashable, tuple], Captured | None] = {}    # None: could not be captured
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0

    @staticmethod
    def takes(ops: OpSet) -> bool:
        """Whether steps on `ops` can be replayed: not with the native CPU kernels, which read the step's
        bounds (plain values) as their read limits."""
        return ops.attention.name == "flex" and ops.gdn.name != "native"

    def walk(self, bucket: Hashable, batch: ForwardBatch) -> Walked | None:
        """The part of `run` that reads no tensor's values: `batch`'s leaves (its lazily built tensors built,
        staged with the rest) and its skeleton. None where the ops take no graph."""
        if not self.takes(batch.ops):
            return None
        flat = leaves(batch)      # one walk of the tree: its skeleton and its tensors
        return Walked((bucket, _skeleton(flat)), flat)

    def run(self, bucket: Hashable, batch: ForwardBatch, send: Callable[[], None] = lambda: None,
            walked: Walked | None = None) -> tuple[ForwardBatch, Tensor] | None:
        """`model(batch)` for a padded decode step of `bucket`, replayed from the graph of its skeleton (captured
        now when it is the first): the static batch it ran over, whose outputs are the step's, and its
        logits. None: the caller runs `batch` eagerly (ops a graph cannot hold, too many graphs, a skeleton
        whose capture failed). NotCaptured when this batch's capture fails. `send`: sends the batch's staged
        tensors (ops/uploads.py), called once its walk has built the lazily built ones, before they are read;
        `walked`: `walk(bucket, batch)`, made when the step was staged (engine/ahead.py)."""
        walked = walked or self.walk(bucket, batch)
        if walked is None:
            return None
        send()
        key, flat = walked.key, walked.flat
        if key not in self.graphs and len(self.graphs) >= MAX_GRAPHS:
            return None
        static = self.graphs.get(key)
        if key not in self.graphs:
            try:
                static = self.graphs[key] = self._capture(batch)
            except RuntimeError as e:     # an op of this skeleton cannot be captured: it stays eager
                log.warning("decode step of bucket %s not captured (%s); it runs eagerly", bucket, e)
                self.graphs[key] = None
                raise NotCaptured(str(e)) from e
        elif static is None:
            return None
        else:
            copy_into(static.values, flat)
        logits = self._replay(static)
        self.replays += 1
        return static.batch, logits

    def _capture(self, batch: ForwardBatch) -> Captured:
        make_static(batch)
        if not self.capture:
            return Captured(batch, None)
        with torch.inference_mode():
            side = torch.cuda.Stream()            # warm-up (compiled kernels, library workspaces) off the
            side.wait_stream(torch.cuda.current_stream())     # capturing stream, as CUDA graphs require
            with torch.cuda.stream(side):
                self.model(batch)
            torch.cuda.current_stream().wait_stream(side)
            _reset(batch)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.model(batch)
        return Captured(batch, graph, logits)

    def _replay(self, static: Captured) -> Tensor:
        if static.graph is None:
            _reset(static.batch)
            with torch.inference_mode():
                return self.model(static.batch)
        static.graph.replay()
        return static.logits


def _reset(batch: ForwardBatch) -> None:
    """What a forward appends to (the GDN factors, per layer) starts empty."""
    if batch.gdn is not None:
        batch.gdn.out.factors.clear()
