"""Repeated work on the partition model: power-cap throttling and Theorem 1 (docs/kareus.md §2.4).

:func:`run_capped` repeats a unit of work under a power cap with a stepping clock controller;
:func:`run_locked` runs it at one clock, so the two can be compared.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from powerlib.errors import PlanError
from powerlib.kareus.partition_types import Config, Op, PartitionType
from powerlib.kareus.sim_fluid import _check_freq, _check_sms, _prepare, _run, simulate
from powerlib.kareus.sim_params import A100, OverlapDeviceParams

__all__ = ["CappedRun", "LockedRun", "Work", "WorkLike", "run_capped", "run_locked"]


# --------------------------------------------------------------------------------------------
# Repeated work, power-cap throttling and Theorem 1
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Work:
    """A unit of work run back to back: partitions, sequential segments and plain compute.

    Each item is ``(PartitionType, Config)`` (the config's clock is ignored: the run sets it),
    ``(tuple[Segment, ...], sm_count)`` for sequential execution, or ``tuple[Op, ...]``.

    Raises:
        PlanError: On an item of none of these forms (when the work is run).
    """

    items: tuple[object, ...]
    params: OverlapDeviceParams = field(default=A100)

    def trace(self, freq_mhz: float) -> list[tuple[float, float]]:
        """One unit's phases at a (possibly off-grid) clock: ``(duration_s, total_power_w)``."""
        f = _check_freq(freq_mhz, self.params)
        dyn: list[tuple[float, float]] = []
        for item in self.items:
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], PartitionType):
                ptype, cfg = item
                if not isinstance(cfg, Config):
                    raise PlanError(f"work item {item!r}: expected (PartitionType, Config)")
                simulate(ptype, cfg, params=self.params)  # validates the slot and SM count
                start = None if cfg.slot is None else ptype.slot_ops[cfg.slot]
                _run(
                    _prepare(ptype.ops, self.params),
                    ptype.comm,
                    start,
                    cfg.sm_count,
                    f,
                    self.params,
                    dyn,
                )
            elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], int):
                sms = _check_sms(item[1], self.params)
                for seg in item[0]:
                    _run(_prepare(seg.ops, self.params), seg.comm, None, sms, f, self.params, dyn)
            elif isinstance(item, tuple) and item and all(isinstance(op, Op) for op in item):
                _run(_prepare(item, self.params), None, None, 1, f, self.params, dyn)
            else:
                raise PlanError(f"cannot run work item {item!r}")
        p_s = self.params.p_static_w
        return [(dt, p + p_s) for dt, p in dyn if dt > 0]

    def at(self, freq_mhz: float) -> tuple[float, float]:
        """``(time_s, energy_j)`` of one unit at a (possibly off-grid) clock."""
        phases = self.trace(freq_mhz)
        return sum(dt for dt, _ in phases), sum(dt * p for dt, p in phases)


WorkLike = Work | Callable[[float], tuple[float, float]]
"""A :class:`Work`, or any ``freq_mhz -> (time_s, energy_j)`` of one unit (constant power)."""


class _Phases:
    """One unit's phases at one clock, for walking through time."""

    __slots__ = ("ends", "powers", "time_s", "energy_j")

    def __init__(self, phases: list[tuple[float, float]]) -> None:
        self.ends: list[float] = []
        self.powers: list[float] = []
        t = e = 0.0
        for dt, p in phases:
            t += dt
            e += dt * p
            self.ends.append(t)
            self.powers.append(p)
        self.time_s = t
        self.energy_j = e

    def energy_between(self, t0: float, dur: float) -> float:
        """Energy from ``t0`` (within the unit) for ``dur`` seconds, wrapping around units."""
        energy = 0.0
        t = t0 % self.time_s
        idx = bisect.bisect_right(self.ends, t)
        left = dur
        n = len(self.ends)
        while left > 1e-15:
            if idx >= n:
                idx, t = 0, 0.0
            step = min(self.ends[idx] - t, left)
            energy += self.powers[idx] * step
            left -= step
            t += step
            if t >= self.ends[idx] - 1e-15:
                idx += 1
        return energy


def _phases_fn(work: WorkLike) -> Callable[[float], _Phases]:
    cache: dict[float, _Phases] = {}

    def at(freq_mhz: float) -> _Phases:
        if freq_mhz not in cache:
            if isinstance(work, Work):
                cache[freq_mhz] = _Phases(work.trace(freq_mhz))
            else:
                t, e = work(freq_mhz)
                cache[freq_mhz] = _Phases([(t, e / t)])
        return cache[freq_mhz]

    return at


@dataclass(frozen=True, slots=True, kw_only=True)
class CappedRun:
    """A power-capped run.

    Attributes:
        time_s: Duration.
        energy_j: Total energy.
        work_units: Units of work completed (fractional).
        avg_freq_mhz: Time-weighted average clock (off the supported grid in general).
        avg_power_w: Average power.
        freq_trace_mhz: Clock in each control period.
        power_trace_w: Average power in each control period.
        period_s: Control period.
    """

    time_s: float
    energy_j: float
    work_units: float
    avg_freq_mhz: float
    avg_power_w: float
    freq_trace_mhz: tuple[float, ...]
    power_trace_w: tuple[float, ...]
    period_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class LockedRun:
    """A run at one locked clock.

    Attributes:
        time_s: Duration.
        energy_j: Total energy.
        work_units: Units of work completed.
        freq_mhz: The clock (as given: off-grid clocks are allowed, see :func:`run_locked`).
        avg_power_w: Average power.
    """

    time_s: float
    energy_j: float
    work_units: float
    freq_mhz: float
    avg_power_w: float


