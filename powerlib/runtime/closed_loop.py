"""The apply phase's closed loop: measure what the plan achieves against all-max clocks.

A plan's saving is a prediction from the profile; what a job gets depends on what the profile
missed (a clock change that lands late, noise, drift). :class:`ClosedLoop` wraps the
:class:`~powerlib.runtime.apply_phase.ApplyPhase` and, after its first (order-checked)
iteration, runs ``rounds`` rounds of ``reference_iterations`` at the baseline clocks (clocks
unlocked: all maximum) followed by ``plan_iterations`` with the plan, interleaved so that a
slow drift (temperature) hits both alike (docs/measurement.md §8). Each window's energy comes
from the same engine as the profile (the session's sampler and
:mod:`powerlib.measurement.timeline`), its time from the iteration boundaries.

Rank 0 gathers every rank's windows (the job's energy is the sum over devices, its time the
slowest rank's) and judges: the measured saving and slowdown, each with a 95 % interval from
the spread of the paired rounds, and the planner's prediction beside them
(:class:`Realized`). A plan whose slowdown exceeds ``max_slowdown`` beyond its interval, or
that saves nothing, is reverted: every rank resets its clocks and runs at the baseline, with
one warning. A plan that saves more than one point less than predicted but still saves is
kept, with one warning naming both figures (reverting it would cost the job the saving it
does get).

A rank that stops before the verdict (its loop does not run the plan's order, or its device
failed: a clock change refused, a read that raised) keeps counting the windows' iterations and
sends its part as ``stopped``, with the failure's reason: the verdict then reverts the plan on
every rank and rank 0 warns once with that reason (docs/real-gpu.md §3). No rank waits in the
exchange for one that left it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from powerlib.errors import DeviceError, PlanError, PowerlibError
from powerlib.measurement.attribution import t95
from powerlib.measurement.sampler import DeviceSampler
from powerlib.runtime.apply_phase import ApplyPhase
from powerlib.runtime.coordination import Coordinator, Future
from powerlib.runtime.phases import SessionPhase
from powerlib.runtime.records import (
    MeasuredIterations,
    Outcome,
    Payload,
    Prediction,
    Realized,
    Verdict,
    Windows,
)

__all__ = ["CheckConfig", "ClosedLoop", "MeasureOnly", "judge"]

SHORTFALL_POINTS = 1.0
"""A measured saving this many points below the prediction is reported as a shortfall."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckConfig:
    """How the closed loop measures.

    Attributes:
        rounds: Reference/plan window pairs (0: no check; the report then has no measurement).
        reference_iterations: Iterations at the baseline clocks per round.
        plan_iterations: Iterations with the plan per round.
    """

    rounds: int = 3
    reference_iterations: int = 2
    plan_iterations: int = 4

    def __post_init__(self) -> None:
        for name, minimum in (("rounds", 0), ("reference_iterations", 1), ("plan_iterations", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")

    @property
    def per_round(self) -> int:
        """Iterations in one round: its reference window, then its plan window."""
        return self.reference_iterations + self.plan_iterations

    @property
    def checked_iterations(self) -> int:
        """Iterations in the windows of every round (they follow iteration 0, the order check)."""
        return self.rounds * self.per_round

    @property
    def exchange_iteration(self) -> int:
        """The loop's iteration at which the ranks exchange their windows.

        One past the last window's end: the counter has published past it by then.
        """
        return 2 + self.checked_iterations


def _mean_ci(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.inf
    # Student's t over the rounds: with a few rounds, not 1.96
    return mean, t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def _reverted(reason: str) -> Realized:
    """A verdict that reverts the plan with nothing measured."""
    return Realized(math.nan, math.inf, math.nan, math.inf, None, None, 0, "reverted", reason)


def judge(
    payloads: Sequence[Windows],
    *,
    max_slowdown: float | None,
    predicted: Prediction | None,
) -> Realized:
    """Rank 0: the measured saving and slowdown from every rank's windows, and the verdict.

    Each rank's :attr:`Windows.rounds` holds, per round, ``(ref_energy_j, ref_time_s,
    plan_energy_j, plan_time_s)`` per iteration of this rank. Per round the job's energy is the
    sum over ranks, its time the slowest rank's; saving and slowdown are averaged over the
    paired rounds.

    Args:
        payloads: Every rank's windows.
        max_slowdown: The policy's bound (fraction), ``None`` for no bound (min-energy).
        predicted: The planner's prediction, when known.
    """
    stopped = [p for p in payloads if p.stopped]
    if stopped:
        # a failure carries its reason; a loop off the plan's order carries none
        why = [p.reason for p in stopped if p.reason]
        off_order = sorted(p.stage for p in stopped if not p.reason)
        if off_order:
            stages = ", ".join(map(str, off_order))
            why.append(f"stage(s) {stages} do not run the plan's instruction order")
        return _reverted("; ".join(why))
    rounds = min(len(p.rounds) for p in payloads)
    savings, slowdowns = [], []
    for r in range(rounds):
        ref_e = math.fsum(p.rounds[r][0] for p in payloads)
        ref_t = max(p.rounds[r][1] for p in payloads)
        plan_e = math.fsum(p.rounds[r][2] for p in payloads)
        plan_t = max(p.rounds[r][3] for p in payloads)
        if ref_e > 0 and ref_t > 0:
            savings.append(100.0 * (1.0 - plan_e / ref_e))
            slowdowns.append(100.0 * (plan_t / ref_t - 1.0))
    if not savings:
        return Realized(math.nan, math.inf, math.nan, math.inf, None, None, 0, "kept",
                        "no window could be measured")  # fmt: skip
    saving, saving_ci = _mean_ci(savings)
    slowdown, slowdown_ci = _mean_ci(slowdowns)
    p_saving = None if predicted is None else predicted.saving_percent
    p_slowdown = None if predicted is None else predicted.slowdown_percent
    verdict, reason = "kept", None
    if max_slowdown is not None and slowdown - slowdown_ci > 100.0 * max_slowdown:
        verdict = "reverted"
        reason = (
            f"the plan runs {slowdown:+.3f} +- {slowdown_ci:.3f} % slower than all-max clocks, "
            f"past the allowed {100.0 * max_slowdown:.3g} %"
        )
    elif saving + saving_ci <= 0.0:
        verdict = "reverted"
        reason = f"the plan saves no energy ({saving:.2f} +- {saving_ci:.2f} %)"
    elif p_saving is not None and saving + saving_ci < p_saving - SHORTFALL_POINTS:
        verdict = "shortfall"
        reason = (
            f"the plan saves {saving:.2f} +- {saving_ci:.2f} %, more than "
            f"{SHORTFALL_POINTS:g} point below the {p_saving:.2f} % predicted; kept"
        )
    return Realized(
        saving_percent=saving,
        saving_ci_percent=saving_ci,
        slowdown_percent=slowdown,
        slowdown_ci_percent=slowdown_ci,
        predicted_saving_percent=p_saving,
        predicted_slowdown_percent=p_slowdown,
        rounds=len(savings),
        verdict=verdict,
        reason=reason,
    )


class ClosedLoop:
    """The apply phase with its measurement: reference and plan windows, then the verdict.

    Args:
        applying: The plan's apply phase (hooks are passed to it in plan iterations).
        config: The windows.
        sampler: Reads this rank's device.
        clock: The session's clock.
        coordinator: The job's ranks (rank 0 judges).
        max_slowdown: The policy's bound (``None``: no bound).
        predicted: The planner's prediction, on rank 0.
        on_verdict: Called on every rank with the verdict once it arrives.
    """

    def __init__(
        self,
        applying: ApplyPhase,
        config: CheckConfig,
        *,
        sampler: DeviceSampler,
        clock: Callable[[], float],
        coordinator: Coordinator,
        max_slowdown: float | None,
        predicted: Prediction | None,
        on_verdict: Callable[[Realized], None],
    ) -> None:
        self.applying = applying
        self.config = config
        self._sampler = sampler
        self._clock = clock
        self._coordinator = coordinator
        self._max_slowdown = max_slowdown
        self._predicted = predicted
        self._on_verdict = on_verdict
        self._iteration = 0  # iterations since the plan arrived
        self._start_s: float | None = None
        self._windows: list[tuple[str, float, float, int]] = []  # (kind, start, end, iterations)
        self._future: Future[Outcome] | None = None
        self.realized: Realized | None = None

    # -- where we are in the schedule ------------------------------------------------------------

    def _slot(self, iteration: int) -> str | None:
        """``ref`` or ``plan`` for a checked iteration, ``None`` outside the check."""
        if iteration < 1 or self.realized is not None:
            return None  # iteration 0: the order check
        k = iteration - 1
        if k >= self.config.checked_iterations:
            return None
        return "ref" if k % self.config.per_round < self.config.reference_iterations else "plan"

    @property
    def phase(self) -> SessionPhase:
        """``CHECK`` while windows are measured, then the apply phase's."""
        if not self.applying.active:
            return self.applying.phase
        return SessionPhase.CHECK if self._checking() else SessionPhase.APPLY

    def _checking(self) -> bool:
        if self.realized is not None or self.config.rounds == 0:
            return False
        return self._iteration <= 1 + self.config.checked_iterations or self._future is not None

    @property
    def pending(self) -> bool:
        """The verdict has not arrived yet (the ranks still owe each other the exchange)."""
        return self.config.rounds > 0 and self.realized is None

    @property
    def wants_start(self) -> bool:
        """The verdict is pending: the next begin resolves it first."""
        return self._future is not None

    @property
    def position(self) -> int:
        """Instructions begun in this iteration."""
        return self.applying.position

    # -- hooks -----------------------------------------------------------------------------------

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        """Plan iterations hand the clock to the controller; reference ones leave it unlocked."""
        if self._slot(self._iteration) == "ref":
            self.applying.position += 1
            return
        self.applying.begin(kind, microbatch, chunk)

    def end(self) -> None:
        """Prefetch the next clock (plan iterations only)."""
        if self._slot(self._iteration) == "ref":
            return
        self.applying.end()

    def step(self) -> None:
        """The iteration ended: close its window; after the last round, send the windows."""
        self.applying.check_changes()  # a failed change stops the plan (ref windows included)
        now = self._clock()
        slot = self._slot(self._iteration)
        if self._start_s is not None and slot is not None:
            last = self._windows[-1] if self._windows else None
            if last is not None and last[0] == slot and last[2] == self._start_s:
                kind, start, _, n = last
                self._windows[-1] = (kind, start, now, n + 1)
            else:
                self._windows.append((slot, self._start_s, now, 1))
        if slot == "ref":
            self.applying.position = 0
        else:
            self.applying.step()
        self._iteration += 1
        self._start_s = now
        if (
            self.config.rounds
            and self.realized is None
            and self._future is None
            and self._iteration == self.config.exchange_iteration
        ):
            rounds: tuple[tuple[float, float, float, float], ...] = ()
            if self.applying.active:
                try:
                    rounds = self._rounds()
                except PowerlibError as err:  # still sends its part: the others wait for it
                    self.applying.fail(f"stage {self.applying.stage}: measuring failed: {err}")
            # stopped: this rank's order check failed, or its device failed (with the reason)
            stopped = not self.applying.active
            windows = Windows(
                stage=self.applying.stage,
                rounds=() if stopped else rounds,
                stopped=stopped,
                reason=self.applying.stopped_reason,
            )
            self._future = self._coordinator.exchange(windows, self._judge)

    def start_iteration(self) -> None:
        """Set the clocks for the iteration's slot; resolve the verdict when it is pending."""
        if self._future is not None:
            try:
                outcome = self._future()
            except PlanError as err:  # rank 0 could not judge: every rank gets the same error
                outcome = Verdict(realized=_reverted(f"measuring the plan failed: {err}"))
            if outcome is None:
                return
            self._future = None
            if isinstance(outcome, Verdict):
                self.realized = outcome.realized
                self._on_verdict(outcome.realized)
        if self._start_s is None:
            self._start_s = self._clock()
        controller = self.applying.controller
        if self._slot(self._iteration) == "ref":
            if controller.last_requested is not None:
                controller.reset()
        self.applying.start_iteration()

    # -- the measurement -------------------------------------------------------------------------

    def _rounds(self) -> tuple[tuple[float, float, float, float], ...]:
        """Per round ``(ref J, ref s, plan J, plan s)`` per iteration of this rank.

        Raises:
            DeviceError: The sampler stopped reading the device (lost, or failing in a row).
        """
        if self._sampler.failure is not None:
            raise DeviceError(self._sampler.failure, device=self._sampler.device.device_id)
        timeline = self._sampler.timeline(
            since_s=(self._windows[0][1] - 1.0) if self._windows else -math.inf
        )
        refs = [w for w in self._windows if w[0] == "ref"]
        plans = [w for w in self._windows if w[0] == "plan"]
        out = []
        for ref, plan in zip(refs, plans):
            e = timeline.energy_at([ref[1], ref[2], plan[1], plan[2]])
            out.append(
                (
                    float(e[1] - e[0]) / ref[3],
                    (ref[2] - ref[1]) / ref[3],
                    float(e[3] - e[2]) / plan[3],
                    (plan[2] - plan[1]) / plan[3],
                )
            )
        return tuple(out)

    def _judge(self, payloads: list[Payload]) -> Outcome:
        windows = [p for p in payloads if isinstance(p, Windows)]
        if len(windows) != len(payloads):
            raise PlanError("rank 0 expected every rank's closed-loop windows")
        realized = judge(windows, max_slowdown=self._max_slowdown, predicted=self._predicted)
        return Verdict(realized=realized)


class MeasureOnly:
    """A disabled session's phase: the hooks run, every iteration is timed and metered.

    Args:
        sampler: Reads the device (``None``: no device could be read; only time is measured).
        clock: The session's clock.
    """

    phase = SessionPhase.DISABLED
    wants_start = False

    def __init__(self, sampler: DeviceSampler | None, clock: Callable[[], float]) -> None:
        self._sampler = sampler
        self._clock = clock
        self.position = 0
        self._start_s: float | None = None
        self.steps: list[tuple[float, float]] = []

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        """Count the instruction."""
        self.position += 1

    def end(self) -> None:
        """Nothing to do."""

    def step(self) -> None:
        """Close the iteration's window."""
        now = self._clock()
        if self._start_s is not None:
            self.steps.append((self._start_s, now))
        self._start_s = now
        self.position = 0

    def start_iteration(self) -> None:
        """Open the first window."""
        if self._start_s is None:
            self._start_s = self._clock()

    def measured(self) -> MeasuredIterations:
        """Mean time and energy per iteration over the iterations so far."""
        if not self.steps:
            return MeasuredIterations(iterations=0)
        start, end = self.steps[0][0], self.steps[-1][1]
        energy_j = None
        if self._sampler is not None:
            e = self._sampler.timeline(since_s=start - 1.0).energy_at([start, end])
            energy_j = float(e[1] - e[0]) / len(self.steps)
        return MeasuredIterations(
            iterations=len(self.steps),
            time_s=(end - start) / len(self.steps),
            energy_j=energy_j,
        )
