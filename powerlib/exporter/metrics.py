"""The exporter's metrics: a cache of device readings, and the collector that renders it.

:class:`ReadingCache` reads the devices every ``interval_s`` on a thread of its own; the
collector renders that cache (never calling a device, so a scrape costs the same whatever the
driver's latency) and this process's ``powerlib.measure`` blocks and optimizing sessions, on a
``prometheus_client`` registry of its own (:func:`make_registry`). The metric names and labels
are listed in :mod:`powerlib.exporter.service`; docs/measurement.md §7.

Sessions are pulled at each scrape (:func:`running_stages`): the exporter asks the runtime for
its running sessions and their :meth:`~powerlib.runtime.session.Session.status`; the runtime
knows nothing of the exporter.
"""

from __future__ import annotations

import math
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from powerlib.device import Device, PowerState
from powerlib.errors import BackendUnavailableError, InvalidArgumentError, PowerlibError
from powerlib.measure_api.measure import active_measurements

if TYPE_CHECKING:  # the runtime is pulled at a scrape only (a measuring process never loads it)
    from powerlib.runtime.records import Realized

__all__ = ["ReadingCache", "StageGauges", "make_registry", "prometheus", "running_stages"]

_MHZ = 1e6


def prometheus() -> Any:
    """The ``prometheus_client`` module (the ``prometheus`` extra).

    Raises:
        BackendUnavailableError: It is not installed; the message names the extra.
    """
    try:
        import prometheus_client  # noqa: PLC0415 - optional extra
    except ImportError as err:
        raise BackendUnavailableError(
            "the exporter needs prometheus-client: pip install 'powerlib[prometheus]'"
        ) from err
    return prometheus_client


@dataclass(frozen=True, slots=True)
class StageGauges:
    """What an optimizing session in this process publishes about its pipeline stage.

    Attributes:
        stage: The session's pipeline stage.
        saving_ratio: The applied plan's predicted energy saving per iteration (a fraction):
            ``summary.json``'s ``saving_percent`` / 100, the figure the planning log line and
            the session's ``Prediction`` give; ``None`` before there is one.
        sm_freq_mhz: The clock the session last asked for its stage, or ``None``.
        measured: The closed loop's verdict and figures against the baseline clocks (job-wide),
            or ``None`` before its verdict or when nothing was measured.
    """

    stage: int
    saving_ratio: float | None
    sm_freq_mhz: float | None
    measured: Realized | None = None

    def estimates(self) -> list[tuple[str, bool, tuple[float, float, float, float]]]:
        """The estimates as fractions: ``(method, judged, (saving, ±, slowdown, ±))``.

        The judged estimate first, then the interleaved windows' check beside a paired one.
        """
        m = self.measured
        if m is None:
            return []
        out = [(m.method or "", True, (m.saving_percent, m.saving_ci_percent,
                                       m.slowdown_percent, m.slowdown_ci_percent))]  # fmt: skip
        if m.check is not None:
            c = m.check
            out.append((c.method, False, (c.saving_percent, c.saving_ci_percent,
                                          c.slowdown_percent, c.slowdown_ci_percent)))  # fmt: skip
        return [(method, judged, tuple(v / 100.0 for v in figs)) for method, judged, figs in out]  # type: ignore[misc]


