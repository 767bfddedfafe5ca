"""What benchmarks, tests and the services read and hook of an engine's steps (the facade, engine/engine.py,
has these through `EngineInstruments`): the step-cost model, the graph path's skeletons, the staged copies, the
steps staged ahead, and hooks on a step's plan, its first read of the forward, its end, and a recovery's end."""

from __future__ import annotations

from collections.abc import Callable

from ..deferral.recovery import Recovery
from ..ops.uploads import Uploads
from .ahead import AheadCounts
from .core import EngineCore
from .cost_model import StepCostModel
from .graphs import StepGraphs
from .hooks import StepStats
from .plan import StepPlan
from .session_cache import SessionCache


class EngineInstruments:
    """The engine's instruments; the facade holds the core (`core`)."""

    core: EngineCore

    @property
    def step_costs(self) -> StepCostModel:
        """The scheduler's step-cost model (engine/cost_model.py): the calibration the TPOT objective
        decides from, filled by the warm-up, and how far live steps `drift()` from it."""
        return self.core.scheduler.cost

    @property
    def step_graphs(self) -> StepGraphs | None:
        """The bucketed decode-step skeletons met so far and their replays; None while steps run unpadded."""
        return self.core.runner.graphs

    @property
    def uploads(self) -> Uploads:
        """The GPU path's staged host-to-device copies (ops/uploads.py): `copies` and `staged` (tensors) of the
        last step's forward; nothing staged on the native path."""
        return self.core.runner.uploads

    @property
    def ahead_counts(self) -> AheadCounts:
        """Decode steps staged during the previous step's forward: launched as staged, or dropped
        (engine/ahead.py; `EngineConfig.plan_ahead`)."""
        return self.core.ahead.counts

    @property
    def staging(self) -> tuple[Uploads, Uploads]:
        """The runner's two staging buffers: the step launched last's (`uploads`) and the one a step staged
        ahead of it uses (engine/ahead.py)."""
        return self.core.runner.staging

    def on_plan(self, hook: Callable[[StepPlan], None]) -> Callable[[], None]:
        """`hook(plan)` before each forward; one that raises fails that forward (fault injection).
        Returns a function that removes the hook (so do the two below)."""
        return self.core.hooks.on_plan(hook)

    def on_read(self, hook: Callable[[StepPlan], None]) -> Callable[[], None]:
        """`hook(plan)` where a step's update first reads its forward's values: on a device, the host work
        before it ran beside the forward (`Hooks.on_read`)."""
        return self.core.hooks.on_read(hook)

    def on_step(self, hook: Callable[[StepStats], None]) -> Callable[[], None]:
        """`hook(stats)` after each step: its rows by kind, sessions, and time on the engine's clock."""
        return self.core.hooks.on_step(hook)

    def on_recovery_done(self, hook: Callable[[SessionCache, Recovery], None]) -> Callable[[], None]:
        """`hook(cache, recovery)` when a recovery completes, before its prefix state is released."""
        return self.core.hooks.on_recovery_done(hook)
