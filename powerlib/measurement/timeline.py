"""Energy at any instant of a run, from one device's samples: the attribution math of measure.

The sampler thread of :mod:`powerlib.measure_api.measure` reads each device every few
milliseconds and keeps ``(time, counter, power)``. Steps and windows only record their boundary
times. After the run (never on the training thread) this module turns the samples into a
function ``E(t)``, the device's cumulative energy at any time, and a window's energy is
``E(end) - E(start)``.

How ``E(t)`` is built (docs/measurement.md):

1. **Unwrap.** A counter that decreases either wrapped (the device declares its range and the
   drop is more than half of it: the delta is ``new + range - old``) or was reset (driver reload,
   GPU reset): the energy across a reset is the power integral over that interval, and the
   result is marked estimated.
2. **Knots.** A hardware counter publishes a new value every so often (NVML and the simulator:
   about every 100 ms), not at every read. Where a read first shows a new value, the update
   happened between that read and the previous one; that interval brackets a *knot* (an instant
   whose cumulative energy is known exactly). Its time is estimated from the interval's midpoint
   and, when the counter updates periodically, refined by a local least-squares fit of the
   update times (a straight line through the neighbouring midpoints against their update index),
   clipped back into the bracketing interval, so it is never worse than the midpoint.
3. **Shape between knots.** Between two knots the counter's delta is exact; how much of it falls
   before a boundary follows the integral of the sampled power, ``Q(t)`` (trapezoidal), so a
   step change of power inside one update period is attributed where it happened. Before the
   first knot and after the last one, ``E`` extends with ``Q`` scaled by the counter-to-power
   ratio of the covered span.
4. **No counter.** ``E(t) = Q(t)``, marked estimated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["EnergyTimeline", "build_timeline"]

_FIT_HALF_WIDTH = 8
"""Knots on each side of a knot in its local fit of update times."""

_FINE_SHARE = 0.9
"""Share of reads that saw a new value above which the counter counts as finer than the reads."""

_CONSISTENT_HALF_WIDTH = 20
"""Knots on each side of a knot whose brackets bound its counter offset (see _energy_consistent)."""


@dataclass(frozen=True, slots=True)
class EnergyTimeline:
    """``E(t)`` of one device (see the module docstring).

    Attributes:
        source: ``"counter"`` (hardware energy counter) or ``"integrated"`` (power samples).
        estimated: True when any part of ``E`` is not from the counter: integrated power, a
            counter reset, or no counter update seen during the run.
        resets: Counter resets seen (a decrease that is not a wrap).
        wraps: Counter wraps seen.
        samples: Reads that went into the timeline.
        knot_times_s: Estimated counter-update instants (empty for ``integrated``).
        knot_energy_j: Cumulative energy at each knot, unwrapped, from the first read.
        covered: ``(first, last)`` knot times: where ``E`` comes straight from the counter.
    """

    source: str
    estimated: bool
    resets: int
    wraps: int
    samples: int
    knot_times_s: np.ndarray
    knot_energy_j: np.ndarray
    covered: tuple[float, float] | None
    _times_s: np.ndarray
    _q_j: np.ndarray
    _last_power_w: float
    _scale: float

    def power_integral_j(self, times_s: np.ndarray) -> np.ndarray:
        """``Q(t)``: the trapezoidal integral of sampled power since the first read."""
        t = self._times_s
        if t.size == 0:
            return np.zeros_like(times_s, dtype=float)
        q: np.ndarray = np.interp(times_s, t, self._q_j)
        after = times_s > t[-1]
        q[after] = self._q_j[-1] + self._last_power_w * (times_s[after] - t[-1])
        return q  # before the first read np.interp holds Q at 0: nothing is known there

    def energy_at(self, times_s: Sequence[float] | np.ndarray) -> np.ndarray:
        """Cumulative energy (J, from the first read) at each time."""
        x = np.asarray(times_s, dtype=float)
        q = self.power_integral_j(x)
        tau, e = self.knot_times_s, self.knot_energy_j
        if tau.size == 0:
            return q * self._scale
        q_tau = self.power_integral_j(tau)
        out = np.empty_like(x)
        k = np.searchsorted(tau, x, side="right") - 1  # knot at or before x
        before = k < 0
        out[before] = e[0] - (q_tau[0] - q[before]) * self._scale
        after = k >= tau.size - 1
        out[after] = e[-1] + (q[after] - q_tau[-1]) * self._scale
        mid = ~(before | after)
        if np.any(mid):
            km = k[mid]
            dq = q_tau[km + 1] - q_tau[km]
            dt = tau[km + 1] - tau[km]
            by_power = np.divide(q[mid] - q_tau[km], dq, out=np.zeros_like(dq), where=dq > 1e-12)
            by_time = np.divide(x[mid] - tau[km], dt, out=np.zeros_like(dt), where=dt > 0)
            weight = np.clip(np.where(dq > 1e-12, by_power, by_time), 0.0, 1.0)
            out[mid] = e[km] + (e[km + 1] - e[km]) * weight
        return out


def build_timeline(
    times_s: Sequence[float],
    counter_j: Sequence[float | None] | None,
    power_w: Sequence[float | None],
    *,
    wrap_j: float | None = None,
    read_s: Sequence[float] | None = None,
    refine: bool = True,
) -> EnergyTimeline:
    """Build ``E(t)`` from one device's reads.

    Args:
        times_s: Read times, non-decreasing.
        counter_j: The raw cumulative counter at each read (``None`` where a read failed), or
            ``None`` for a device without a counter.
        power_w: Power at each read (``None`` where unknown: the previous value holds).
        wrap_j: The counter's range when it wraps below ``2**64`` (e.g. RAPL's
            ``max_energy_range_uj``), else ``None``.
        read_s: How long each read took (``times_s`` are their midpoints): the device was read
            at an unknown instant of it, so an update's bracket runs from the start of the read
            before it to the end of the read that saw it. Default: instantaneous reads.
        refine: Place knots where the sampled power says within their brackets (step 2's
            energy-consistent placement). ``False`` keeps the periodic fit only: cheaper, for
            the profile phase's per-iteration checks, which only need the knots.
    """
    t = np.asarray(times_s, dtype=float)
    p = _fill_power(power_w)
    q = np.zeros_like(t)
    if t.size > 1:
        q[1:] = np.cumsum(0.5 * (p[1:] + p[:-1]) * np.diff(t))
    last_w = float(p[-1]) if p.size else 0.0
    empty = np.zeros(0)
    if counter_j is None:
        return EnergyTimeline(
            source="integrated", estimated=True, resets=0, wraps=0, samples=int(t.size),
            knot_times_s=empty, knot_energy_j=empty, covered=None,
            _times_s=t, _q_j=q, _last_power_w=last_w, _scale=1.0,
        )  # fmt: skip
    cum, valid, is_knot, resets, wraps = _unwrap(t, counter_j, q, wrap_j)
    half = np.zeros_like(t) if read_s is None else 0.5 * np.asarray(read_s, dtype=float)
    lo, hi, values, at = [], [], [], []
    prev = -1
    for i in range(t.size):
        if not valid[i]:
            continue
        if prev >= 0 and is_knot[i] and cum[i] != cum[prev]:
            lo.append(t[prev] - half[prev])
            hi.append(t[i] + half[i])
            values.append(cum[i])
            at.append(t[i])
        prev = i
    if not values:  # no update seen: the counter's first value is not tied to any instant
        return EnergyTimeline(
            source="counter", estimated=True, resets=resets, wraps=wraps, samples=int(t.size),
            knot_times_s=empty, knot_energy_j=empty, covered=None,
            _times_s=t, _q_j=q, _last_power_w=last_w, _scale=1.0,
        )  # fmt: skip
    lo_a, hi_a = np.asarray(lo), np.asarray(hi)
    fine = len(values) >= _FINE_SHARE * max(int(valid.sum()) - 1, 1)
    if fine:
        # Nearly every read saw a new value: the counter updates at least as often as it is
        # read (a 1 ms counter, RAPL), so its last update before a read is within one of its
        # own periods of that read: the read, not its bracket's middle, is the knot's time.
        tau = np.maximum.accumulate(np.asarray(at, dtype=float))
    else:
        tau = _knot_times(lo_a, hi_a)
    e = np.asarray(values)
    scale = _scale(tau, e, t, q)
    if tau.size >= 2 and not fine and refine:
        tau = _energy_consistent(tau, lo_a, hi_a, e, t, q, scale)
        scale = _scale(tau, e, t, q)
    return EnergyTimeline(
        source="counter", estimated=resets > 0, resets=resets, wraps=wraps, samples=int(t.size),
        knot_times_s=tau, knot_energy_j=e, covered=(float(tau[0]), float(tau[-1])),
        _times_s=t, _q_j=q, _last_power_w=last_w, _scale=scale,
    )  # fmt: skip


def _scale(tau: np.ndarray, e: np.ndarray, t: np.ndarray, q: np.ndarray) -> float:
    """Counter energy per unit of power integral over the knots' span (1.0 when unknown)."""
    if tau.size < 2:
        return 1.0
    q_span = float(np.interp(tau[-1], t, q) - np.interp(tau[0], t, q))
    if q_span > 0 and e[-1] > e[0]:
        scale = float((e[-1] - e[0]) / q_span)
        if 0.2 < scale < 5.0:  # else power readings unrelated to the counter: do not trust
            return scale
    return 1.0