class _Throttle:
    """The power-cap controller: steps the clock by one grid step per control period."""

    def __init__(self, params: OverlapDeviceParams, f_lock: float, cap_w: float) -> None:
        self.params = params
        self.f_lock = f_lock
        self.cap_w = cap_w
        self.freq_mhz = f_lock
        self.pos = 0.0  # position within the current unit, as a fraction of it
        self._window: deque[tuple[float, float]] = deque()
        self._win_t = 0.0
        self._win_e = 0.0

    def run(
        self,
        phases: Callable[[float], _Phases],
        duration_s: float,
        sink: Callable[[float, float, float], float],
    ) -> float:
        """Run for ``duration_s``; ``sink(dt, energy, freq)`` per period. Returns work units.

        ``sink`` returns the energy the device actually drew in the period (the work's
        ``energy`` at the reference temperature, or more on a hot die): the controller limits
        that, as a real GPU's power limit covers all of its power.
        """
        p = self.params
        units = 0.0
        done = 0.0
        while done < duration_s - 1e-12:
            dt = min(p.cap_period_s, duration_s - done)
            f = self.freq_mhz
            ph = phases(f)
            e = ph.energy_between(self.pos * ph.time_s, dt)
            units += dt / ph.time_s
            self.pos = (self.pos + dt / ph.time_s) % 1.0
            done += dt
            drawn = sink(dt, e, f)
            self._window.append((dt, drawn))
            self._win_t += dt
            self._win_e += drawn
            while self._win_t - self._window[0][0] >= p.cap_window_s - 1e-12:
                old_t, old_e = self._window.popleft()
                self._win_t -= old_t
                self._win_e -= old_e
            power = self._win_e / self._win_t
            if power > self.cap_w:
                self.freq_mhz = max(p.min_freq_mhz, f - p.freq_step_mhz)
            elif power < self.cap_w - p.cap_margin_w:
                self.freq_mhz = min(self.f_lock, f + p.freq_step_mhz)
        return units


def run_capped(
    work: WorkLike,
    freq_lock_mhz: float,
    power_cap_w: float | None = None,
    duration_s: float = 2.0,
    *,
    params: OverlapDeviceParams = A100,
) -> CappedRun:
    """Repeat ``work`` for ``duration_s`` at lock ``freq_lock_mhz`` under a power cap.

    Power follows the work's phases (a GEMM overlapped with a collective draws more than a norm).
    Every control period the average power over the trailing window is compared with the cap
    (default: the device's TDP): above it the clock drops one step; below ``cap − margin`` it
    rises one step toward the lock (docs/kareus.md §5.1 "Power cap"). The window's lag makes the clock
    oscillate around the clock whose power meets the cap. Work progresses at the instantaneous
    clock's rate (its position within a unit is kept as a fraction of the unit).

    Raises:
        PlanError: On a clock outside the device range or a non-positive duration or cap.
    """
    f_lock = _check_freq(freq_lock_mhz, params)
    cap = params.power_cap_w if power_cap_w is None else float(power_cap_w)
    if not (cap > 0 and duration_s > 0):
        raise PlanError(f"power cap and duration must be positive, got {cap} W, {duration_s} s")
    freqs: list[float] = []
    powers: list[float] = []
    totals = [0.0, 0.0]  # energy, ∫f dt

    def sink(dt: float, e: float, f: float) -> float:
        totals[0] += e
        totals[1] += f * dt
        freqs.append(f)
        powers.append(e / dt)
        return e

    units = _Throttle(params, f_lock, cap).run(_phases_fn(work), float(duration_s), sink)
    return CappedRun(
        time_s=float(duration_s),
        energy_j=totals[0],
        work_units=units,
        avg_freq_mhz=totals[1] / duration_s,
        avg_power_w=totals[0] / duration_s,
        freq_trace_mhz=tuple(freqs),
        power_trace_w=tuple(powers),
        period_s=params.cap_period_s,
    )


def run_locked(
    work: WorkLike,
    freq_mhz: float,
    work_units: float | None = None,
    *,
    duration_s: float | None = None,
    params: OverlapDeviceParams = A100,
) -> LockedRun:
    """Run ``work`` at a constant clock: ``work_units`` of it, or for ``duration_s``.

    The clock may be off the 15 MHz grid (e.g. a capped run's average, to test Theorem 1 exactly);
    round it to :attr:`OverlapDeviceParams.supported_freqs_mhz` yourself for a lockable value.

    Raises:
        PlanError: Unless exactly one of ``work_units`` and ``duration_s`` is positive, or on a
            clock outside the device range.
    """
    f = _check_freq(freq_mhz, params)
    if (work_units is None) == (duration_s is None):
        raise PlanError("run_locked needs exactly one of work_units and duration_s")
    ph = _phases_fn(work)(f)
    t_unit, e_unit = ph.time_s, ph.energy_j
    if work_units is not None:
        if work_units <= 0:
            raise PlanError(f"work_units must be positive, got {work_units}")
        units = float(work_units)
    else:
        assert duration_s is not None
        if duration_s <= 0:
            raise PlanError(f"duration_s must be positive, got {duration_s}")
        units = duration_s / t_unit
    time_s = units * t_unit
    energy = units * e_unit
    return LockedRun(
        time_s=time_s, energy_j=energy, work_units=units, freq_mhz=f, avg_power_w=energy / time_s
    )
