"""The simulated GPU models: one table of parameters and the clock/voltage curve they share.

The simulated backend (:mod:`powerlib.backends.simulated`) and the Kareus partition model both
simulate these GPUs; they take the clocks, voltage curve, power terms, power-limit range and
thermal constants from :data:`GPU_SPECS`, so the two agree by construction.
:class:`VoltageCurve` is the mixin for their frozen, slotted parameter dataclasses: supported
clocks on a fixed grid, and a piecewise-linear voltage flat at its floor up to the knee clock,
then linear to the maximum. Below the knee lowering the clock stops saving dynamic energy
(docs/kareus.md §5.1). Standard library only: a leaf module that any layer may import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["GPU_SPECS", "POWER_SAMPLING_DUTY", "GpuSpec", "VoltageCurve", "power_sampling_duty"]


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


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSpec:
    """Parameters of one GPU model. Powers in W at the maximum clock unless noted.

    Attributes:
        key: Short name (``POWERLIB_SIM_MODEL`` value).
        product: Product name without the vendor (``A100-SXM4-40GB``).
        num_sms: Streaming multiprocessors.
        min_freq_mhz: Lowest supported SM clock.
        max_freq_mhz: Highest supported SM clock.
        freq_step_mhz: Spacing of supported SM clocks.
        knee_freq_mhz: Clock below which the voltage stays at its floor.
        v_min_ratio: Voltage floor as a fraction of the voltage at ``max_freq_mhz``.
        idle_power_w: Power with the clock stopped and no work (board, leakage).
        clock_power_w: Clock-tree power at ``max_freq_mhz``, drawn whenever the clock runs.
        sm_power_w: Switching power of one fully busy SM at ``max_freq_mhz`` (the published
            per-SM estimate; the simulated backend's full-load dynamic power is
            ``num_sms × sm_power_w``).
        memory_power_w: Extra power with memory traffic at full rate (the simulated backend's
            whole-kernel memory term).
        default_power_limit_w: Default (TDP) power limit.
        min_power_limit_w: Lowest settable power limit.
        max_power_limit_w: Highest settable power limit.
        mem_freq_mhz: Memory clock (fixed).
        ambient_c: Inlet temperature.
        thermal_resistance_c_per_w: Steady-state temperature rise per watt.
        thermal_capacitance_j_per_c: Heat capacity; τ = R·C.
        energy_update_period_s: How often the energy counter publishes a new value.
        switch_latency_s: Mean delay from a clock request to the clock actually running
            (unmeasured on NVIDIA parts; public figures suggest tens of ms).
        latency_spread: Each clock change lands after
            ``switch_latency_s * U(1 - latency_spread, 1 + latency_spread)``.
    """

    key: str
    product: str
    num_sms: int
    min_freq_mhz: float
    max_freq_mhz: float
    freq_step_mhz: float
    knee_freq_mhz: float
    v_min_ratio: float
    idle_power_w: float
    clock_power_w: float
    sm_power_w: float
    memory_power_w: float
    default_power_limit_w: float
    min_power_limit_w: float
    max_power_limit_w: float
    mem_freq_mhz: float
    ambient_c: float
    thermal_resistance_c_per_w: float
    thermal_capacitance_j_per_c: float
    energy_update_period_s: float = 0.1
    switch_latency_s: float = 0.02  # [assumption] docs/peers.md §4.3: settle 5-50 ms by target
    latency_spread: float = 0.5  # [assumption] as the emulator's NvmlLikeModel

    @property
    def blocked_power_w(self) -> float:
        """Power with the clock at its maximum and no SM busy (a GPU blocked on P2P traffic)."""
        return self.idle_power_w + self.clock_power_w


# Sources: docs/kareus.md §5.4 ("Parameter sets"), docs/peers.md §4.1 ("Device table"),
# docs/perseus.md §1.3–1.4. Numbers marked [assumption] are not published; they are chosen to reproduce
# the documented phenomena and should be re-calibrated on hardware.
GPU_SPECS: dict[str, GpuSpec] = {
    "a100": GpuSpec(
        key="a100",
        product="A100-SXM4-40GB",
        num_sms=108,  # docs/kareus.md §5.4 (TechPowerUp)
        min_freq_mhz=210.0,  # docs/peers.md §4.1: supported list 1410 -> 210, 15 MHz steps, 81 points
        max_freq_mhz=1410.0,
        freq_step_mhz=15.0,
        knee_freq_mhz=900.0,  # docs/kareus.md §5.4: energy stops falling below ~900 MHz (Perseus App. B)
        v_min_ratio=0.70,  # [assumption]
        idle_power_w=55.0,  # docs/peers.md §4.1: idle 52-68 W at 210 MHz (model: 57 W at 210 MHz)
        clock_power_w=30.0,  # with idle: 85 W blocked on P2P at 1410 MHz (Kareus GPU_CONFIGS; Perseus 83.64 W)
        sm_power_w=2.4,  # docs/kareus.md §5.4: c_sm ≈ 2.4 W per busy SM at f_max
        memory_power_w=60.0,  # [assumption] full compute + HBM load (405 W) exceeds the 400 W cap (docs/kareus.md §5.3 item 6)
        default_power_limit_w=400.0,  # docs/peers.md §4.1: TDP 400 W, PL range 100-400 W
        min_power_limit_w=100.0,
        max_power_limit_w=400.0,
        mem_freq_mhz=1215.0,  # docs/peers.md §4.1: 40 GB part, single memory clock
        ambient_c=25.0,  # [assumption]
        thermal_resistance_c_per_w=0.10,  # docs/kareus.md §5.1: full load settles at 60-70 °C (400 W -> 65 °C)
        thermal_capacitance_j_per_c=15.0,  # docs/kareus.md §5.1: 5 s of idle cools below ~32 °C (τ = 1.5 s)
        energy_update_period_s=0.1,  # docs/kareus.md §5.4 / docs/peers.md §4.2: NVML counter updates every ~100 ms
    ),
    "h100": GpuSpec(
        key="h100",
        product="H100-SXM5-80GB",
        num_sms=132,  # docs/kareus.md §5.4 (Lockwood)
        min_freq_mhz=210.0,  # [assumption] docs/peers.md §4.1 says VERIFY-ON-DEVICE; 15 MHz steps as on Ampere
        max_freq_mhz=1980.0,  # docs/peers.md §4.1: max SM clock 1980 MHz
        freq_step_mhz=15.0,
        knee_freq_mhz=1050.0,  # docs/kareus.md §5.4: "[D] about 1000-1100 MHz, calibrate"
        v_min_ratio=0.70,  # [assumption]
        idle_power_w=72.0,  # docs/peers.md §4.1: idle typically 72-75 W
        clock_power_w=43.0,  # with idle: 115 W blocked (docs/kareus.md §5.4: start at 100-130 W)
        sm_power_w=3.6,  # docs/kareus.md §5.4: c_sm ≈ 3.6 W per busy SM at f_max
        memory_power_w=90.0,  # [assumption]
        default_power_limit_w=700.0,  # docs/peers.md §4.1: TDP 700 W, PL range 200-700 W
        min_power_limit_w=200.0,
        max_power_limit_w=700.0,
        mem_freq_mhz=2619.0,  # docs/peers.md §4.1: HBM3 2619 MHz
        ambient_c=25.0,  # [assumption]
        thermal_resistance_c_per_w=0.06,  # [assumption] 700 W -> 67 °C, as docs/kareus.md §5.1 asks of A100
        thermal_capacitance_j_per_c=25.0,  # [assumption] τ = 1.5 s
        energy_update_period_s=0.1,  # docs/peers.md §4.2
    ),
    "a40": GpuSpec(
        key="a40",
        product="A40",
        num_sms=84,  # docs/kareus.md §5.4 (10,752 shaders / 128)
        min_freq_mhz=210.0,  # docs/perseus.md §1.3: the A40 supports 103 clocks; 1740 - 102 × 15 = 210
        max_freq_mhz=1740.0,  # docs/kareus.md §5.4: max 1740 MHz
        freq_step_mhz=15.0,
        knee_freq_mhz=900.0,  # [assumption] docs/perseus.md §1.3: raw-energy minimum at 945-1050 MHz
        v_min_ratio=0.70,  # [assumption]
        idle_power_w=30.0,  # [assumption] GDDR6 board idle
        clock_power_w=40.0,  # with idle: 70 W blocked on P2P (Kareus GPU_CONFIGS; Perseus 70.38 W)
        sm_power_w=2.4,  # [assumption] same per-SM power as A100
        memory_power_w=40.0,  # [assumption] full load (310 W) slightly exceeds the 300 W TDP
        default_power_limit_w=300.0,  # docs/kareus.md §5.4: TDP 300 W
        min_power_limit_w=100.0,  # [assumption]
        max_power_limit_w=300.0,
        mem_freq_mhz=7251.0,  # [assumption] GDDR6 at 14.5 Gbps
        ambient_c=25.0,  # [assumption]
        thermal_resistance_c_per_w=0.13,  # [assumption] 300 W -> 64 °C
        thermal_capacitance_j_per_c=12.0,  # [assumption]
        energy_update_period_s=0.1,  # docs/peers.md §4.2
    ),
}


POWER_SAMPLING_DUTY: dict[str, float] = {
    # docs/peers.md §4.2: on A100 and H100 the power sensor observes only 25 % of the time, a
    # 25 ms window in every 100 ms (Yang et al., "Part-time Power Measurements: nvidia-smi's
    # Lack of Attention", SC'24, arXiv 2312.02741). That the window ends at the counter's
    # update is [assumption] (the emulator's model); verify on the device.
    "A100": 0.25,
    "H100": 0.25,
}
"""Real parts whose power sensor samples part of each counter period, by product family."""


def power_sampling_duty(product_name: str) -> float:
    """The share of each counter period a real GPU samples power in, from its product name.

    The NVIDIA backend declares it in :attr:`~powerlib.device.DeviceInfo.power_sampling_duty`
    (the profile's attribution counts only each update's sampled window). A family is matched
    as a whole word (``"NVIDIA A100-SXM4-40GB"``, ``"NVIDIA H100 80GB HBM3"``); a part no
    reference covers gets 1, the whole period (the counter integrates all of it).

    Args:
        product_name: The device's name, as NVML reports it.
    """
    for family, duty in POWER_SAMPLING_DUTY.items():
        if re.search(rf"(?<![A-Za-z0-9]){family}(?![0-9])", product_name, flags=re.IGNORECASE):
            return duty
    return 1.0
