"""Power per label from counter intervals: the profile's least-squares attribution.

A counter that publishes every ~100 ms cannot be read at an instruction's begin and end: the
difference of two reads is the energy of a window shifted back by up to one period, a bias that
no number of iterations removes (issue 32's measurement: backward rows 12-25 % low). Instead,
:mod:`powerlib.measurement.timeline` locates every counter update in time (a *knot*), and
between two knots the counter's delta is exact. Each interval between knots is covered by known
spans: instructions of a (kind, clock), and the rest of the measured window (waiting: blocking
power). With one unknown power per label,

    ΔE_i = Σ_ℓ P_ℓ · overlap_ℓ(i)

for every interval ``i`` inside a measured window, solved by least squares. The residuals give
each power's standard error (``σ² (AᵀA)⁻¹``), so every profile row carries its own interval.
Intervals shorter than ``min_interval_s`` are merged with their neighbours (a fine counter gives
thousands of them; summing adjacent rows loses nothing, the deltas add exactly).

Partial-time power sampling (A100/H100 sample a 25 % window of each 100 ms period; Yang et al.,
SC'24, arXiv 2312.02741) makes each delta ``1 / duty`` times the energy of the last ``duty`` of
its period. Treated as the whole interval's energy it is unbiased over intervals at random phase
against the workload but so noisy that a clock needs ~175 iterations to resolve (issue 45);
with the device's duty known (:attr:`~powerlib.device.DeviceInfo.power_sampling_duty`) each row
counts only the spans inside its sampled window (:func:`sampled_windows`), and the rows are as
exact as at full duty (docs/measurement.md §2.1).

A GPU that warms while a sweep runs draws more power for the same work, and a sweep measures
its clocks at different times: :func:`solve_drifting_powers` fits one common relative drift per
unit of a covariate (the temperature) and reports every power at the covariate's reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DriftingPowers",
    "LabelPower",
    "REST",
    "Spans",
    "sampled_windows",
    "solve_drifting_powers",
    "solve_powers",
    "t95",
]

MIN_DOF = 4
"""Fewer intervals than unknowns plus this leave a power's error unknown (``inf``)."""

_T95 = {
    1: 12.71,
    2: 4.30,
    3: 3.18,
    4: 2.78,
    5: 2.57,
    6: 2.45,
    7: 2.36,
    8: 2.31,
    9: 2.26,
    10: 2.23,
    15: 2.13,
    20: 2.09,
    30: 2.04,
}


def t95(dof: int) -> float:
    """Two-sided 95 % Student's t for ``dof`` >= 1 degrees of freedom.

    Between table entries the next lower one (a slightly wider interval); 1.96 beyond 30.
    """
    if dof > 30:
        return 1.96
    return _T95[max(k for k in _T95 if k <= dof)]


REST = "rest"
"""The label of measured-window time no span covers (waiting between instructions)."""


@dataclass(frozen=True, slots=True)
class LabelPower:
    """The solved power of one label.

    Attributes:
        power_w: Mean power while the label's spans ran.
        stderr_w: Its standard error (``inf`` when not determined).
        covered_s: Time of the label inside the intervals used.
    """

    power_w: float
    stderr_w: float
    covered_s: float
    dof: int = 1 << 30

    @property
    def rel_error(self) -> float:
        """Half-width of the 95 % interval, relative to the power.

        Student's t on the residuals' degrees of freedom: a fit with a handful of intervals to
        spare says little about its own error.
        """
        if self.power_w <= 0 or not math.isfinite(self.stderr_w) or self.dof < MIN_DOF:
            return math.inf
        return t95(self.dof) * self.stderr_w / self.power_w


