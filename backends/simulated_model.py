"""The time and power model of the simulated GPUs, and the work they run.

Parameters per GPU are in :data:`powerlib.gpu_specs.GPU_SPECS` (each number cited there);
:class:`GpuModel` adds the equations :mod:`powerlib.backends.simulated` runs them with:

* **Clocks.** Supported SM clocks from ``min_freq_mhz`` to ``max_freq_mhz`` in ``freq_step_mhz``
  steps, as NVML lists them.
* **Voltage.** Piecewise linear: flat at ``v_min_ratio`` of the maximum up to the knee clock, then
  linear to 1 at the maximum clock. Below the knee, lowering the clock stops saving dynamic energy.
* **Power.** ``P = P_idle + (P_clock + u · P_dyn) · φ(f) + m · P_mem · r`` with
  ``φ(f) = (f / f_max) · (V(f) / V_max)²``: idle (board, leakage), the clock tree that runs whenever
  the clock does, SM switching at SM activity ``u``, and memory traffic at HBM activity ``m``
  scaled by ``r``, the traffic rate relative to full clock (the same bytes move in a longer time).
* **Time.** A unit of work with compute-bound fraction ``α`` takes
  ``t(f) = t_max · (α · f_max / f + (1 − α))``: only the compute-bound part scales with the clock.
* **Power cap.** Under load, the clock runs at the highest supported value at or below the target
  (the locked maximum, else ``f_max``) whose power fits under the power limit (steady-state view
  of the driver's throttling loop).

A :class:`WorkUnit` is what a :class:`~powerlib.backends.simulated.SimulatedDevice` runs; a
:class:`WorkResult` is what running one cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from powerlib.gpu_specs import GPU_SPECS, GpuSpec, VoltageCurve

__all__ = ["GPU_MODELS", "GpuModel", "WorkResult", "WorkUnit"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuModel(GpuSpec, VoltageCurve):
    """One simulated GPU: its spec with the time and power model the simulated backend runs.

    The parameters are the :class:`~powerlib.gpu_specs.GpuSpec` both simulators read. Powers are in W at the maximum clock unless noted.
    """

    @classmethod
    def from_spec(cls, spec: GpuSpec) -> GpuModel:
        """The simulated GPU of one :class:`~powerlib.gpu_specs.GpuSpec`."""
        return cls(**{f.name: getattr(spec, f.name) for f in fields(spec)})

    @property
    def name(self) -> str:
        """The device name the backend reports."""
        return f"Simulated NVIDIA {self.product}"

    @property
    def dynamic_power_w(self) -> float:
        """Extra power with every SM busy at ``max_freq_mhz``: ``num_sms × sm_power_w``."""
        return self.num_sms * self.sm_power_w

    def duration_s(self, work: WorkUnit, freq_mhz: float) -> float:
        """How long ``work`` takes at ``freq_mhz``."""
        a = work.compute_fraction
        return work.time_at_max_s * (a * self.max_freq_mhz / freq_mhz + (1.0 - a))

    def power_w(self, freq_mhz: float, work: WorkUnit | None = None) -> float:
        """Power at ``freq_mhz`` while running ``work`` (idle at that clock when ``None``)."""
        p = self.idle_power_w + self.clock_power_w * self.phi(freq_mhz)
        if work is None:
            return p
        p += work.sm_activity * self.dynamic_power_w * self.phi(freq_mhz)
        if work.time_at_max_s > 0:
            rate = work.time_at_max_s / self.duration_s(work, freq_mhz)
            p += work.memory_activity * self.memory_power_w * rate
        return p

    def throttled_freq_mhz(
        self, target_mhz: float, power_limit_w: float, work: WorkUnit | None
    ) -> float:
        """Highest supported clock ≤ ``target_mhz`` whose power fits under ``power_limit_w``."""
        freqs = [f for f in self.supported_freqs_mhz if f <= target_mhz + 1e-9]
        for freq in reversed(freqs):
            if self.power_w(freq, work) <= power_limit_w + 1e-9:
                return freq
        return self.supported_freqs_mhz[0]


GPU_MODELS: dict[str, GpuModel] = {key: GpuModel.from_spec(spec) for key, spec in GPU_SPECS.items()}
"""The simulated GPUs by ``POWERLIB_SIM_MODEL`` key, built from :data:`powerlib.gpu_specs.GPU_SPECS`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkUnit:
    """A unit of simulated work (one pipeline instruction, one kernel...).

    Attributes:
        time_at_max_s: Duration at the maximum SM clock with no throttling.
        compute_fraction: Share of that time that scales with the SM clock (α in [0, 1]).
        sm_activity: Average SM activity while running (u in [0, 1]).
        memory_activity: Average memory-traffic activity at full clock (m in [0, 1]).
    """

    time_at_max_s: float
    compute_fraction: float = 1.0
    sm_activity: float = 1.0
    memory_activity: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.time_at_max_s) and self.time_at_max_s >= 0):
            raise ValueError(f"time_at_max_s must be finite and >= 0, got {self.time_at_max_s}")
        for name in ("compute_fraction", "sm_activity", "memory_activity"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkResult:
    """What running a :class:`WorkUnit` cost.

    Attributes:
        time_s: Duration.
        energy_j: Exact energy used (the counter shows it quantized).
        freq_mhz: SM clock it ran at (after power-cap throttling); the time-weighted mean
            when a clock change landed while it ran.
        power_w: Average power.
    """

    time_s: float
    energy_j: float
    freq_mhz: float
    power_w: float
