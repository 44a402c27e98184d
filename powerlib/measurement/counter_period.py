"""The energy counter's update period, and the cost of one read.

A counter publishes a new value only every so often (NVML and the simulator: about every
100 ms); how often its value changed between reads tells how often it updates
(:func:`estimate_counter_period_s`, docs/measurement.md). Kareus's energy meter estimates it
from its own reads (:class:`~powerlib.kareus.energy_counter.EnergyMeter`); ``powerlib check``
reads a device back to back for a while and times every ``read_state`` (:func:`measure_counter`): the median
and 99th percentile of a read's cost, and the period, "at least" when the counter never moved,
"at most" when every read saw a new value (docs/real-gpu.md §8). The readiness check that
reports both is :mod:`powerlib.node_check.check`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from powerlib.device import Device

__all__ = [
    "MAX_COUNTER_READS",
    "MIN_INTERVALS",
    "CounterCheck",
    "estimate_counter_period_s",
    "measure_counter",
]

MAX_COUNTER_READS = 200_000
"""Reads after which the counter measurement stops early: a read that costs next to nothing (a
fake) would otherwise make millions, and the period estimate costs time per interval (about
0.7 s for this many). Real drivers never get there: an NVML read costs milliseconds."""

MIN_INTERVALS = 8
"""Read intervals below which the counter's period is not estimated."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CounterCheck:
    """The energy counter and the read cost, measured by reading the device back to back.

    Attributes:
        has_counter: The device has a hardware energy counter (else energy is integrated from
            power readings, and ``period_s`` is ``None``).
        reads: ``read_state`` calls made.
        duration_s: How long they took in all.
        read_cost_median_s: Median time of one ``read_state``.
        read_cost_p99_s: Its 99th percentile.
        changes: Read-to-read intervals in which the counter moved.
        period_s: The counter's update period (:func:`estimate_counter_period_s`),
            or ``None`` (no counter, or too few reads).
        period_bound: ``"estimate"``; ``"at_most"`` (every read saw a new value); ``"at_least"``
            (the counter never moved: ``period_s`` is the whole duration); ``None`` with no period.
    """

    has_counter: bool
    reads: int
    duration_s: float
    read_cost_median_s: float
    read_cost_p99_s: float
    changes: int
    period_s: float | None
    period_bound: str | None

    def to_json(self) -> dict[str, object]:
        """JSON-ready fields."""
        return {
            "has_counter": self.has_counter,
            "reads": self.reads,
            "duration_s": self.duration_s,
            "read_cost_median_s": self.read_cost_median_s,
            "read_cost_p99_s": self.read_cost_p99_s,
            "changes": self.changes,
            "period_s": self.period_s,
            "period_bound": self.period_bound,
        }


def estimate_counter_period_s(
    intervals_s: Sequence[float], changes: int
) -> tuple[float, bool] | None:
    """The update period of a counter from how often it moved between reads.

    A counter that updates every ``P`` seconds, read twice ``L`` apart at a random phase, moves
    with probability ``min(1, L / P)``; the estimate is the ``P`` at which the expected number
    of moves equals ``changes``.

    Args:
        intervals_s: Times between consecutive reads (positive).
        changes: How many of them saw the value change.

    Returns:
        ``(period_s, at_most)``: when every interval saw a change the period is only known to
        be at most the shortest interval (``at_most``); when none did, at least their sum (then
        ``period_s`` is that sum). ``None`` for fewer than :data:`MIN_INTERVALS` intervals.
    """
    lengths = [length for length in intervals_s if length > 0]
    if len(lengths) < MIN_INTERVALS:
        return None
    total_s = math.fsum(lengths)
    if changes <= 0:
        return total_s, False
    if changes >= len(lengths):
        return min(lengths), True

    def expected(period_s: float) -> float:
        return math.fsum(min(1.0, length / period_s) for length in lengths)

    lo, hi = min(lengths), total_s  # expected(lo) = all intervals, expected(hi) <= 1 <= changes
    for _ in range(100):  # bisection in log space: the period spans decades
        mid = math.sqrt(lo * hi)
        if expected(mid) > changes:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1.0 + 1e-6:
            break
    return math.sqrt(lo * hi), False


def _percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile of sorted values (nearest rank)."""
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def measure_counter(
    dev: Device,
    duration_s: float,
    *,
    clock: Callable[[], float] = time.perf_counter,
    max_reads: int = MAX_COUNTER_READS,
) -> CounterCheck:
    """Read ``dev`` back to back for ``duration_s``: the read cost and the counter's period.

    Every ``read_state`` is timed; the counter's period comes from how often its value changed
    between reads (:func:`estimate_counter_period_s`, each interval
    taken between the middles of two reads). At least ``MIN_INTERVALS + 1`` reads are made,
    at most ``max_reads``.

    Raises:
        PowerlibError: A read failed (a lost device: ``DeviceLostError``).
    """
    costs_s: list[float] = []
    middles_s: list[float] = []
    values: list[float | None] = []
    start = clock()
    deadline = start + duration_s
    while True:
        t0 = clock()
        state = dev.read_state()
        t1 = clock()
        costs_s.append(t1 - t0)
        middles_s.append((t0 + t1) / 2)
        values.append(state.energy_j)
        if len(costs_s) >= max_reads or (t1 >= deadline and len(costs_s) > MIN_INTERVALS):
            break
    elapsed_s = clock() - start
    has_counter = dev.info.capabilities.has_energy_counter and values[-1] is not None
    changes = sum(1 for a, b in zip(values, values[1:]) if a != b)
    period_s: float | None = None
    bound: str | None = None
    if has_counter:
        intervals = [b - a for a, b in zip(middles_s, middles_s[1:])]
        estimate = estimate_counter_period_s(intervals, changes)
        if estimate is not None:
            period_s = estimate[0]
            bound = "at_most" if estimate[1] else ("at_least" if changes == 0 else "estimate")
    ordered = sorted(costs_s)
    return CounterCheck(
        has_counter=has_counter,
        reads=len(costs_s),
        duration_s=elapsed_s,
        read_cost_median_s=statistics.median(ordered),
        read_cost_p99_s=_percentile(ordered, 0.99),
        changes=changes if has_counter else 0,
        period_s=period_s,
        period_bound=bound,
    )