class Spans:
    """Labelled spans on one device's clock, and the windows in which the labelling is complete.

    Inside a window, time not covered by a span belongs to :data:`REST`.
    """

    def __init__(self) -> None:
        self._labels: dict[Hashable, list[tuple[float, float]]] = {}
        self.windows: list[tuple[float, float]] = []

    def add(self, label: Hashable, start_s: float, end_s: float) -> None:
        """One span (spans of one device never overlap)."""
        if end_s > start_s:
            self._labels.setdefault(label, []).append((start_s, end_s))

    def add_window(self, start_s: float, end_s: float) -> None:
        """A window of complete labelling (windows never overlap)."""
        if end_s > start_s:
            self.windows.append((start_s, end_s))

    @property
    def labels(self) -> list[Hashable]:
        """The labels with spans."""
        return list(self._labels)

    def covered(self, label: Hashable, at_s: np.ndarray) -> np.ndarray:
        """Cumulative time of ``label``'s spans inside the windows, before each of ``at_s``."""
        spans = self._clip(self._labels.get(label, []))
        return _cumulative(spans, at_s)

    def window_time(self, at_s: np.ndarray) -> np.ndarray:
        """Cumulative window time before each of ``at_s``."""
        return _cumulative(sorted(self.windows), at_s)

    def _clip(self, spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
        out = []
        windows = sorted(self.windows)
        starts = [w[0] for w in windows]
        for a, b in spans:
            i = int(np.searchsorted(starts, a, side="right")) - 1
            for w0, w1 in windows[max(i, 0) :]:
                if w0 >= b:
                    break
                lo, hi = max(a, w0), min(b, w1)
                if hi > lo:
                    out.append((lo, hi))
        out.sort()
        return out


def _cumulative(spans: Sequence[tuple[float, float]], at_s: np.ndarray) -> np.ndarray:
    if not spans:
        return np.zeros_like(at_s, dtype=float)
    s = np.asarray(spans, dtype=float)
    starts, ends = s[:, 0], s[:, 1]
    before = np.concatenate([[0.0], np.cumsum(ends - starts)])
    k = np.searchsorted(starts, at_s, side="right") - 1
    inside = np.clip(at_s - starts[np.maximum(k, 0)], 0.0, (ends - starts)[np.maximum(k, 0)])
    return np.where(k < 0, 0.0, before[np.maximum(k, 0)] + inside)


def solve_powers(
    knot_times_s: np.ndarray,
    knot_energy_j: np.ndarray,
    spans: Spans,
    *,
    min_interval_s: float = 0.02,
    duty: float = 1.0,
) -> tuple[dict[Hashable, LabelPower], int]:
    """Per-label power from the counter intervals that lie inside the windows.

    Args:
        knot_times_s: Counter-update instants (:attr:`EnergyTimeline.knot_times_s`).
        knot_energy_j: Cumulative energy at each.
        spans: The labelled spans and windows.
        min_interval_s: Adjacent intervals are merged up to at least this length.
        duty: Share of each counter period, at its end, in which the device samples power
            (:attr:`~powerlib.device.DeviceInfo.power_sampling_duty`; 1: the whole period).
            Below 1 each update adds ``1 / duty`` times the energy of the last ``duty`` of its
            period, so an interval's row counts only the spans inside that sampled window
            (:func:`sampled_windows`).

    Returns:
        ``(powers, intervals)``: each label's power (and :data:`REST`'s, when windows leave
        uncovered time), and how many intervals were used. Labels that no usable interval
        covered are missing.
    """
    design = _design(knot_times_s, knot_energy_j, spans, min_interval_s, duty)
    if design is None:
        return {}, 0
    a, b, labels, _ = design
    solution, stderr, dof = _linear_fit(a, b)
    return _label_powers(labels, a, solution, stderr, dof), a.shape[0]


@dataclass(frozen=True, slots=True)
class DriftingPowers:
    """Per-label powers under a common slow drift (:func:`solve_drifting_powers`).

    Attributes:
        powers: Each label's power where the covariate is 0 (its reference), with its error
            (the drift's uncertainty included).
        intervals: Counter intervals used.
        drift_per_unit: The fitted relative change of every power per unit of the covariate.
        drift_stderr: Its standard error.
    """

    powers: dict[Hashable, LabelPower]
    intervals: int
    drift_per_unit: float
    drift_stderr: float


def solve_drifting_powers(
    knot_times_s: np.ndarray,
    knot_energy_j: np.ndarray,
    spans: Spans,
    covariate: Callable[[np.ndarray], np.ndarray],
    *,
    min_interval_s: float = 0.02,
    duty: float = 1.0,
) -> DriftingPowers | None:
    """:func:`solve_powers` with every power scaled by ``1 + β · x(t)``, one ``β`` for all.

    A GPU warming up draws more power for the same work (leakage rises with temperature; the
    emulator's thermal drift). A sweep that runs its clocks at different times then measures
    each clock at a different temperature, and the profile tilts with the drift. With ``x`` a
    slow covariate of the drift (the temperature minus its value where the plan will run),

        ΔE_i = (1 + β · x_i) · Σ_ℓ P_ℓ · overlap_ℓ(i)

    is bilinear in ``(P, β)``; Gauss-Newton from the drift-free fit converges in a few steps,
    and the errors come from its Jacobian at the solution. ``β`` is identified by the labels
    measured at several values of ``x`` (the blocking power, between instructions in every
    block) and by each block's own change of ``x``.

    Args:
        knot_times_s: Counter-update instants.
        knot_energy_j: Cumulative energy at each.
        spans: The labelled spans and windows.
        covariate: ``x`` at given times (``nan`` where unknown: those intervals are not used).
        min_interval_s: See :func:`solve_powers`.
        duty: See :func:`solve_powers`.

    Returns:
        The powers at ``x = 0`` and ``β``; ``None`` when no interval is usable.
    """
    design = _design(knot_times_s, knot_energy_j, spans, min_interval_s, duty)
    if design is None:
        return None
    a, b, labels, mid_s = design
    x = np.asarray(covariate(mid_s), dtype=float)
    known = np.isfinite(x)
    a, b, x = a[known], b[known], x[known]
    if a.shape[0] == 0:
        return None
    power, _, _ = _linear_fit(a, b)
    beta = 0.0
    for _ in range(6):
        base = a @ power
        jac = np.column_stack([a * (1.0 + beta * x)[:, None], x * base])
        residual = b - (1.0 + beta * x) * base
        step, *_ = np.linalg.lstsq(jac, residual, rcond=None)
        power, beta = power + step[:-1], beta + float(step[-1])
        if abs(float(step[-1])) < 1e-9:
            break
    base = a @ power
    jac = np.column_stack([a * (1.0 + beta * x)[:, None], x * base])
    stderr, dof = _stderr(jac, b - (1.0 + beta * x) * base)
    return DriftingPowers(
        powers=_label_powers(labels, a, power, stderr[:-1], dof),
        intervals=int(a.shape[0]),
        drift_per_unit=beta,
        drift_stderr=float(stderr[-1]),
    )


def _design(
    knot_times_s: np.ndarray,
    knot_energy_j: np.ndarray,
    spans: Spans,
    min_interval_s: float,
    duty: float,
) -> tuple[np.ndarray, np.ndarray, list[Hashable], np.ndarray] | None:
    """The least-squares rows: ``(a, b, labels, mid_s)``, only the labels some row covers.

    ``a[i, j]``: seconds of label ``j`` in interval ``i`` (in its sampled windows below full
    duty); ``b[i]``: the counter's delta (times the duty); ``mid_s``: each interval's middle.
    """
    tau = np.asarray(knot_times_s, dtype=float)
    energy = np.asarray(knot_energy_j, dtype=float)
    if tau.size < 2 or not spans.windows:
        return None
    # merge short intervals: keep knots at least min_interval_s apart
    keep = [0]
    for i in range(1, tau.size):
        if tau[i] - tau[keep[-1]] >= min_interval_s:
            keep.append(i)
    if len(keep) < 2:
        return None
    labels = spans.labels
    tau_kept = tau[keep]
    if duty >= 1.0:
        length = np.diff(tau_kept)
        window = np.diff(spans.window_time(tau_kept))
        usable = window >= length * (1.0 - 1e-9)  # wholly inside the windows
        columns = [np.diff(spans.covered(label, tau_kept))[usable] for label in labels]
        window = window[usable]
    else:
        usable, window, columns = _sampled_design(tau, np.asarray(keep), spans, labels, duty)
    if not np.any(usable):
        return None
    rest = window - np.sum(columns, axis=0) if columns else window
    columns.append(np.maximum(rest, 0.0))
    a = np.stack(columns, axis=1)
    present = a.sum(axis=0) > 1e-9
    if not np.any(present):
        return None
    # below full duty the rows are sampled seconds: the counter's delta times the duty
    b = np.diff(energy[keep])[usable] * min(duty, 1.0)
    mid_s = (0.5 * (tau_kept[:-1] + tau_kept[1:]))[usable]
    used = [label for label, p in zip([*labels, REST], present) if p]
    return a[:, present], b, used, mid_s


def _linear_fit(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Least squares ``a @ x = b``: ``(x, stderr, dof)`` (``inf`` errors without residual dof)."""
    solution, *_ = np.linalg.lstsq(a, b, rcond=None)
    stderr, dof = _stderr(a, b - a @ solution)
    return solution, stderr, dof


def _stderr(jac: np.ndarray, residual: np.ndarray) -> tuple[np.ndarray, int]:
    """Standard errors ``sqrt(diag(σ² (JᵀJ)⁻¹))`` of a fit, and its residual dof."""
    m, k = jac.shape
    dof = m - k
    if dof <= 0:
        return np.full(k, math.inf), dof
    sigma2 = float(np.sum(residual**2)) / dof
    cov = sigma2 * np.linalg.pinv(jac.T @ jac)
    return np.sqrt(np.maximum(np.diag(cov), 0.0)), dof


def _label_powers(
    labels: list[Hashable], a: np.ndarray, power: np.ndarray, stderr: np.ndarray, dof: int
) -> dict[Hashable, LabelPower]:
    covered = a.sum(axis=0)
    return {
        label: LabelPower(float(power[j]), float(stderr[j]), float(covered[j]), dof)
        for j, label in enumerate(labels)
    }


def sampled_windows(
    knot_times_s: np.ndarray, duty: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where a part-time sensor sampled the energy each counter update added.

    A device that samples power only during the last ``duty`` of each counter period (A100 and
    H100: a 25 ms window of each 100 ms period; Yang et al., SC'24, arXiv 2312.02741; docs/
    measurement.md §2.1) adds at each update ``1 / duty`` times the energy of that window. The
    updates are periodic: the period is the median gap between located updates, and an interval
    that spans ``n`` periods (updates the reads missed) holds ``n`` windows, one before each
    update, the last ending at its knot.

    Args:
        knot_times_s: Located counter-update instants, increasing.
        duty: The sampled share of each period, in (0, 1].

    Returns:
        ``(starts, ends, interval)``: each sampled window, and the index of the interval
        (between knots ``i`` and ``i + 1``) whose delta holds it.
    """
    tau = np.asarray(knot_times_s, dtype=float)
    if tau.size < 2:
        empty = np.zeros(0)
        return empty, empty, np.zeros(0, dtype=int)
    gaps = np.diff(tau)
    period = float(np.median(gaps))
    count = np.maximum(np.rint(gaps / period), 1).astype(int) if period > 0 else np.ones_like(gaps)
    interval = np.repeat(np.arange(gaps.size), count)
    # in time order; the last window of an interval ends at its knot, the others a step apart
    first = np.concatenate([[0], np.cumsum(count)[:-1]])
    back = count[interval] - 1 - (np.arange(interval.size) - np.repeat(first, count))
    step = gaps[interval] / count[interval]
    ends = tau[interval + 1] - back * step
    starts = ends - duty * np.minimum(step, period)
    return starts, ends, interval


def _sampled_design(
    tau: np.ndarray,
    keep: np.ndarray,
    spans: Spans,
    labels: list[Hashable],
    duty: float,
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """The rows of a part-time counter: per kept interval, the sampled seconds of each label.

    Returns:
        ``(usable, window, columns)``: which kept intervals have every sampled window inside
        the measured windows, and for those the sampled window time and each label's share.
    """
    starts, ends, interval = sampled_windows(tau, duty)
    # each raw interval belongs to the kept (merged) interval that ends at or after its knot
    merged = np.searchsorted(keep, interval + 1, side="left") - 1
    inside = (merged >= 0) & (merged < keep.size - 1)
    starts, ends, merged = starts[inside], ends[inside], merged[inside]
    n = keep.size - 1
    sampled = spans.window_time(ends) - spans.window_time(starts)
    whole = sampled >= (ends - starts) * (1.0 - 1e-9)
    usable = np.ones(n, dtype=bool)
    np.logical_and.at(usable, merged, whole)
    has = np.zeros(n, dtype=bool)
    has[merged] = True
    usable &= has
    window = np.zeros(n)
    np.add.at(window, merged, sampled)
    columns = []
    for label in labels:
        column = np.zeros(n)
        np.add.at(column, merged, spans.covered(label, ends) - spans.covered(label, starts))
        columns.append(column[usable])
    return usable, window[usable], columns
