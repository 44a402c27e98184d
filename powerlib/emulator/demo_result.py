"""What ``powerlib demo`` found, typed: :class:`DemoResult` (``powerlib.demo.v3`` as JSON).

:func:`powerlib.emulator.demo.run_demo` returns it; ``powerlib demo --json`` prints
:meth:`DemoResult.to_json`, ``powerlib demo`` formats its fields.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from powerlib.emulator.engine import IterationResult, NvmlLikeModel
from powerlib.runtime.records import Prediction

__all__ = [
    "DEMO_SCHEMA",
    "DemoProfiling",
    "DemoResult",
    "DemoRun",
    "DemoTruth",
    "DemoWorkload",
    "SIMULATE_SCHEMA",
    "SimulateResult",
]

DEMO_SCHEMA = "powerlib.demo.v3"
"""The schema of :meth:`DemoResult.to_json`.

v3 (issue 44): the true figures are ``truth`` (paired over >= 200 iterations, each with its
standard error); ``measured_by_sessions`` is the sessions' record as they wrote it.
"""

SIMULATE_SCHEMA = "powerlib.simulate.v3"
"""The schema of :func:`powerlib.emulator.demo.simulate_plan`'s record (``simulate --json``).

v3 (issue 45): the plan and all-max are paired the way the demo's truth is (:class:`DemoTruth`:
the same noise draws, alternating blocks, 200 pairs by default), with ``iterations`` and the
standard errors ``saving_se_percent`` and ``slowdown_se_percent``; ``baseline`` and
``plan_result`` gain ``makespan_s``. v2 ran all-max first, then the plan, while the emulated
GPUs warmed, which biased the saving low.
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoWorkload:
    """What the demo emulated (``workload``): profile, pipeline, blocking power, straggler."""

    profile: str
    num_stages: int
    num_microbatches: int
    schedule: str
    p_block_w: float
    straggler: float | None
    deadline_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoRun:
    """Mean iteration time and energy of a run (``baseline``, ``powerlib``).

    Attributes:
        time_s: Mean iteration time (straggler hold included).
        energy_j: Mean iteration energy, every device.
        makespan_s: Mean of the pipeline's own iteration time (no hold).
    """

    time_s: float
    energy_j: float
    makespan_s: float

    @classmethod
    def of(cls, runs: Sequence[IterationResult]) -> DemoRun:
        """The means of ``runs``."""
        return cls(
            time_s=statistics.fmean(r.time_s for r in runs),
            energy_j=statistics.fmean(r.energy_j for r in runs),
            makespan_s=statistics.fmean(r.makespan_s for r in runs),
        )

    def to_json(self) -> dict[str, float]:
        """The fields by name."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoTruth:
    """The true figures: the plan against all-max iterations on the same noise draws (paired).

    Each figure is a ratio of means (saving ``1 - mean E_plan / mean E_all-max``), its standard
    error the ratio estimator's from the paired differences,
    ``SE = sd(x_i - r y_i) / (sqrt(n) mean y)`` (Cochran, *Sampling Techniques*, 3rd ed., §6.3).

    Attributes:
        iterations: Pairs (noise draws).
        baseline: The all-max iterations' means.
        plan: The plan's iterations' means.
        saving_se_percent: The standard error of :attr:`saving_percent` (points).
        slowdown_se_percent: The standard error of :attr:`slowdown_percent` (points).
    """

    iterations: int
    baseline: DemoRun
    plan: DemoRun
    saving_se_percent: float
    slowdown_se_percent: float

    @classmethod
    def paired(
        cls, baseline: Sequence[IterationResult], plan: Sequence[IterationResult]
    ) -> DemoTruth:
        """``plan[i]`` against ``baseline[i]``, each pair run on one noise draw."""
        if len(baseline) != len(plan) or len(plan) < 2:
            raise ValueError("the truth needs at least 2 pairs, as many of each")
        base, ours = DemoRun.of(baseline), DemoRun.of(plan)
        return cls(
            iterations=len(plan),
            baseline=base,
            plan=ours,
            saving_se_percent=_ratio_se_percent(
                [r.energy_j for r in plan], [r.energy_j for r in baseline]
            ),
            slowdown_se_percent=_ratio_se_percent(
                [r.time_s for r in plan], [r.time_s for r in baseline]
            ),
        )

    @property
    def saving_percent(self) -> float:
        """True energy saved per iteration against all-max."""
        return 100.0 * (1.0 - self.plan.energy_j / self.baseline.energy_j)

    @property
    def slowdown_percent(self) -> float:
        """True iteration time against all-max (straggler hold included)."""
        return 100.0 * (self.plan.time_s / self.baseline.time_s - 1.0)

    def to_json(self) -> dict[str, float | int]:
        """``iterations`` and the two figures, each with its standard error."""
        return {
            "iterations": self.iterations,
            "saving_percent": self.saving_percent,
            "saving_se_percent": self.saving_se_percent,
            "slowdown_percent": self.slowdown_percent,
            "slowdown_se_percent": self.slowdown_se_percent,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulateResult:
    """What :func:`~powerlib.emulator.demo.simulate_plan` found (``powerlib.simulate.v3``).

    Attributes:
        plan: Where the plan came from.
        profile: The ground-truth profile the emulated GPUs ran.
        model: The emulated device model.
        warm_up_iterations: Unmeasured all-max iterations run until the thermal drift settled.
        request_ahead_s: How far ahead the apply phase requested a switch to a faster clock
            (``None``: at the previous instruction's end).
        truth: The plan against all-max, paired and interleaved like the demo's truth.
        planned: The plan's own summary figures (``policy``, ``time_s``, ``energy_j``,
            ``saving``).
    """

    plan: str
    profile: str
    model: NvmlLikeModel
    warm_up_iterations: int
    request_ahead_s: float | None
    truth: DemoTruth
    planned: Mapping[str, object]

    def to_json(self) -> dict[str, object]:
        """The ``powerlib.simulate.v3`` record (``simulate --json``)."""
        truth = self.truth
        return {
            "schema": SIMULATE_SCHEMA,
            "plan": self.plan,
            "profile": self.profile,
            "model": self.model.to_json(),
            "model_description": self.model.describe(),
            "warm_up_iterations": self.warm_up_iterations,
            "request_ahead_s": self.request_ahead_s,
            "iterations": truth.iterations,
            "baseline": truth.baseline.to_json(),
            "plan_result": truth.plan.to_json(),
            "saving_percent": truth.saving_percent,
            "saving_se_percent": truth.saving_se_percent,
            "slowdown_percent": truth.slowdown_percent,
            "slowdown_se_percent": truth.slowdown_se_percent,
            "planned": dict(self.planned),
        }


def _ratio_se_percent(x: Sequence[float], y: Sequence[float]) -> float:
    """The standard error of ``mean x / mean y`` from pairs ``(x_i, y_i)``, in percent."""
    r = math.fsum(x) / math.fsum(y)
    residuals = [xi - r * yi for xi, yi in zip(x, y, strict=True)]
    return 100.0 * statistics.stdev(residuals) / (math.sqrt(len(x)) * statistics.fmean(y))


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoProfiling:
    """What the sessions' profiling did (``profile``).

    Attributes:
        iterations: Profiled iterations.
        freqs_mhz: The clocks rank 0's profile resolved, high to low.
        measured_p_block_w: Per stage, the blocking power it measured.
        measured_latency_s: Per stage, the clock-change latency it measured.
        hook_stall_s_per_instruction: Mean hook stall per profiled instruction.
    """

    iterations: int
    freqs_mhz: tuple[float, ...]
    measured_p_block_w: tuple[float | None, ...]
    measured_latency_s: tuple[float | None, ...]
    hook_stall_s_per_instruction: float


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoResult:
    """What :func:`run_demo` found; :meth:`to_json` is ``powerlib.demo.v3`` (``demo --json``).

    Attributes:
        model: The emulated device model.
        workload: What was emulated.
        policy: The policy the sessions planned with.
        truth: The plan the sessions applied against all-max, paired over many noise draws.
        predicted: The planner's one predicted figure for the plan (rank 0's), when it planned.
        measured_by_sessions: Rank 0's closed-loop record as the session writes it
            (``Realized.to_json``), when its verdict arrived.
        profile: What profiling did.
        apply_started_iteration: The iteration the plan started at.
        frequency_changes_per_iteration: Driver clock calls per managed iteration, all stages.
        elapsed_s: Wall time of the demo.
        outputs: File name -> path of what was written.
    """

    model: NvmlLikeModel
    workload: DemoWorkload
    policy: str
    truth: DemoTruth
    predicted: Prediction | None
    measured_by_sessions: Mapping[str, Any] | None
    profile: DemoProfiling
    apply_started_iteration: int | None
    frequency_changes_per_iteration: float
    elapsed_s: float
    outputs: Mapping[str, str]

    @property
    def baseline(self) -> DemoRun:
        """The all-max iterations of :attr:`truth`."""
        return self.truth.baseline

    @property
    def powerlib(self) -> DemoRun:
        """The plan's iterations of :attr:`truth`."""
        return self.truth.plan

    @property
    def saving_percent(self) -> float:
        """The true energy saved per iteration (:attr:`truth`)."""
        return self.truth.saving_percent

    @property
    def slowdown_percent(self) -> float:
        """The true iteration time against all-max (:attr:`truth`)."""
        return self.truth.slowdown_percent

    def to_json(self) -> dict[str, object]:
        """The ``powerlib.demo.v3`` record."""
        profile = self.profile
        return {
            "schema": DEMO_SCHEMA,
            "model": self.model.to_json(),
            "model_description": self.model.describe(),
            "workload": dataclasses.asdict(self.workload),
            "policy": self.policy,
            "baseline": self.baseline.to_json(),
            "powerlib": self.powerlib.to_json(),
            "truth": self.truth.to_json(),
            "predicted": None if self.predicted is None else self.predicted.to_json(),
            "measured_by_sessions": None
            if self.measured_by_sessions is None
            else dict(self.measured_by_sessions),
            "profile": {
                "iterations": profile.iterations,
                "freqs_mhz": list(profile.freqs_mhz),
                "measured_p_block_w": list(profile.measured_p_block_w),
                "measured_latency_s": list(profile.measured_latency_s),
                "hook_stall_s_per_instruction": profile.hook_stall_s_per_instruction,
            },
            "apply_started_iteration": self.apply_started_iteration,
            "frequency_changes_per_iteration": self.frequency_changes_per_iteration,
            "elapsed_s": self.elapsed_s,
            "outputs": dict(self.outputs),
        }
