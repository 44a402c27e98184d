"""Typed records the runtime passes between floors: what ranks send, what rank 0 answers.

Each is a frozen dataclass (``to_json`` where it ends up in a file or a report), so code reads
fields and matches on types, never string paths into nested dicts:

- **Payloads**, what a rank sends rank 0 (:data:`Payload`): its :class:`ProfilePayload` at the
  end of the sweep, or a :class:`StopPayload` when a rank failed; :class:`SavedProfile` or
  :class:`SavedPlan` in the modes that start from a file; :class:`ReplanReady` when a re-plan
  may switch; :class:`Windows`, what the closed loop measured.
- **Outcomes**, what rank 0 sends every rank (:data:`Outcome`, a sum type: exactly one of them):
  :class:`Planned`, :class:`NoPlan`, :class:`ProfileOnly`, :class:`PlanFailed`,
  :class:`Verdict` and :class:`Replanned`.
- **What a session tells**: :class:`Prediction` (the planner's figures for its plan),
  :class:`Realized` (what the closed loop measured), :class:`ReplanRecord`,
  :class:`MeasuredIterations` (a disabled session), :class:`SessionReport` (``report()``) and
  :class:`SessionStatus` (what the exporter publishes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from powerlib.planning.perseus.counterfactual import IterationRecord
from powerlib.planning.perseus.noise import TimeNoise
from powerlib.planning.perseus.report import PlanSummary
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.profile_rows import ProfileRow
from powerlib.runtime.estimator import Estimate

__all__ = [
    "BlockSummary",
    "MeasuredIterations",
    "NoPlan",
    "Outcome",
    "Payload",
    "PlanFailed",
    "Planned",
    "Prediction",
    "ProfileOnly",
    "ProfilePayload",
    "Realized",
    "ReplanReady",
    "ReplanRecord",
    "Replanned",
    "SavedPlan",
    "SavedProfile",
    "SessionReport",
    "SessionStatus",
    "StopPayload",
    "Verdict",
    "MeasureMore",
    "Windows",
]


# -- payloads: what a rank sends rank 0 ------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockSummary:
    """One clock block of a rank's sweep, as the profile payload reports it.

    Attributes:
        freq_mhz: The clock requested.
        iterations: Measured iterations.
        ran_mhz: The clock the device was seen to run, when read.
        temperature_c: Its temperature, when read.
        dropped: Why the block was dropped (throttled), or ``None``.
    """

    freq_mhz: float
    iterations: int
    ran_mhz: float | None = None
    temperature_c: float | None = None
    dropped: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfilePayload:
    """One rank's profile, as its sweep resolved it.

    Attributes:
        stage: The rank's pipeline stage.
        rows: Mean time and attributed energy per (kind, clock).
        errors: Per (kind, clock): relative half-width of the energy's 95 % interval.
        p_block_w: Power between instructions (the attribution's rest), when resolved.
        p_block_error: Its relative 95 % half-width.
        order: ``(chunk, microbatch, kind)`` in the order the loop ran its last iteration.
        idle_power_w: The device's power before the session changed anything.
        latency_s: The clock-change latency measured while warming up (90th percentile).
        blocks: Per visited clock: iterations, the clock really run, temperature, dropped.
        counter_period_s: The energy counter's update period, as observed.
        time_cv: Median run-to-run spread of an instruction's time (the guard's noise).
        time_se: Median relative standard error of a row's mean time.
        target_error: The sweep's target.
        gave_up: The sweep stopped because a row could not resolve.
        unresolved: Why (on the rank that could not resolve).
        time_noise: The noise's structure the spans show (per iteration, per microbatch,
            independent; :mod:`powerlib.runtime.noise_estimate`), when estimated.
        latency_samples_s: Every clock-change landing the warm-up measured.
        span_times: Every measured instruction: ``(sweep block, sweep iteration, microbatch,
            kind, clock, time_s)`` (:data:`~powerlib.runtime.noise_estimate.SpanTime`): rank 0
            divides each iteration's shared factor out of the rows with them.
        power_floor_w: The power-smoothing floor the rank's GPU holds (W), when power
            smoothing is on (docs/real-gpu.md §8).
        power_limit_w: The power limit the rank's GPU holds (W; profiling changes none): the
            ``power-budget`` policy never plans above it (docs/perseus.md §7).
    """

    stage: int
    rows: tuple[ProfileRow, ...] = ()
    errors: Mapping[tuple[str, float], float] = field(default_factory=dict)
    p_block_w: float | None = None
    p_block_error: float | None = None
    order: tuple[tuple[int, int, str], ...] = ()
    idle_power_w: float | None = None
    latency_s: float | None = None
    blocks: tuple[BlockSummary, ...] = ()
    counter_period_s: float | None = None
    time_cv: float | None = None
    time_se: float | None = None
    target_error: float | None = None
    gave_up: bool = False
    unresolved: str | None = None
    time_noise: TimeNoise | None = None
    latency_samples_s: tuple[float, ...] = ()
    span_times: tuple[tuple[int, int, int, str, float, float], ...] = ()
    power_floor_w: float | None = None
    power_limit_w: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StopPayload:
    """What every rank sends rank 0 instead of its profile when a rank failed while profiling.

    Attributes:
        stage: The rank's pipeline stage.
        reason: This rank's own failure, or ``None`` on the ranks that stopped because another
            one failed.
    """

    stage: int
    reason: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedProfile:
    """``plan`` mode: rank 0 plans from this saved profile."""

    stage: int
    path: Path


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedPlan:
    """``apply`` mode: rank 0 reads this saved plan (each rank checks it against its workload)."""

    stage: int
    path: Path


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplanReady:
    """Every rank has voted that rank 0's re-plan is ready: this rank's current iteration."""

    deadline_s: float
    iteration: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Windows:
    """What one rank's closed loop measured in one batch of rounds, for rank 0 to judge.

    Attributes:
        stage: The rank's pipeline stage.
        iterations: Per checked iteration ``(slot, round, iteration, record)``: ``ref``
            (baseline clocks) or ``plan``, the round it belongs to (from 0, across batches), the
            loop's iteration (the same on every rank), and what this rank measured (its spans,
            the clocks they ran at, its energy).
        stopped: This rank stopped applying the plan before the verdict (its loop does not run
            the plan's order, or its device failed).
        reason: Why, for a failure (``None`` for a loop off the plan's order).
    """

    stage: int
    iterations: tuple[tuple[str, int, int, IterationRecord], ...] = ()
    stopped: bool = False
    reason: str | None = None


Payload = ProfilePayload | StopPayload | SavedProfile | SavedPlan | ReplanReady | Windows
"""What a rank sends rank 0 in an exchange."""


# -- outcomes: what rank 0 sends every rank --------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """The planner's one predicted figure for the plan it chose (``summary.json``'s top level).

    The plan replayed on the measured profile, per iteration as the job runs it: against
    iterations at the baseline clocks (all-max, held to the straggler's T′ under ``deadline``),
    the convention the closed loop measures in. The same figure as ``summary.json``'s
    ``saving_percent`` and ``slowdown_percent``, the planning log line and the exporter's
    ``powerlib_session_planned_saving_ratio``.

    Attributes:
        saving_percent: Energy saved per iteration (``None``: no positive baseline energy).
        slowdown_percent: Iteration time against the baseline iteration's (negative: faster).
        switch_latency_s: The clock-change latency the guard planned for.
        switch_latency_source: ``given``, ``measured`` or ``default``.
        time_cv: The run-to-run noise the guard planned for (0: none).
    """

    saving_percent: float | None
    slowdown_percent: float | None
    switch_latency_s: float | None = None
    switch_latency_source: str | None = None
    time_cv: float | None = None

    @classmethod
    def from_summary(cls, summary: PlanSummary | None) -> Prediction | None:
        """From the planner's summary of the plan (``summary.json``); ``None`` without one."""
        if summary is None:
            return None
        guard = summary.guard
        return cls(
            saving_percent=summary.saving_percent,
            slowdown_percent=summary.slowdown_percent,
            switch_latency_s=None if guard is None else guard.switch_latency_s,
            switch_latency_source=None if guard is None else guard.switch_latency_source,
            time_cv=None if guard is None else guard.time_cv,
        )

    def to_json(self) -> dict[str, Any]:
        """Every field, by name."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Planned:
    """Rank 0 planned: apply ``plan``.

    Attributes:
        plan: The plan.
        summary: The planner's summary of it (``summary.json``: frontier, chosen point,
            baseline, replayed saving), or ``None`` for a saved plan.
        p_block_w: The blocking power it was planned with, when rank 0 planned.
    """

    plan: FrequencyPlan
    summary: PlanSummary | None = None
    p_block_w: float | None = None

    @property
    def prediction(self) -> Prediction | None:
        """The planner's figures for the plan (from :attr:`summary`)."""
        return Prediction.from_summary(self.summary)


@dataclass(frozen=True, slots=True, kw_only=True)
class NoPlan:
    """Rank 0 applies no plan: every rank runs at the baseline clocks; rank 0 warns once.

    Attributes:
        reason: Why, one line (a profile that cannot resolve per-instruction energy, a plan
            that would not pay, a rank that failed while profiling).
        summary: The planner's summary of the plan it refused, when it planned one.
        p_block_w: The blocking power measured between instructions, when known.
    """

    reason: str
    summary: PlanSummary | None = None
    p_block_w: float | None = None

    @property
    def prediction(self) -> Prediction | None:
        """The planner's figures for the refused plan (from :attr:`summary`)."""
        return Prediction.from_summary(self.summary)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileOnly:
    """``profile`` mode: the profile was merged (and written, unless ``reason``); no plan.

    Attributes:
        p_block_w: The blocking power measured between instructions, when known.
        reason: Why the profile was not written (it cannot resolve per-instruction energy, a
            rank failed), or ``None``.
    """

    p_block_w: float | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanFailed:
    """Planning raised on rank 0: every rank raises (at the ``with`` line) or stops with it."""

    error: str


@dataclass(frozen=True, slots=True)
class Realized:
    """What a plan achieved against the baseline (the default clocks: what runs without powerlib).

    The figures are the loop's estimate (:mod:`powerlib.runtime.estimator`): ``paired`` (each
    plan iteration against its own counterfactual at the baseline clocks) when rank 0 holds the
    profile's model, else ``interleaved`` (plan windows against reference windows).

    Attributes:
        saving_percent: Energy saved per iteration, all devices (measured).
        saving_ci_percent: Half-width of its 95 % interval (points).
        slowdown_percent: Iteration time change (measured; negative is faster).
        slowdown_ci_percent: Half-width of its 95 % interval (points).
        predicted_saving_percent: The planner's prediction for the plan (per iteration).
        predicted_slowdown_percent: Likewise.
        rounds: Rounds of reference and plan windows measured.
        verdict: ``kept``, ``shortfall`` (kept, saves less than predicted), ``reverted``,
            ``inconclusive`` (the interval is too wide to judge: the plan is withdrawn) or
            ``unfinished`` (the job ended before the verdict).
        reason: Why, for every verdict but ``kept``.
        method: ``paired`` or ``interleaved`` (``None``: nothing was measured).
        plan_iterations: Plan iterations the figures average.
        check: The interleaved windows' estimate beside a paired one (its bias check), else
            ``None``.
    """

    saving_percent: float
    saving_ci_percent: float
    slowdown_percent: float
    slowdown_ci_percent: float
    predicted_saving_percent: float | None
    predicted_slowdown_percent: float | None
    rounds: int
    verdict: str
    reason: str | None = None
    method: str | None = None
    plan_iterations: int = 0
    check: Estimate | None = None

    @classmethod
    def nothing(cls, verdict: str, reason: str, rounds: int = 0) -> Realized:
        """A verdict with nothing measured."""
        return cls(
            saving_percent=math.nan,
            saving_ci_percent=math.inf,
            slowdown_percent=math.nan,
            slowdown_ci_percent=math.inf,
            predicted_saving_percent=None,
            predicted_slowdown_percent=None,
            rounds=rounds,
            verdict=verdict,
            reason=reason,
        )

    def to_json(self) -> dict[str, Any]:
        """Every field, by name (``check`` as its own record)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["check"] = None if self.check is None else self.check.to_json()
        return data

    def line(self) -> str:
        """One line for the log."""
        if self.method is None:  # nothing was measured
            return f"closed loop: {self.verdict}" + (
                "" if self.reason is None else f": {self.reason}"
            )
        predicted = (
            ""
            if self.predicted_saving_percent is None
            else f" (predicted {self.predicted_saving_percent:.2f} %)"
        )
        over = (
            f"{self.plan_iterations} plan iterations, paired"
            if self.method == "paired"
            else f"{self.rounds} interleaved rounds"
        )
        check = ""
        if self.check is not None:
            check = (
                f"; interleaved check {self.check.saving_percent:.2f} +- "
                f"{self.check.saving_ci_percent:.2f} %, {self.check.slowdown_percent:+.3f} +- "
                f"{self.check.slowdown_ci_percent:.3f} %"
            )
        return (
            f"measured saving {self.saving_percent:.2f} +- {self.saving_ci_percent:.2f} %"
            f"{predicted}, slowdown {self.slowdown_percent:+.3f} +- "
            f"{self.slowdown_ci_percent:.3f} % against the baseline clocks over {over}{check}: "
            f"{self.verdict}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasureMore:
    """The closed loop's figures are too wide to judge yet: every rank measures another batch."""

    rounds: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """The closed loop's verdict: rank 0 judged every rank's :class:`Windows`."""

    realized: Realized


@dataclass(frozen=True, slots=True, kw_only=True)
class Replanned:
    """A re-plan every rank switches to (or logs as refused) at ``switch_iteration``.

    Attributes:
        outcome: The new plan, or why there is none (the current plan then stays).
        switch_iteration: The iteration every rank starts it at (one past the latest rank's).
    """

    outcome: Planned | NoPlan
    switch_iteration: int


Outcome = Planned | NoPlan | ProfileOnly | PlanFailed | Verdict | MeasureMore | Replanned
"""What rank 0 sends every rank: exactly one of these (match on the type)."""


# -- what a session tells ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplanRecord:
    """One re-plan a session switched to (``session.replans``).

    Attributes:
        iteration: The iteration it started at.
        deadline_s: The iteration time it was planned for.
        policy: The plan's policy.
        realized_saving_percent: Its saving replayed on the profile, when known.
    """

    iteration: int
    deadline_s: float
    policy: str
    realized_saving_percent: float | None

    def to_json(self) -> dict[str, Any]:
        """Every field, by name."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasuredIterations:
    """What a disabled session measured: mean time and energy per iteration.

    Attributes:
        iterations: Iterations measured.
        time_s: Mean iteration time (``None`` before one ended).
        energy_j: Mean energy per iteration of this rank's device (``None`` without a device).
    """

    iterations: int
    time_s: float | None = None
    energy_j: float | None = None

    def to_json(self) -> dict[str, Any]:
        """Every field, by name."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionReport:
    """What a session did (``Session.report()``); :meth:`to_json` is its JSON form.

    Attributes:
        stage: This rank's pipeline stage.
        phase: The session's phase (``Session.phase``).
        iterations: Iterations stepped.
        apply_started_iteration: The iteration the plan started at, or ``None``.
        profiled_freqs_mhz: The clocks this rank's profile resolved, high to low.
        measured_p_block_w: The blocking power this rank measured, when resolved.
        frequency_changes: Driver calls the controller made.
        plan: The applied plan's summary fields, or ``None``.
        replans: Each re-plan switched to.
        measured_latency_s: The clock-change latency measured while warming up.
        realized: The closed loop's verdict, once it arrived.
        predicted: The planner's figures for the plan rank 0 sent, when it planned.
        disabled: What a disabled session measured (``None`` when enabled).
    """

    stage: int
    phase: str
    iterations: int
    apply_started_iteration: int | None
    profiled_freqs_mhz: tuple[float, ...]
    measured_p_block_w: float | None
    frequency_changes: int
    plan: Mapping[str, Any] | None
    replans: tuple[ReplanRecord, ...]
    measured_latency_s: float | None
    realized: Realized | None
    predicted: Prediction | None
    disabled: MeasuredIterations | None

    def to_json(self) -> dict[str, Any]:
        """The report as JSON data (the keys are the field names)."""
        return {
            "stage": self.stage,
            "phase": str(self.phase),
            "iterations": self.iterations,
            "apply_started_iteration": self.apply_started_iteration,
            "profiled_freqs_mhz": list(self.profiled_freqs_mhz),
            "measured_p_block_w": self.measured_p_block_w,
            "frequency_changes": self.frequency_changes,
            "plan": None if self.plan is None else dict(self.plan),
            "replans": [r.to_json() for r in self.replans],
            "measured_latency_s": self.measured_latency_s,
            "realized": None if self.realized is None else self.realized.to_json(),
            "predicted": None if self.predicted is None else self.predicted.to_json(),
            "disabled": None if self.disabled is None else self.disabled.to_json(),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionStatus:
    """What a running session publishes (the Prometheus exporter reads it).

    Attributes:
        stage: The session's pipeline stage (-1 before it is entered).
        predicted_saving_percent: The plan's predicted saving per iteration
            (``summary.json``'s ``saving_percent``, the figure :class:`Prediction` carries;
            percent), or ``None`` before there is one.
        sm_freq_mhz: The clock the session last asked for, or ``None``.
        measured: The closed loop's verdict, once at least one paired round was measured.
    """

    stage: int
    predicted_saving_percent: float | None
    sm_freq_mhz: float | None
    measured: Realized | None

    @classmethod
    def of(
        cls,
        stage: int,
        outcome: Outcome | None,
        sm_freq_mhz: float | None,
        realized: Realized | None,
    ) -> SessionStatus:
        """A session's status from what rank 0 sent and what the closed loop measured."""
        summary = outcome.summary if isinstance(outcome, (Planned, NoPlan)) else None
        return cls(
            stage=stage,
            predicted_saving_percent=None if summary is None else summary.saving_percent,
            sm_freq_mhz=sm_freq_mhz,
            measured=realized if realized is not None and realized.method is not None else None,
        )
