"""A. Environment and read costs.

Device, driver, persistence, MIG, permission; the cost of each read through the backend
(``read_state``, ``read_sm_lock``, ``details``: median, p99); the energy counter's update period;
whether NVML's field timestamps follow the counter's updates; the counter's energy of a 10 ms on /
10 ms off load against the power readings integrated over it, and against steady load and idle
power; the default clock under load (what G compares with).

Hands on: ``rig.default_loaded_mhz`` (G), ``rig.counter_period_s`` and ``rig.read_state_s`` (E),
``rig.halt`` when the backend may not change clocks (B-G are then skipped).
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

# Library names: mend here when one moves (issue 43 moves the measurement packages:
# estimate_counter_period_s, DEFAULT_SAMPLE_PERIOD_S).
import powerlib
from powerlib import Device
from powerlib.measurement.counter_period import estimate_counter_period_s
from powerlib.measurement.sampler import DEFAULT_SAMPLE_PERIOD_S

from .harness import Rig, rounded, stats, timed
from .readings import counter_window, read_lock, sample_lock, summarize_samples

KEY = "A"
TITLE = "environment and read costs"


def environment(rig: Rig) -> dict[str, Any]:
    """Device, driver and software versions."""
    dev, info = rig.dev, rig.dev.info
    env: dict[str, Any] = {
        "name": info.name,
        "device_id": info.device_id,
        "backend": info.backend,
        "index": info.index,
        "simulated": info.is_simulated,
        "supported_sm_mhz": {
            "min": info.min_sm_freq_mhz,
            "max": info.max_sm_freq_mhz,
            "count": len(info.supported_sm_freqs_mhz),
        },
        "clocks_mhz": rig.freqs,
        "power_limit_range_w": info.power_limit_range_w,
        "default_power_limit_w": info.default_power_limit_w,
        "mig_enabled": dev.mig_enabled(),
        "details": dict(dev.details()),
        "python": platform.python_version(),
        "powerlib": powerlib.__version__,
        "kernel": platform.release(),
        "euid": os.geteuid(),
        "work": rig.work.describe(),
    }
    if rig.torch is not None:
        env["torch"] = rig.torch.__version__
        env["cuda"] = rig.torch.version.cuda
    if rig.nvml is not None:
        nvml = rig.nvml[0]
        for key, fn in (
            ("driver", "nvmlSystemGetDriverVersion"),
            ("nvml", "nvmlSystemGetNVMLVersion"),
            ("cuda_driver", "nvmlSystemGetCudaDriverVersion_v2"),
        ):
            with contextlib.suppress(Exception):
                value = getattr(nvml, fn)()
                env[key] = value.decode() if isinstance(value, bytes) else value
    else:
        env["driver"] = f"none ({info.backend} backend)"
    return env


def counter_reads(dev: Device, seconds: float) -> dict[str, Any]:
    """Read the counter back to back for ``seconds``: how often it moved (its period)."""
    reads: list[tuple[float, float | None]] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        st = dev.read_state()
        reads.append((time.perf_counter(), st.energy_j))
    intervals = [b[0] - a[0] for a, b in zip(reads, reads[1:])]
    changes = sum(1 for a, b in zip(reads, reads[1:]) if a[1] != b[1])
    est = estimate_counter_period_s(intervals, changes)
    return {
        "reads": len(reads),
        "changes": changes,
        "period_s": None if est is None else rounded(est[0]),
        "period_is_upper_bound": None if est is None else est[1],
    }


def _field_samples(rig: Rig, seconds: float) -> list[tuple[int, int]] | dict[str, Any]:
    """NVML's energy field read back to back: (timestamp, value) pairs, or why there are none."""
    if rig.nvml is None:
        return {
            "available": False,
            "why": f"not available: the {rig.dev.info.backend} backend has no NVML field values",
        }
    nvml, handle = rig.nvml
    field = getattr(nvml, "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION", None)
    if field is None:
        return {"available": False, "why": "not available: pynvml has no energy field id"}
    samples: list[tuple[int, int]] = []
    try:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            (value,) = nvml.nvmlDeviceGetFieldValues(handle, [field])
            if value.nvmlReturn != 0:
                return {
                    "available": False,
                    "why": f"not available: NVML returned {value.nvmlReturn} for the energy field",
                }
            samples.append((int(value.timestamp), int(value.value.ullVal)))
    except Exception as err:  # a driver without field values, a fake without timestamps
        return {"available": False, "why": f"not available: {type(err).__name__}: {err}"}
    return samples


def field_timestamps(rig: Rig, seconds: float) -> dict[str, Any]:
    """Whether NVML's field timestamps move exactly when the energy counter does."""
    samples = _field_samples(rig, seconds)
    if isinstance(samples, dict):
        return samples
    moved = [i for i in range(1, len(samples)) if samples[i][1] != samples[i - 1][1]]
    stamped = [i for i in range(1, len(samples)) if samples[i][0] != samples[i - 1][0]]
    both = set(moved) & set(stamped)
    stamps_at_moves = [samples[i][0] for i in moved]
    periods = [(b - a) / 1e6 for a, b in zip(stamps_at_moves, stamps_at_moves[1:])]
    return {
        "available": True,
        "reads": len(samples),
        "value_changes": len(moved),
        "timestamp_changes": len(stamped),
        "value_changes_with_new_timestamp": len(both),
        "follows_counter_updates": bool(moved) and len(both) == len(moved) == len(stamped),
        "period_from_timestamps_s": rounded(statistics.median(periods)) if periods else None,
    }


