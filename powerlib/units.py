"""Unit conversions, used once, at the backend edge.

Past a backend, every quantity is a float in W, J, s, °C, or MHz (clocks, as vendor APIs count them),
and its name says so (``power_w``, ``energy_j``, ``time_s``, ``freq_mhz``). Functions are named
after the *source* unit so a call site reads like the vendor's documentation:
``from_mw(nvml_power)``, ``to_uw(power_limit_w)``.

This module imports nothing from powerlib or third parties.
"""

from __future__ import annotations

__all__ = [
    "from_khz",
    "from_mj",
    "from_mw",
    "from_uj",
    "from_us",
    "from_uw",
    "to_khz",
    "to_mj",
    "to_mw",
    "to_uj",
    "to_uw",
]


def from_mw(value_mw: float) -> float:
    """Milliwatts (NVML power) to watts."""
    return float(value_mw) / 1e3


def from_uw(value_uw: float) -> float:
    """Microwatts (powercap limits, amdsmi caps, hwmon) to watts."""
    return float(value_uw) / 1e6


def from_mj(value_mj: float) -> float:
    """Millijoules (NVML energy counter) to joules."""
    return float(value_mj) / 1e3


def from_uj(value_uj: float) -> float:
    """Microjoules (powercap ``energy_uj``, amdsmi ticks × resolution) to joules."""
    return float(value_uj) / 1e6


def from_us(value_us: float) -> float:
    """Microseconds (powercap time windows) to seconds."""
    return float(value_us) / 1e6


def from_khz(value_khz: float) -> float:
    """Kilohertz (cpufreq) to megahertz."""
    return float(value_khz) / 1e3


def to_mw(power_w: float) -> int:
    """Watts to integer milliwatts (NVML setters), rounded to nearest."""
    return int(round(power_w * 1e3))


def to_uw(power_w: float) -> int:
    """Watts to integer microwatts (powercap, amdsmi setters), rounded to nearest."""
    return int(round(power_w * 1e6))


def to_mj(energy_j: float) -> int:
    """Joules to integer millijoules, rounded down (a counter never runs ahead of the truth)."""
    return int(energy_j * 1e3)


def to_uj(energy_j: float) -> int:
    """Joules to integer microjoules, rounded down."""
    return int(energy_j * 1e6)


def to_khz(freq_mhz: float) -> int:
    """Megahertz to integer kilohertz (cpufreq setters), rounded to nearest."""
    return int(round(freq_mhz * 1e3))
