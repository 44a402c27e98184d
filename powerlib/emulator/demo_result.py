"""What ``powerlib demo`` found, typed: :class:`DemoResult` (``powerlib.demo.v2`` as JSON).

:func:`powerlib.emulator.demo.run_demo` returns it; ``powerlib demo --json`` prints
:meth:`DemoResult.to_json`, ``powerlib demo`` formats its fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from powerlib.emulator.engine import NvmlLikeModel
from powerlib.runtime.records import Prediction, Realized

__all__ = ["DEMO_SCHEMA", "DemoProfiling", "DemoResult", "DemoRun", "DemoWorkload"]

DEMO_SCHEMA = "powerlib.demo.v2"
"""The schema of :meth:`DemoResult.to_json`."""


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
        makespan_s: The pipeline's own iteration time (the baseline's: its first iteration).
        iterations_measured: Iterations averaged (the managed run only).
    """

    time_s: float
    energy_j: float
    makespan_s: float
    iterations_measured: int | None = None

    def to_json(self) -> dict[str, float | int]:
        """The fields by name (``iterations_measured`` only where counted)."""
        data: dict[str, float | int] = {
            "time_s": self.time_s,
            "energy_j": self.energy_j,
            "makespan_s": self.makespan_s,
        }
        if self.iterations_measured is not None:
            data["iterations_measured"] = self.iterations_measured
        return data


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
    """What :func:`run_demo` found; :meth:`to_json` is ``powerlib.demo.v2`` (``demo --json``).

    Attributes:
        model: The emulated device model.
        workload: What was emulated.
        policy: The policy the sessions planned with.
        baseline: All-max iterations on the managed iterations' noise draws (paired).
        powerlib: The managed iterations.
        saving_percent: True energy saved per iteration against :attr:`baseline`.
        slowdown_percent: True iteration time against :attr:`baseline`.
        predicted: The planner's figures for the plan (rank 0's), when it planned.
        measured_by_sessions: The sessions' closed-loop verdict, when it arrived.
        profile: What profiling did.
        apply_started_iteration: The iteration the plan started at.
        frequency_changes_per_iteration: Driver clock calls per managed iteration, all stages.
        elapsed_s: Wall time of the demo.
        outputs: File name -> path of what was written.
    """

    model: NvmlLikeModel
    workload: DemoWorkload
    policy: str
    baseline: DemoRun
    powerlib: DemoRun
    saving_percent: float
    slowdown_percent: float
    predicted: Prediction | None
    measured_by_sessions: Realized | None
    profile: DemoProfiling
    apply_started_iteration: int | None
    frequency_changes_per_iteration: float
    elapsed_s: float
    outputs: Mapping[str, str]

    def to_json(self) -> dict[str, object]:
        """The ``powerlib.demo.v2`` record (keys and order as always)."""
        profile = self.profile
        return {
            "schema": DEMO_SCHEMA,
            "model": self.model.to_json(),
            "model_description": self.model.describe(),
            "workload": dataclasses.asdict(self.workload),
            "policy": self.policy,
            "baseline": self.baseline.to_json(),
            "powerlib": self.powerlib.to_json(),
            "saving_percent": self.saving_percent,
            "slowdown_percent": self.slowdown_percent,
            "predicted": None if self.predicted is None else self.predicted.to_json(),
            "planned_saving_percent": None
            if self.predicted is None
            else self.predicted.saving_percent,
            "measured_by_sessions": None
            if self.measured_by_sessions is None
            else self.measured_by_sessions.to_json(),
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