def with_power_field(dev: Device, body: Callable[[], Any]) -> tuple[Any, float, int]:
    """Run ``body`` while a thread reads the power back to back; its value, the power's integral."""
    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            power_w = dev.read_state().power_w
            if power_w is not None:
                samples.append((time.perf_counter(), power_w))

    thread = threading.Thread(target=poll, name="power-reads", daemon=True)
    thread.start()
    try:
        value = body()
    finally:
        stop.set()
        thread.join()
    joules = math.fsum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in zip(samples, samples[1:]))
    return value, joules, len(samples)


def _permission(rig: Rig) -> None:
    """May the backend change clocks here? Without it (on a GPU) the later parts cannot run."""
    refusal = rig.backend.control_refusal()
    rig.report.check(
        "A",
        "may_change_clocks",
        refusal is None,
        refusal or "yes",
        "the backend may change clocks here (root and CAP_SYS_ADMIN, docs/real-gpu.md §5)",
    )
    if refusal is not None and not rig.smoke:
        rig.halt = f"the backend may not change clocks here: {refusal}"


def _reads(rig: Rig, figures: dict[str, Any]) -> None:
    """The lock at start; what each read costs; the counter and the default clock under load."""
    dev, s, report = rig.dev, rig.scale, rig.report
    at_start = read_lock(dev)
    figures["lock_at_start_idle"] = at_start.to_json()
    costs = {
        "read_state": timed(dev.read_state, s.reads),
        "read_sm_lock": timed(dev.read_sm_lock, s.reads),
        "details": timed(dev.details, max(5, s.reads // 10)),
    }
    figures["read_cost_s"] = {name: stats(v) for name, v in costs.items()}
    rig.read_state_s = statistics.median(costs["read_state"])
    with rig.work.load():
        time.sleep(s.settle_s)
        loaded = sample_lock(dev, 2 * s.sample_s)
        figures["counter_under_load"] = counter = counter_reads(dev, s.counter_s)
        figures["field_timestamps"] = field_timestamps(rig, s.counter_s)
    figures["default_clock_under_load"] = default = summarize_samples(loaded)
    rig.default_loaded_mhz = default["running_mhz"]
    rig.counter_period_s = counter["period_s"]
    locked = at_start.locked is True or "True" in default["locked"]
    report.check(
        "A",
        "unlocked_at_start",
        not locked,
        f"idle {at_start.locked}, under load {'/'.join(default['locked'])}",
        "the driver reports no clock lock before the script changes anything",
        judged_in_smoke=True,
    )
    report.check(
        "A",
        "read_state_cost_s",
        rig.read_state_s < DEFAULT_SAMPLE_PERIOD_S / 2,
        rig.read_state_s,
        f"median read_state < half the sampler's period ({DEFAULT_SAMPLE_PERIOD_S / 2 * 1e3:g} ms)",
    )
    lock_read_s = statistics.median(costs["read_sm_lock"])
    report.check(
        "A",
        "read_sm_lock_cost_s",
        lock_read_s < 0.005,
        lock_read_s,
        "median read_sm_lock < 5 ms (it follows every clock write)",
    )
    period = counter["period_s"]
    report.check(
        "A",
        "counter_period_s",
        period is not None and period <= 0.2,
        period,
        "the energy counter updates at least every 200 ms under load (NVML: ~100 ms)",
    )


def _onoff(rig: Rig, figures: dict[str, Any]) -> None:
    """A 10 ms on / 10 ms off load: the counter's energy against the power readings."""
    dev, work, s = rig.dev, rig.work, rig.scale
    on = counter_window(rig, lambda: work.busy(s.power_s))
    off = counter_window(rig, lambda: time.sleep(s.power_s))
    onoff = counter_window(
        rig, lambda: with_power_field(dev, lambda: work.onoff(s.onoff_s, 0.01, 0.01))
    )
    busy_s, field_j, field_reads = onoff.value
    steady_j = on.power_w * busy_s + off.power_w * (onoff.time_s - busy_s)
    ratio = onoff.energy_j / field_j if field_j > 0 else math.nan
    figures["power_w"] = {"steady_load": rounded(on.power_w, 2), "idle": rounded(off.power_w, 2)}
    figures["onoff_10ms"] = {
        "time_s": rounded(onoff.time_s),
        "busy_s": rounded(busy_s),
        "counter_j": rounded(onoff.energy_j, 3),
        "power_field_j": rounded(field_j, 3),
        "power_field_reads": field_reads,
        "counter_over_power_field": rounded(ratio),
        "busy_x_steady_plus_idle_j": rounded(steady_j, 3),
        "counter_over_steady_estimate": rounded(
            onoff.energy_j / steady_j if steady_j > 0 else None
        ),
    }
    rig.report.check(
        "A",
        "onoff_10ms_counter_over_power_field",
        abs(ratio - 1.0) <= 0.10,
        ratio,
        "the counter's energy of a 10 ms on / 10 ms off load within 10 % of the power readings "
        "integrated over it (read back to back on a thread): the counter misses no phase of it",
    )


def run(rig: Rig, part: dict[str, Any]) -> None:
    """Environment and read costs."""
    rig.report.data["device"] = environment(rig)
    _permission(rig)
    _reads(rig, part["figures"])
    _onoff(rig, part["figures"])
