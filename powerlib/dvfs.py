"""The clock and voltage curve both simulated GPUs share (the backend and the overlap evaluator).

A mixin for frozen, slotted parameter dataclasses that define ``min_freq_mhz``,
``max_freq_mhz``, ``freq_step_mhz``, ``knee_freq_mhz`` and ``v_min_ratio``: supported clocks on a
fixed grid, and a piecewise-linear voltage flat at its floor up to the knee clock, then linear to
the maximum. Below the knee lowering the clock stops saving dynamic energy (docs/kareus.md §5.1).
"""

from __future__ import annotations

__all__ = ["VoltageCurve"]


class VoltageCurve:
    """Supported clocks and ``φ(f) = (f / f_max)·(V(f) / V_max)²``."""

    __slots__ = ()
    min_freq_mhz: float
    max_freq_mhz: float
    freq_step_mhz: float
    knee_freq_mhz: float
    v_min_ratio: float

    @property
    def supported_freqs_mhz(self) -> tuple[float, ...]:
        """Supported SM clocks, ascending."""
        count = int(round((self.max_freq_mhz - self.min_freq_mhz) / self.freq_step_mhz)) + 1
        return tuple(float(self.min_freq_mhz + i * self.freq_step_mhz) for i in range(count))

    def voltage_ratio(self, freq_mhz: float) -> float:
        """``V(f) / V_max``: flat at the floor up to the knee, then linear to 1."""
        if freq_mhz <= self.knee_freq_mhz:
            return self.v_min_ratio
        span = self.max_freq_mhz - self.knee_freq_mhz
        return self.v_min_ratio + (1.0 - self.v_min_ratio) * (freq_mhz - self.knee_freq_mhz) / span

    def phi(self, freq_mhz: float) -> float:
        """Dynamic-power factor ``(f / f_max) · (V(f) / V_max)²``; 1 at the maximum clock."""
        return (freq_mhz / self.max_freq_mhz) * self.voltage_ratio(freq_mhz) ** 2