def _energy_consistent(
    tau: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    e: np.ndarray,
    t: np.ndarray,
    q: np.ndarray,
    scale: float,
) -> np.ndarray:
    """Knot times placed where the counter's own values say, within their brackets.

    Over a few update periods the counter is ``E = s * Q(t) + c`` (``s`` the counter-to-power
    ratio, ``c`` an offset): every knot then lies at ``Q^-1((e - c) / s)``, and its bracket
    ``[lo, hi]`` bounds the line: ``s * Q(lo) + c <= e <= s * Q(hi) + c``. Over a knot's
    neighbours these inequalities leave a small feasible set of ``(s, c)``, far narrower than any
    one bracket (reads that waited for the GIL leave brackets of tens of ms, but their edges fall
    at different phases of the update period); its middle places the knot. Eliminating ``c``
    bounds ``s`` by every pair ``i < j``: ``(e_j - e_i) / (Q(hi_j) - Q(lo_i)) <= s <= (e_j -
    e_i) / (Q(lo_j) - Q(hi_i))``. Where the set is empty (power changed faster than it was
    sampled), the knot keeps its time from :func:`_knot_times`.
    """
    q_lo = np.interp(lo, t, q)
    q_hi = np.interp(hi, t, q)
    increasing = np.concatenate([[True], np.diff(q) > 0])  # np.interp wants increasing x
    if increasing.sum() < 2:
        return tau
    n, w = tau.size, _CONSISTENT_HALF_WIDTH
    s_lo, s_hi = _window_scale_bounds(q_lo, q_hi, e, w)
    ok = (s_lo <= s_hi) & (s_hi > 0.2) & (s_lo < 5.0)
    # Few knots leave a wide range of ratios; its middle is no better than any other point of
    # it. Power readings agree with the counter to within a few percent (docs/measurement.md
    # §2), so the ratio nearest 1 is the likeliest; many knots narrow the range to the data's.
    s = np.where(ok, np.clip(1.0, s_lo, s_hi), scale)
    win = np.lib.stride_tricks.sliding_window_view
    pad = np.full(w, np.nan)
    e_w = win(np.concatenate([pad, e, pad]), 2 * w + 1)
    lo_w = win(np.concatenate([pad, q_lo, pad]), 2 * w + 1)
    hi_w = win(np.concatenate([pad, q_hi, pad]), 2 * w + 1)
    c_min = np.nanmax(e_w - s[:, None] * hi_w, axis=1)
    c_max = np.nanmin(e_w - s[:, None] * lo_w, axis=1)
    feasible = c_min <= c_max
    placed = np.interp((e - 0.5 * (c_min + c_max)) / s, q[increasing], t[increasing])
    out = np.where(feasible, placed, tau)
    out = np.clip(out, lo, hi)
    return np.maximum.accumulate(out[:n])


