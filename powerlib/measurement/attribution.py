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

Partial-time power sampling (A100/H100 sample a 25 % window of each 100 ms period; Yang et al.
2023) makes each delta a sample of part of its interval: unbiased over intervals at random phase
against the workload, noisier, and the residuals widen the intervals accordingly.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["LabelPower", "REST", "Spans", "solve_powers", "t95"]

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
) -> tuple[dict[Hashable, LabelPower], int]:
    """Per-label power from the counter intervals that lie inside the windows.

    Args:
        knot_times_s: Counter-update instants (:attr:`EnergyTimeline.knot_times_s`).
        knot_energy_j: Cumulative energy at each.
        spans: The labelled spans and windows.
        min_interval_s: Adjacent intervals are merged up to at least this length.

    Returns:
        ``(powers, intervals)``: each label's power (and :data:`REST`'s, when windows leave
        uncovered time), and how many intervals were used. Labels that no usable interval
        covered are missing.
    """
    tau = np.asarray(knot_times_s, dtype=float)
    energy = np.asarray(knot_energy_j, dtype=float)
    if tau.size < 2 or not spans.windows:
        return {}, 0
    # merge short intervals: keep knots at least min_interval_s apart
    keep = [0]
    for i in range(1, tau.size):
        if tau[i] - tau[keep[-1]] >= min_interval_s:
            keep.append(i)
    tau, energy = tau[keep], energy[keep]
    if tau.size < 2:
        return {}, 0
    length = np.diff(tau)
    window = np.diff(spans.window_time(tau))
    usable = window >= length * (1.0 - 1e-9)  # wholly inside the windows
    if not np.any(usable):
        return {}, 0
    labels = spans.labels
    columns = [np.diff(spans.covered(label, tau))[usable] for label in labels]
    rest = window[usable] - np.sum(columns, axis=0) if columns else window[usable]
    labels = [*labels, REST]
    columns.append(np.maximum(rest, 0.0))
    a = np.stack(columns, axis=1)
    b = np.diff(energy)[usable]
    covered = a.sum(axis=0)
    present = covered > 1e-9
    a_used = a[:, present]
    m, k = a_used.shape
    if m == 0 or k == 0:
        return {}, 0
    solution, *_ = np.linalg.lstsq(a_used, b, rcond=None)
    dof = m - k
    if dof > 0:
        sigma2 = float(np.sum((a_used @ solution - b) ** 2)) / dof
        cov = sigma2 * np.linalg.pinv(a_used.T @ a_used)
        stderr = np.sqrt(np.maximum(np.diag(cov), 0.0))
    else:
        stderr = np.full(k, math.inf)
    out: dict[Hashable, LabelPower] = {}
    j = 0
    for label, is_present, cov_s in zip(labels, present, covered):
        if not is_present:
            continue
        out[label] = LabelPower(float(solution[j]), float(stderr[j]), float(cov_s), dof)
        j += 1
    return out, m