def running_stages() -> list[StageGauges]:
    """Each optimizing session running in this process: its stage's savings and clock.

    A process that never loaded the runtime runs no session, and a scrape does not load it.
    """
    if "powerlib.runtime.session" not in sys.modules:
        return []
    from powerlib.runtime.session import active_sessions  # noqa: PLC0415 - pulled at a scrape: the runtime never imports the exporter, and is loaded already

    out = []
    for session in active_sessions():
        status = session.status()
        predicted, measured = status.predicted_saving_percent, status.measured
        out.append(
            StageGauges(
                stage=status.stage,
                saving_ratio=None if predicted is None else predicted / 100.0,
                sm_freq_mhz=status.sm_freq_mhz,
                measured=measured,
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class _Cached:
    state: PowerState | None
    energy_j: float
    sampled_unix_s: float
    errors: int


class ReadingCache:
    """Reads devices every ``interval_s`` on a thread of its own; scrapes read its cache.

    Energy is the device's own counter where it has one (NVML's counts since the driver
    loaded, like dcgm-exporter's ``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION``; a device reset is a
    counter reset, which Prometheus's ``rate()`` handles), else power integrated since the
    sampler started.

    Args:
        devices: The devices.
        interval_s: Seconds between reads.
    """

    def __init__(self, devices: Sequence[Device], interval_s: float = 1.0) -> None:
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise InvalidArgumentError(f"interval_s must be positive, got {interval_s!r}")
        self.devices = list(devices)
        self.interval_s = float(interval_s)
        self._lock = threading.Lock()
        self._cache: dict[str, _Cached] = {}
        self._last: dict[str, tuple[float, float | None, float | None]] = {}
        self._energy: dict[str, float] = {}
        self._errors: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.generation = 0
        """Bumped after every full read of the devices (renders are cached per generation)."""
        self.sample()

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._loop, name="powerlib-exporter", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        """Read every device once into the cache."""
        for dev in self.devices:
            key = dev.device_id
            now = time.monotonic()
            try:
                state: PowerState | None = dev.read_state()
            except PowerlibError:
                state = None
                self._errors[key] = self._errors.get(key, 0) + 1
            energy = self._energy.get(key, 0.0)
            if state is not None:
                last = self._last.get(key)
                if state.energy_j is not None:
                    energy = state.energy_j  # the device's own counter; a reset is a reset
                elif last is not None:  # no counter: power integrated (trapezoid) since start
                    t0, _, power0 = last
                    watts = [w for w in (power0, state.power_w) if w is not None]
                    if watts:
                        energy += sum(watts) / len(watts) * (now - t0)
                self._last[key] = (now, state.energy_j, state.power_w)
                self._energy[key] = energy
            previous = self._cache.get(key)
            cached = _Cached(
                state=state if state is not None else (previous.state if previous else None),
                energy_j=energy,
                sampled_unix_s=time.time()
                if state is not None
                else (previous.sampled_unix_s if previous else 0.0),
                errors=self._errors.get(key, 0),
            )
            with self._lock:
                self._cache[key] = cached
        self.generation += 1

    def cached(self) -> dict[str, _Cached]:
        """The latest reading of each device (a copy)."""
        with self._lock:
            return dict(self._cache)


def _device_labels(dev: Device, hostname: str) -> dict[str, str]:
    info = dev.info
    return {
        "gpu": str(info.index),
        "UUID": info.device_id,
        "device": f"{info.vendor}{info.index}" if info.kind.value == "gpu" else f"cpu{info.index}",
        "modelName": info.name,
        "Hostname": hostname,
    }


class _Collector:
    """Renders the sampler's cache, and this process's sessions and measurements."""

    def __init__(self, sampler: ReadingCache | None, hostname: str, *, sessions: bool) -> None:
        self._sampler = sampler
        self._hostname = hostname
        self._sessions = sessions
        self._rendered: tuple[int, list[Any]] | None = None  # (generation, device families)

    def describe(self) -> list[Any]:
        return []  # unchecked collector: names vary with what is running

    def collect(self) -> Iterator[Any]:
        prometheus()
        import prometheus_client.core as core  # noqa: PLC0415 - optional extra

        if self._sampler is not None:
            generation = self._sampler.generation
            cached = self._rendered
            if cached is None or cached[0] != generation:
                cached = (generation, list(self._devices(core)))
                self._rendered = cached
            yield from cached[1]
        if self._sessions:
            yield from self._measurement_metrics(core)
            yield from self._stage_metrics(core)

    def _devices(self, core: Any) -> Iterator[Any]:
        assert self._sampler is not None
        keys = ["gpu", "UUID", "device", "modelName", "Hostname"]
        fam = {
            "info": core.GaugeMetricFamily(
                "powerlib_device_info",
                "Device identity (value 1)",
                labels=[*keys, "name", "vendor", "kind", "backend", "energy_source"],
            ),
            "energy": core.CounterMetricFamily(
                "powerlib_device_energy_joules",
                "Energy counter (J): the device's own, or power integrated since the exporter started",
                labels=keys,
            ),
            "power": core.GaugeMetricFamily("powerlib_device_power_watts", "Power draw (W)", labels=keys),
            "clock": core.GaugeMetricFamily("powerlib_device_sm_clock_hertz", "Compute (SM) clock (Hz)", labels=keys),
            "limit": core.GaugeMetricFamily("powerlib_device_power_limit_watts", "Power limit in force (W)", labels=keys),
            "limit_min": core.GaugeMetricFamily("powerlib_device_power_limit_min_watts", "Lowest settable power limit (W)", labels=keys),
            "limit_max": core.GaugeMetricFamily("powerlib_device_power_limit_max_watts", "Highest settable power limit (W)", labels=keys),
            "limit_default": core.GaugeMetricFamily("powerlib_device_power_limit_default_watts", "Default power limit (W)", labels=keys),
            "lock_min": core.GaugeMetricFamily("powerlib_device_locked_sm_clock_min_hertz", "Locked compute clock floor (Hz)", labels=keys),
            "lock_max": core.GaugeMetricFamily("powerlib_device_locked_sm_clock_max_hertz", "Locked compute clock ceiling (Hz)", labels=keys),
            "temp": core.GaugeMetricFamily("powerlib_device_temperature_celsius", "Temperature (C)", labels=keys),
            "stamp": core.GaugeMetricFamily("powerlib_device_sample_timestamp_seconds", "Unix time of the cached reading (s)", labels=keys),
            "errors": core.CounterMetricFamily("powerlib_device_sample_errors", "Failed device reads", labels=keys),
        }  # fmt: skip
        cache = self._sampler.cached()
        for dev in self._sampler.devices:
            info = dev.info
            labels = _device_labels(dev, self._hostname)
            values = [labels[k] for k in keys]
            source = "counter" if info.capabilities.has_energy_counter else "integrated"
            fam["info"].add_metric(
                [*values, info.name, info.vendor, info.kind.value, info.backend, source], 1.0
            )
            entry = cache.get(info.device_id)
            if entry is None:
                continue
            fam["energy"].add_metric(values, entry.energy_j)
            fam["errors"].add_metric(values, float(entry.errors))
            if info.power_limit_range_w is not None:
                fam["limit_min"].add_metric(values, info.power_limit_range_w[0])
                fam["limit_max"].add_metric(values, info.power_limit_range_w[1])
            if info.default_power_limit_w is not None:
                fam["limit_default"].add_metric(values, info.default_power_limit_w)
            st = entry.state
            if st is None:
                continue
            fam["stamp"].add_metric(values, entry.sampled_unix_s)
            for name, value, scale in (
                ("power", st.power_w, 1.0),
                ("clock", st.sm_freq_mhz, _MHZ),
                ("limit", st.power_limit_w, 1.0),
                ("temp", st.temperature_c, 1.0),
            ):
                if value is not None:
                    fam[name].add_metric(values, value * scale)
            if st.locked_sm_freqs_mhz is not None:
                fam["lock_min"].add_metric(values, st.locked_sm_freqs_mhz[0] * _MHZ)
                fam["lock_max"].add_metric(values, st.locked_sm_freqs_mhz[1] * _MHZ)
        yield from fam.values()

    def _measurement_metrics(self, core: Any) -> Iterator[Any]:
        labels = ["measurement", "rank", "Hostname"]
        steps = core.CounterMetricFamily("powerlib_session_steps", "Steps measured", labels=labels)
        step_s = core.SummaryMetricFamily(
            "powerlib_session_step_seconds", "Step time (s)", labels=labels
        )
        energy = core.CounterMetricFamily(
            "powerlib_session_energy_joules", "Energy of the measured devices (J)", labels=labels
        )
        tokens = core.CounterMetricFamily(
            "powerlib_session_tokens", "Tokens the steps reported", labels=labels
        )
        for i, m in enumerate(active_measurements()):
            values = [str(i), str(m.rank), self._hostname]
            done = [w for w in list(m.windows) if w.kind == "step" and w.end_s is not None]
            steps.add_metric(values, float(len(done)))
            step_s.add_metric(values, len(done), math.fsum(w.end_s - w.start_s for w in done))  # type: ignore[operator]
            energy.add_metric(values, math.fsum(s["energy_j"] or 0.0 for s in m.snapshot()))
            tokens.add_metric(values, math.fsum(w.tokens or 0.0 for w in done))
        yield from (steps, step_s, energy, tokens)

    def _stage_metrics(self, core: Any) -> Iterator[Any]:
        saving = core.GaugeMetricFamily(
            "powerlib_session_planned_saving_ratio",
            "Predicted energy saving per iteration of the applied plan, replayed on the profile "
            "(summary.json saving_percent; fraction)",
            labels=["stage", "Hostname"],
        )
        clock = core.GaugeMetricFamily(
            "powerlib_session_stage_sm_clock_hertz",
            "Clock the session last asked for its stage (Hz)",
            labels=["stage", "Hostname"],
        )
        labels = ["stage", "verdict", "method", "judged", "Hostname"]
        what = "the closed loop measured against the baseline clocks (docs/measurement.md §9"
        measured = [
            core.GaugeMetricFamily(name, f"{help_} {what}; fraction)", labels=labels)
            for name, help_ in (
                ("powerlib_session_measured_saving_ratio", "Energy saving of the plan"),
                ("powerlib_session_measured_saving_ci_ratio", "Half-width of the 95 % interval of the saving"),
                ("powerlib_session_measured_slowdown_ratio", "Iteration-time change of the plan"),
                ("powerlib_session_measured_slowdown_ci_ratio", "Half-width of the 95 % interval of the slowdown"),
            )
        ]  # fmt: skip
        for gauges in running_stages():
            values = [str(gauges.stage), self._hostname]
            if gauges.saving_ratio is not None:
                saving.add_metric(values, gauges.saving_ratio)
            if gauges.sm_freq_mhz is not None:
                clock.add_metric(values, gauges.sm_freq_mhz * _MHZ)
            verdict = "" if gauges.measured is None else gauges.measured.verdict
            for method, judged, figures in gauges.estimates():
                series = [
                    str(gauges.stage),
                    verdict,
                    method,
                    "1" if judged else "0",
                    self._hostname,
                ]
                for family, value in zip(measured, figures):
                    if math.isfinite(value):
                        family.add_metric(series, value)
        yield from (saving, clock, *measured)


def make_registry(
    sampler: ReadingCache | None, *, sessions: bool = True, hostname: str | None = None
) -> Any:
    """A ``prometheus_client.CollectorRegistry`` with powerlib's collector (and nothing else)."""
    prom = prometheus()
    registry = prom.CollectorRegistry(auto_describe=False)
    registry.register(_Collector(sampler, hostname or socket.gethostname(), sessions=sessions))
    return registry