def _window_scale_bounds(
    q_lo: np.ndarray, q_hi: np.ndarray, e: np.ndarray, w: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per knot, the range of ratios ``s`` that every pair of brackets in its window admits.

    A pair ``(i, i + d)`` lies in the window of knot ``k`` (knots ``k - w .. k + w``) when
    ``k - w <= i <= k + w - d``: for each distance ``d`` a sliding max (min) over ``i`` gives
    every window's bound at once. An empty range comes back as ``lo > hi``.
    """
    n = e.size
    lo = np.full(n, -np.inf)
    hi = np.full(n, np.inf)
    for d in range(1, min(2 * w, n - 1) + 1):
        de = e[d:] - e[:-d]
        wide = q_hi[d:] - q_lo[:-d]
        narrow = q_lo[d:] - q_hi[:-d]
        bad = (de <= 0) | (wide <= 0)
        lower = np.where(bad, np.inf, de / np.where(wide > 0, wide, 1.0))
        upper = np.where(narrow > 0, de / np.where(narrow > 0, narrow, 1.0), np.inf)
        size = 2 * w - d + 1
        pad_lo, pad_hi = np.full(w, -np.inf), np.full(w, np.inf)
        lo = np.maximum(lo, _sliding_max(np.concatenate([pad_lo, lower, pad_lo]), size)[:n])
        hi = np.minimum(hi, -_sliding_max(-np.concatenate([pad_hi, upper, pad_hi]), size)[:n])
    return lo, hi


def _sliding_max(x: np.ndarray, size: int) -> np.ndarray:
    """``max(x[i : i + size])`` for every full window, in O(len(x)) (van Herk / Gil-Werman)."""
    n = x.size
    blocks = -(-n // size)
    padded = np.full(blocks * size, -np.inf)
    padded[:n] = x
    b = padded.reshape(blocks, size)
    prefix = np.maximum.accumulate(b, axis=1).ravel()
    suffix = np.maximum.accumulate(b[:, ::-1], axis=1)[:, ::-1].ravel()
    count = n - size + 1
    return np.maximum(suffix[:count], prefix[size - 1 : size - 1 + count])


def _fill_power(power_w: Sequence[float | None]) -> np.ndarray:
    out = np.zeros(len(power_w))
    last = next((w for w in power_w if w is not None and math.isfinite(w)), 0.0)
    for i, w in enumerate(power_w):
        if w is not None and math.isfinite(w):
            last = w
        out[i] = last
    return out


def _unwrap(
    t: np.ndarray, counter_j: Sequence[float | None], q: np.ndarray, wrap_j: float | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Cumulative energy from the first valid read; which reads are valid and may be knots."""
    n = t.size
    cum = np.zeros(n)
    valid = np.zeros(n, dtype=bool)
    is_knot = np.ones(n, dtype=bool)
    resets = wraps = 0
    prev_raw: float | None = None
    prev_i = -1
    total = 0.0
    for i, raw in enumerate(counter_j):
        if raw is None or not math.isfinite(raw):
            continue
        if prev_raw is not None:
            delta = raw - prev_raw
            if delta < 0:
                if wrap_j is not None and prev_raw - raw > 0.5 * wrap_j:
                    delta = raw + wrap_j - prev_raw
                    wraps += 1
                else:  # reset: the counter restarted at an unknown instant in this interval
                    delta = max(0.0, float(q[i] - q[prev_i]))
                    resets += 1
                    is_knot[i] = False
            total += delta
        cum[i] = total
        valid[i] = True
        prev_raw, prev_i = raw, i
    return cum, valid, is_knot, resets, wraps


def _knot_times(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Update instants from their bracketing intervals (refined when the counter is periodic).

    A knot's value is the counter after the *last* update in its interval. Where reads came
    often enough to see every update (an interval under half a period) that update is the only
    one, estimated from the local fit of the update times, or the midpoint. Where the sampler
    missed updates (it waited for the GIL), the last one is the fitted update just before the
    read that saw it, or, without a fit, half a period before that read.
    """
    mid: np.ndarray = 0.5 * (lo + hi)
    if mid.size < 2:
        return mid
    period = float(np.median(np.diff(mid)))
    if period <= 0:
        return mid
    wide = (hi - lo) > 0.5 * period
    # Without a fit: a missed update's read saw the last update up to a period earlier.
    out = np.where(wide, np.maximum(lo, hi - 0.5 * period), mid)
    narrow = np.flatnonzero(~wide)
    if narrow.size >= 4:
        fitted = _periodic_fit(mid[narrow], period)
        if fitted is not None:
            at, slope, n = fitted
            out[narrow] = at
            for i in np.flatnonzero(wide):  # the last fitted update before the read at hi
                j = narrow[np.argmin(np.abs(narrow - i))]
                k = int(np.searchsorted(narrow, j))
                a, b = at[k] - slope[k] * n[k], slope[k]  # update m happened at a + b*m
                if b > 0:
                    out[i] = a + b * math.floor((hi[i] - a) / b)
    out = np.clip(out, lo, hi)
    return np.maximum.accumulate(out)  # update instants are ordered


def _cumsum_from_zero(values: np.ndarray) -> np.ndarray:
    """``[0, v0, v0 + v1, ...]``: prefix sums, so a window's sum is a difference of two."""
    return np.concatenate([[0.0], np.cumsum(values)])


def _periodic_fit(
    mid: np.ndarray, period: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A local least-squares line ``mid ~ a + b * n`` at each knot, over its neighbours.

    Returns per knot the line's value there (``a + b * n``), its slope ``b`` and the knot's
    update index ``n``; ``None`` when the updates are not periodic.
    """
    gaps = np.diff(mid)
    steps = np.rint(gaps / period)
    if np.any(steps < 1) or np.any(np.abs(gaps / period - steps) > 0.35):
        return None  # not periodic enough to fit
    n = np.concatenate([[0.0], np.cumsum(steps)])
    w = _FIT_HALF_WIDTH
    c = _cumsum_from_zero
    s1, sn, sm, snn, snm = c(np.ones_like(n)), c(n), c(mid), c(n * n), c(n * mid)
    j = np.arange(mid.size)
    a_idx = np.clip(j - w, 0, mid.size)
    b_idx = np.clip(j + w + 1, 0, mid.size)
    cnt = s1[b_idx] - s1[a_idx]
    sum_n = sn[b_idx] - sn[a_idx]
    sum_m = sm[b_idx] - sm[a_idx]
    sum_nn = snn[b_idx] - snn[a_idx]
    sum_nm = snm[b_idx] - snm[a_idx]
    den = cnt * sum_nn - sum_n * sum_n
    slope = np.divide(cnt * sum_nm - sum_n * sum_m, den, out=np.zeros_like(den), where=den > 0)
    icpt = (sum_m - slope * sum_n) / cnt
    at = np.where(den > 0, icpt + slope * n, mid)
    return at, np.where(den > 0, slope, 0.0), n
