"""Reading devices without changing them: what ``powerlib env|devices|status|watch`` report.

:func:`env_report` probes every backend and says which one would be chosen and why;
:func:`state_json` and :func:`status_json` are the per-device records of the ``devices`` and
``status`` schemas; :func:`watch_samples` samples devices at a fixed rate, with the average power
over each interval from the energy counter.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from importlib import metadata
from typing import Any

from powerlib._version import __version__
from powerlib.backend import Backend, ProbeResult
from powerlib.config import Settings
from powerlib.device import Device, PowerState
from powerlib.registry import AUTO_ORDER, backend_names, probe_backends

__all__ = [
    "SCHEMA_VERSION",
    "EnvReport",
    "WatchSample",
    "avg_power_w",
    "env_report",
    "select_devices",
    "state_json",
    "status_json",
    "watch_samples",
]

#: Version of the ``powerlib.<command>.vN`` JSON schemas.
SCHEMA_VERSION = 1

#: Distributions whose versions ``powerlib env`` reports.
_PACKAGES = ("click", "numpy", "psutil", "nvidia-ml-py", "pynvml", "amdsmi", "torch")


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvReport:
    """Which backend would be chosen, and why, probe by probe.

    Attributes:
        settings: The settings the probes ran with.
        probes: One probe per known backend, the auto order first.
        chosen_backend: The backend that would be opened, or ``None`` (nothing available).
        reason: Why that one.
        package_versions: Installed versions of the packages powerlib uses (``None``: absent).
    """

    settings: Settings
    probes: tuple[ProbeResult, ...]
    chosen_backend: str | None
    reason: str
    package_versions: dict[str, str | None]

    def to_json(self) -> dict[str, Any]:
        """``powerlib.env.v1``."""
        settings = self.settings
        return {
            "schema": f"powerlib.env.v{SCHEMA_VERSION}",
            "powerlib_version": __version__,
            "python_version": platform.python_version(),
            "requested_backend": settings.backend,
            "chosen_backend": self.chosen_backend,
            "reason": self.reason,
            "probes": [
                {
                    "backend": p.backend,
                    "is_available": p.is_available,
                    "in_auto_order": p.backend in AUTO_ORDER,
                    "num_devices": p.num_devices,
                    "reason": p.reason,
                }
                for p in self.probes
            ],
            "settings": {
                "sysfs_root": str(settings.sysfs_root),
                "state_dir": str(settings.state_dir),
                "sim_gpus": settings.sim_gpus,
                "sim_model": settings.sim_model,
                "sim_clock": settings.sim_clock,
            },
            "euid": os.geteuid(),
            "package_versions": dict(self.package_versions),
        }


def env_report(settings: Settings) -> EnvReport:
    """Probe every backend (the auto order first, then plug-ins) and explain the choice."""
    names = list(dict.fromkeys([*AUTO_ORDER, *backend_names()]))
    probes = tuple(probe_backends(settings, names))
    if settings.backend == "auto":
        chosen = next(
            (p.backend for p in probes if p.is_available and p.backend in AUTO_ORDER), None
        )
        why = (
            "first available in the auto order " + " -> ".join(AUTO_ORDER)
            if chosen
            else (
                "nothing in the auto order is available; set POWERLIB_BACKEND=simulated for simulated GPUs"
            )
        )
    else:
        chosen = settings.backend
        why = "named explicitly (--backend or POWERLIB_BACKEND)"
    versions: dict[str, str | None] = {}
    for dist in _PACKAGES:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return EnvReport(
        settings=settings,
        probes=probes,
        chosen_backend=chosen,
        reason=why,
        package_versions=versions,
    )


def select_devices(backend: Backend, selector: str | None) -> list[Device]:
    """Every device of ``backend`` (``selector`` ``None``), or the one ``selector`` names."""
    return list(backend.devices()) if selector is None else [backend.device(selector)]


def state_json(dev: Device, state: PowerState) -> dict[str, object]:
    """A device's identity and power state (a row of ``powerlib.devices.v1``)."""
    info = dev.info
    return {
        "index": info.index,
        "device_id": info.device_id,
        "name": info.name,
        "vendor": info.vendor,
        "kind": info.kind.value,
        "backend": info.backend,
        "is_simulated": info.is_simulated,
        "timestamp_s": state.timestamp_s,
        "power_w": state.power_w,
        "energy_j": state.energy_j,
        "memory_energy_j": state.memory_energy_j,
        "sm_freq_mhz": state.sm_freq_mhz,
        "locked_sm_freqs_mhz": None
        if state.locked_sm_freqs_mhz is None
        else list(state.locked_sm_freqs_mhz),
        "power_limit_w": state.power_limit_w,
        "temperature_c": state.temperature_c,
    }


def status_json(
    dev: Device, state: PowerState, details: Mapping[str, object] | None = None
) -> dict[str, object]:
    """:func:`state_json` plus clocks, limits, capabilities, details (``powerlib.status.v1``).

    ``details``: ``dev.details()`` where the caller read it already (each read asks the driver).
    """
    info = dev.info
    data = state_json(dev, state)
    data.update(
        {
            "supported_sm_freqs_mhz": list(info.supported_sm_freqs_mhz),
            "min_sm_freq_mhz": info.min_sm_freq_mhz,
            "max_sm_freq_mhz": info.max_sm_freq_mhz,
            "power_limit_range_w": None
            if info.power_limit_range_w is None
            else list(info.power_limit_range_w),
            "default_power_limit_w": info.default_power_limit_w,
            "capabilities": {
                f.name: getattr(info.capabilities, f.name) for f in fields(info.capabilities)
            },
            "details": dict(dev.details() if details is None else details),
        }
    )
    return data


@dataclass(frozen=True, slots=True)
class WatchSample:
    """One device read during :func:`watch_samples`.

    Attributes:
        sample: The tick number, from 0.
        device: The device read.
        state: What it read.
        avg_power_w: Energy-counter delta over the time since the previous tick (``None`` on
            the first tick or without an energy counter).
    """

    sample: int
    device: Device
    state: PowerState
    avg_power_w: float | None

    def to_json(self) -> dict[str, object]:
        """One ``powerlib watch --json`` line."""
        row = state_json(self.device, self.state)
        row["sample"] = self.sample
        row["avg_power_w"] = self.avg_power_w
        return row


def watch_samples(
    devices: Sequence[Device], interval_s: float, count: int | None = None
) -> Iterator[WatchSample]:
    """Read every device each ``interval_s`` (a fixed rate, not a fixed sleep).

    Args:
        devices: The devices to read, in order, at every tick.
        interval_s: Seconds between ticks.
        count: Stop after this many ticks (``None``: never).
    """
    last: dict[str, PowerState] = {}
    for n in _ticks(interval_s, count):
        for dev in devices:
            st = dev.read_state()
            avg_w = avg_power_w(last.get(dev.device_id), st)
            last[dev.device_id] = st
            yield WatchSample(n, dev, st, avg_w)


def _ticks(interval_s: float, count: int | None) -> Iterator[int]:
    start = time.monotonic()
    n = 0
    while count is None or n < count:
        yield n
        n += 1
        if count is not None and n >= count:
            return
        delay = start + n * interval_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def avg_power_w(prev: PowerState | None, cur: PowerState) -> float | None:
    """Average power between two readings from the energy counter, or ``None``."""
    if prev is None or prev.energy_j is None or cur.energy_j is None:
        return None
    dt = cur.timestamp_s - prev.timestamp_s
    return (cur.energy_j - prev.energy_j) / dt if dt > 0 else None
