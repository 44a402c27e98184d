"""The closed loop's figures and verdict: a paired counterfactual, checked by interleaved windows.

Rank 0 receives every rank's measured iterations (:class:`~powerlib.planning.perseus.counterfactual.IterationRecord`:
spans, the clocks they ran at, the counter's energy), each marked reference (baseline clocks)
or plan, round by round. Two estimators read them (docs/measurement.md §9):

- **paired** (the loop's figure, when rank 0 planned and so holds the profile's model): every
  plan iteration is replayed at the baseline clocks on its own noise factors
  (:class:`~powerlib.planning.perseus.counterfactual.Replayer`). Its slowdown is
  ``T / T_base - 1`` per iteration; its saving ``1 - E / (c · E_base)`` per iteration, where
  ``c`` calibrates the profile's energy model against the reference iterations' counter
  energy (each reference iteration gives one ``E / E_model``). The noise both arms share
  cancels: the spread per iteration is a few hundredths of a percent where two unpaired
  windows differ by half a percent.
- **interleaved** (the check of the paired one's bias, and the figure for a saved plan, which
  comes without a model): each round's plan window against its reference window.

Each figure is a mean with a 95 % interval (Student's t over iterations or rounds; the paired
saving's includes the calibration's error). When the two disagree beyond their intervals the
interleaved one is used and the verdict says so.

Verdicts (:func:`verdict`): ``inconclusive`` when an interval is wider than
``max_interval_points`` (the loop first measures more rounds, up to its bound); ``reverted``
when the slowdown exceeds the policy's bound beyond its interval, or the saving is not positive
within it; ``shortfall`` when the saving is more than :data:`SHORTFALL_POINTS` below the
prediction beyond its interval (kept, with a warning); ``kept`` otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from powerlib.measurement.attribution import t95
from powerlib.planning.perseus.counterfactual import Counterfactual, IterationRecord, Replayer

__all__ = [
    "MAX_INTERVAL_POINTS",
    "SHORTFALL_POINTS",
    "Estimate",
    "interleaved",
    "paired",
    "verdict",
]

SHORTFALL_POINTS = 1.0
"""A measured saving this many points below the prediction is reported as a shortfall."""

RESOLUTION_POINTS = (0.15, 0.01)
"""Differences of saving and slowdown (points) below which the two estimates agree anyway."""

MAX_INTERVAL_POINTS = 5.0
"""An interval wider than this (either way, points) judges nothing: the verdict is inconclusive."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """One estimator's figures, each a mean with the half-width of its 95 % interval.

    Attributes:
        method: ``paired`` (counterfactual per plan iteration) or ``interleaved`` (plan windows
            against reference windows, per round).
        saving_percent: Energy saved against the baseline, every device (percent).
        saving_ci_percent: Half-width of its 95 % interval (points).
        slowdown_percent: Iteration time against the baseline (percent; negative is faster).
        slowdown_ci_percent: Half-width of its 95 % interval (points).
        samples: Plan iterations (paired) or rounds (interleaved) it averages.
    """

    method: str
    saving_percent: float
    saving_ci_percent: float
    slowdown_percent: float
    slowdown_ci_percent: float
    samples: int

    @classmethod
    def of(
        cls,
        method: str,
        savings: Sequence[float],
        slowdowns: Sequence[float],
        *,
        scale_error: float = 0.0,
    ) -> Estimate:
        """Means and 95 % intervals of per-sample figures.

        Args:
            method: Which estimator.
            savings: Per sample, percent.
            slowdowns: Per sample, percent.
            scale_error: The 95 % relative error of a scale every energy shares (the paired
                estimate's calibration): it moves every saving alike, so it adds to the
                saving's interval in quadrature.
        """
        saving, saving_ci = mean_ci(savings)
        slowdown, slowdown_ci = mean_ci(slowdowns)
        return cls(
            method=method,
            saving_percent=saving,
            saving_ci_percent=math.hypot(saving_ci, (100.0 - saving) * scale_error),
            slowdown_percent=slowdown,
            slowdown_ci_percent=slowdown_ci,
            samples=len(savings),
        )

    def to_json(self) -> dict[str, float | int | str]:
        """Every field, by name."""
        return {
            "method": self.method,
            "saving_percent": self.saving_percent,
            "saving_ci_percent": self.saving_ci_percent,
            "slowdown_percent": self.slowdown_percent,
            "slowdown_ci_percent": self.slowdown_ci_percent,
            "samples": self.samples,
        }

    def agrees_with(self, other: Estimate) -> bool:
        """No sign of bias: both figures differ by at most the sum of their intervals.

        Plus :data:`RESOLUTION_POINTS`: the paired estimate places each clock change within
        half a sampler read (about 5 ms), which moves the figures by a few hundredths of a
        point even where nothing is noisy (the ideal emulator: 0.07 point of saving).
        """
        saving_tol, slowdown_tol = RESOLUTION_POINTS
        return abs(self.saving_percent - other.saving_percent) <= (
            self.saving_ci_percent + other.saving_ci_percent + saving_tol
        ) and abs(self.slowdown_percent - other.slowdown_percent) <= (
            self.slowdown_ci_percent + other.slowdown_ci_percent + slowdown_tol
        )


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % interval (Student's t; ``inf`` from one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.inf
    return mean, t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def _job(records: Sequence[IterationRecord]) -> tuple[float, float | None]:
    """One iteration of the job: its time (slowest stage) and energy (every stage's)."""
    time_s = max(r.end_s - r.start_s for r in records)
    energies = [r.energy_j for r in records]
    if any(e is None for e in energies):
        return time_s, None
    return time_s, math.fsum(e for e in energies if e is not None)


def interleaved(
    rounds: Sequence[
        tuple[Sequence[Sequence[IterationRecord]], Sequence[Sequence[IterationRecord]]]
    ],
) -> Estimate | None:
    """Each round's plan window against its reference window.

    Args:
        rounds: Per round, its reference iterations and its plan iterations (each iteration:
            every stage's record).

    Returns:
        ``None`` when no round has both windows measured.
    """
    savings: list[float] = []
    slowdowns: list[float] = []
    spread = _Spread()
    for refs, plans in rounds:
        ref = [_job(it) for it in refs]
        plan = [_job(it) for it in plans]
        if not ref or not plan or any(e is None for _, e in ref + plan):
            continue
        ref_t = statistics.fmean(t for t, _ in ref)
        ref_e = statistics.fmean(e for _, e in ref if e is not None)
        plan_t = statistics.fmean(t for t, _ in plan)
        plan_e = statistics.fmean(e for _, e in plan if e is not None)
        if ref_t > 0 and ref_e > 0:
            savings.append(100.0 * (1.0 - plan_e / ref_e))
            slowdowns.append(100.0 * (plan_t / ref_t - 1.0))
            spread.add(ref, plan)
    if not savings:
        return None
    got = Estimate.of("interleaved", savings, slowdowns)
    # A handful of rounds can agree by chance: the interval is at least what the iterations'
    # own spread gives a round (a factor shared by a whole iteration: 1-2 %, docs/emulator.md)
    floor = spread.interval(len(savings))
    if floor is None:
        return got
    saving_floor, slowdown_floor = floor
    return dataclasses.replace(
        got,
        saving_ci_percent=max(got.saving_ci_percent, saving_floor),
        slowdown_ci_percent=max(got.slowdown_ci_percent, slowdown_floor),
    )


class _Spread:
    """The spread of iteration times and energies within windows, pooled over rounds."""

    def __init__(self) -> None:
        self.t_ss = self.e_ss = 0.0
        self.dof = 0
        self.share = 0.0  # sum over rounds of (1/n_ref + 1/n_plan)

    def add(
        self, ref: Sequence[tuple[float, float | None]], plan: Sequence[tuple[float, float | None]]
    ) -> None:
        """One round's reference and plan iterations."""
        for window in (ref, plan):
            ts = [t for t, _ in window]
            es = [e for _, e in window if e is not None]
            if len(ts) > 1 and len(es) == len(ts):
                mt, me = statistics.fmean(ts), statistics.fmean(es)
                self.t_ss += math.fsum((t / mt - 1.0) ** 2 for t in ts)
                self.e_ss += math.fsum((e / me - 1.0) ** 2 for e in es)
                self.dof += len(ts) - 1
        self.share += 1.0 / len(ref) + 1.0 / len(plan)

    def interval(self, rounds: int) -> tuple[float, float] | None:
        """``(saving, slowdown)`` half-widths (points) of the mean over ``rounds``, or ``None``."""
        if self.dof < 2 or not rounds:
            return None
        scale = t95(self.dof) * 100.0 * math.sqrt(self.share) / rounds
        return scale * math.sqrt(self.e_ss / self.dof), scale * math.sqrt(self.t_ss / self.dof)


def paired(
    replayer: Replayer,
    refs: Sequence[Sequence[IterationRecord]],
    plans: Sequence[Sequence[IterationRecord]],
    *,
    held_s: float | None = None,
) -> Estimate | None:
    """The plan iterations against their own counterfactual at the baseline clocks.

    Args:
        replayer: The planned workload's replay.
        refs: The reference iterations (calibrate the energy model).
        plans: The plan iterations.
        held_s: The baseline iterations are held by a straggler (the ``deadline`` policy's
            reference windows' mean time), or ``None``. Each plan iteration's baseline is held
            to the reference iterations' (median) ratio of their time to their pipeline's
            critical path, times its own pipeline's at the baseline clocks: the straggler's time
            follows each iteration's shared factor (a job-wide one), which one mean time does
            not; the mean is the fallback.

    Returns:
        ``None`` when fewer than two plan iterations replay, or no reference iteration
        calibrates the energy model.
    """
    calibration = []
    ratios = []
    for it in refs:
        cf = replayer.replay(it)
        if cf is not None and cf.energy_j is not None and cf.model_energy_j > 0:
            calibration.append(cf.energy_j / cf.model_energy_j)
        if cf is not None and held_s is not None and cf.pipeline_s > 0:
            ratios.append(cf.time_s / cf.pipeline_s)
    ratio = statistics.median(ratios) if ratios else None
    replayed: list[Counterfactual] = [
        cf
        for cf in (
            replayer.replay(it, held_s=held_s if ratio is None else None, held_ratio=ratio)
            for it in plans
        )
        if cf is not None and cf.energy_j is not None
    ]
    if len(replayed) < 2 or not calibration:
        return None
    c, c_ci = mean_ci(calibration)
    if len(calibration) < 2:
        c_ci = 0.0  # one reference iteration: its error is unknown, the spread below still counts
    savings, slowdowns = [], []
    for cf in replayed:
        assert cf.energy_j is not None
        savings.append(100.0 * (1.0 - cf.energy_j / (c * cf.baseline_energy_j)))
        slowdowns.append(100.0 * (cf.time_s / cf.baseline_time_s - 1.0))
    return Estimate.of("paired", savings, slowdowns, scale_error=c_ci / c)


def verdict(
    estimate: Estimate,
    *,
    max_slowdown: float | None,
    predicted_saving_percent: float | None,
    max_interval_points: float = MAX_INTERVAL_POINTS,
) -> tuple[str, str | None]:
    """The verdict on a plan from its estimate: ``(verdict, reason)``.

    Args:
        estimate: What the loop measured.
        max_slowdown: The policy's bound (fraction), ``None`` for none (min-energy).
        predicted_saving_percent: The planner's prediction, when known.
        max_interval_points: Wider intervals judge nothing.
    """
    e = estimate
    if e.saving_ci_percent > max_interval_points or e.slowdown_ci_percent > max_interval_points:
        return "inconclusive", (
            f"the {e.method} measurement is too noisy to judge the plan (saving "
            f"{e.saving_percent:.2f} +- {e.saving_ci_percent:.2f} %, slowdown "
            f"{e.slowdown_percent:+.2f} +- {e.slowdown_ci_percent:.2f} %; an interval wider "
            f"than +-{max_interval_points:g} points judges nothing)"
        )
    if (
        max_slowdown is not None
        and e.slowdown_percent - e.slowdown_ci_percent > 100.0 * max_slowdown
    ):
        return "reverted", (
            f"the plan runs {e.slowdown_percent:+.3f} +- {e.slowdown_ci_percent:.3f} % slower than "
            f"the baseline clocks, past the allowed {100.0 * max_slowdown:.3g} %"
        )
    if e.saving_percent + e.saving_ci_percent <= 0.0:
        return "reverted", (
            f"the plan saves no energy ({e.saving_percent:.2f} +- {e.saving_ci_percent:.2f} %)"
        )
    if (
        predicted_saving_percent is not None
        and e.saving_percent + e.saving_ci_percent < predicted_saving_percent - SHORTFALL_POINTS
    ):
        return "shortfall", (
            f"the plan saves {e.saving_percent:.2f} +- {e.saving_ci_percent:.2f} %, more than "
            f"{SHORTFALL_POINTS:g} point below the {predicted_saving_percent:.2f} % predicted; kept"
        )
    return "kept", None
