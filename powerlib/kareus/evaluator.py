"""What the per-partition search measures with: the evaluator contract and its protocol.

An evaluator runs one partition type under one configuration and reports the time and energy of a
single execution, per GPU. Real GPUs need a *thermally stable* protocol (docs/kareus.md §2.1
"Measurement"): lock the clock, warm up, run the partition repeatedly over a measurement window
(NVML's energy counter updates only every ~100 ms, and short windows read low because the chip has
not warmed up), then cool down before the next candidate, because mean energy follows the
temperature at the start. :class:`MeasureProtocol` holds those durations; an evaluator reports
the (virtual or real) wall time it spent, so budgets can be stated in GPU-hours.

Implementations: the simulated partition evaluator (:mod:`powerlib.kareus.sim_model`) and the
device evaluator that drives real clocks through the device contract
(:mod:`powerlib.kareus.meter`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from powerlib.errors import PlanError
from powerlib.kareus.partition_types import Config, Op, PartitionType, Segment

__all__ = ["Evaluator", "Measurement", "MeasureProtocol"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasureProtocol:
    """The thermally stable measurement protocol (docs/kareus.md §2.1, §5.3).

    Attributes:
        settle_s: Wait after locking the clock (NVML applies it asynchronously).
        warmup_s: Run the partition without measuring.
        window_s: Measurement window; time and energy are averaged over the executions in it.
            The energy is attributed between two energy-counter updates time-stamped around
            it, so a window of a few counter periods is unbiased; its error bound (reported
            as :attr:`Measurement.energy_rel_error`) falls as the window grows.
        cooldown_s: Idle time after the window, before the next candidate.
    """

    settle_s: float = 2.0
    warmup_s: float = 1.0
    window_s: float = 5.0
    cooldown_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("settle_s", "warmup_s", "window_s", "cooldown_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise PlanError(f"{name} must be a non-negative number of seconds, got {value!r}")
        if self.window_s <= 0:
            raise PlanError("window_s must be positive")

    @property
    def per_candidate_s(self) -> float:
        """Wall time one candidate costs, excluding the partition's own runs (≈ 13 s default)."""
        return self.settle_s + self.warmup_s + self.window_s + self.cooldown_s


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    """One partition execution, per GPU, averaged over a measurement window.

    Attributes:
        time_s: Time of one execution (the slowest rank of the group).
        energy_j: Total energy of one execution (mean over the group's GPUs).
        p_static_w: The static power the evaluator subtracts for dynamic energy.
        wall_s: Wall (or virtual) time the measurement cost, protocol included.
        avg_freq_mhz: Average SM clock during the window (below the lock if it throttled).
        start_temp_c: Temperature when the window began, when known.
        energy_rel_error: Bound on the relative error of ``energy_j`` from reading the energy
            counter (its update times, docs/kareus.md §2.1 "How powerlib measures energy"), as
            a fraction (``inf``: the window was too short to bound it); ``None`` where the
            evaluator does not state one (a model).
    """

    time_s: float
    energy_j: float
    p_static_w: float
    wall_s: float = 0.0
    avg_freq_mhz: float | None = None
    start_temp_c: float | None = None
    energy_rel_error: float | None = None

    @property
    def dynamic_energy_j(self) -> float:
        """``energy_j − P_static · time_s``: what the schedule trades (docs/kareus.md §0 item 10)."""
        return self.energy_j - self.p_static_w * self.time_s

    @property
    def energy_interval_j(self) -> tuple[float, float] | None:
        """``energy_j`` ± its error bound, in joules (``None`` where no bound is stated)."""
        if self.energy_rel_error is None:
            return None
        half_j = self.energy_j * self.energy_rel_error
        return self.energy_j - half_j, self.energy_j + half_j

    def to_json(self) -> dict[str, float | None]:
        """Every field by name; ``energy_rel_error`` is ``None`` where no finite bound is known."""
        rel = self.energy_rel_error
        return {
            "time_s": self.time_s,
            "energy_j": self.energy_j,
            "energy_rel_error": rel if rel is not None and math.isfinite(rel) else None,
            "p_static_w": self.p_static_w,
            "wall_s": self.wall_s,
            "avg_freq_mhz": self.avg_freq_mhz,
            "start_temp_c": self.start_temp_c,
        }


@runtime_checkable
class Evaluator(Protocol):
    """Measures partitions (the search) and whole segments (sequential execution, composition)."""

    @property
    def p_static_w(self) -> float:
        """Power of a GPU that holds a context and waits (blocked on P2P), in watts."""
        ...

    @property
    def freqs_mhz(self) -> tuple[float, ...]:
        """Clocks the evaluator can lock, ascending."""
        ...

    def evaluate(self, ptype: PartitionType, config: Config) -> Measurement:
        """One execution of ``ptype`` under ``config`` (thermally stable protocol)."""
        ...

    def evaluate_sequential(
        self, segments: tuple[Segment, ...], freq_mhz: float, sm_count: int
    ) -> Measurement:
        """One execution of ``segments`` without overlap.

        Each segment's compute runs on all SMs, then its collective with ``sm_count`` CTAs.
        """
        ...

    def evaluate_compute(self, ops: tuple[Op, ...], freq_mhz: float) -> Measurement:
        """One execution of compute ``ops`` alone, on all SMs (embedding, output layer, loss)."""
        ...
