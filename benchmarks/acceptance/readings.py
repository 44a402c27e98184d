"""The device reads several parts share: the clock lock, a landing, a window of counter updates."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from powerlib import Device, PowerlibError
from powerlib.device import ClockLockState

from .harness import Rig, rounded


def read_lock(dev: Device) -> ClockLockState:
    """The driver's view of the clock lock, with the running clock filled from read_state."""
    state = dev.read_sm_lock()
    if state.running_mhz is None:
        state = dataclasses.replace(state, running_mhz=dev.read_state().sm_freq_mhz)
    return state


def sample_lock(dev: Device, seconds: float, spacing_s: float = 0.01) -> list[dict[str, Any]]:
    """Lock state, power and temperature read every ``spacing_s`` for ``seconds`` (5 reads at least)."""
    out: list[dict[str, Any]] = []
    end = time.perf_counter() + seconds
    while len(out) < 5 or time.perf_counter() < end:
        lock = read_lock(dev)
        st = dev.read_state()
        out.append({"lock": lock, "power_w": st.power_w, "temperature_c": st.temperature_c})
        time.sleep(spacing_s)
    return out


def summarize_samples(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Median clock, power, temperature; every reason seen; whether a lock was reported."""
    running = [s["lock"].running_mhz for s in samples if s["lock"].running_mhz is not None]
    powers = [s["power_w"] for s in samples if s["power_w"] is not None]
    temps = [s["temperature_c"] for s in samples if s["temperature_c"] is not None]
    return {
        "reads": len(samples),
        "running_mhz": rounded(statistics.median(running)) if running else None,
        "running_min_mhz": min(running) if running else None,
        "running_max_mhz": max(running) if running else None,
        "power_w": rounded(statistics.median(powers), 2) if powers else None,
        "temperature_c": rounded(statistics.median(temps), 1) if temps else None,
        "reasons": sorted({r for s in samples for r in s["lock"].reasons}),
        "limited": sorted({r for s in samples for r in s["lock"].limited}),
        "locked": sorted({str(s["lock"].locked) for s in samples}),
    }


def wait_landed(
    dev: Device, freq_mhz: float, tolerance_mhz: float, timeout_s: float
) -> float | None:
    """Poll until the running clock is within ``tolerance_mhz`` of ``freq_mhz``; when, or None."""
    end = time.perf_counter() + timeout_s
    while True:
        running = read_lock(dev).running_mhz
        now = time.perf_counter()
        if running is not None and abs(running - freq_mhz) <= tolerance_mhz:
            return now
        if now > end:
            return None


def next_update(dev: Device, timeout_s: float) -> tuple[float, float, list[float]]:
    """Poll the energy counter until it moves: (when, its value, the powers read meanwhile)."""
    first = dev.read_state().energy_j
    if first is None:
        raise PowerlibError(f"{dev.info.name} has no energy counter")
    powers: list[float] = []
    end = time.perf_counter() + timeout_s
    while True:
        st = dev.read_state()
        now = time.perf_counter()
        if st.power_w is not None:
            powers.append(st.power_w)
        if st.energy_j != first:
            assert st.energy_j is not None
            return now, st.energy_j, powers
        if now > end:
            raise PowerlibError(f"the energy counter did not move for {timeout_s:g} s")


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """Energy and time of one piece of work, from counter updates on both sides."""

    energy_j: float
    time_s: float
    tail_s: float
    value: Any

    @property
    def power_w(self) -> float:
        """Mean power over the work."""
        return self.energy_j / self.time_s if self.time_s > 0 else math.nan


def counter_window(rig: Rig, body: Callable[[], Any]) -> Window:
    """Run ``body`` between two counter updates; its energy with the idle tail taken off.

    The window opens at a counter update (the work starts right after it) and closes at the
    first update after the work ends; the tail between the two is charged at the power read
    while waiting for that update.
    """
    timeout_s = max(1.0, 5 * (rig.counter_period_s or 0.1))
    t0, e0, _ = next_update(rig.dev, timeout_s)
    value = body()
    rig.work.sync()
    t_end = time.perf_counter()
    t1, e1, powers = next_update(rig.dev, timeout_s)
    tail_w = statistics.fmean(powers) if powers else 0.0
    return Window(e1 - e0 - tail_w * (t1 - t_end), t_end - t0, t1 - t_end, value)
