"""Prometheus metrics of every device, and of the sessions and measurements in this process.

``powerlib exporter --port 9464`` serves them over HTTP; ``--textfile PATH`` writes them for
node_exporter's textfile collector instead. In a training process::

    from powerlib.exporter import Exporter
    with Exporter(port=9464):             # also publishes powerlib.measure / optimize series
        train()

Built on ``prometheus-client`` (the ``prometheus`` extra), on a registry of its own (the
process's default registry is left alone). A :class:`DeviceSampler` thread reads the devices
every ``interval_s`` into a cache; a scrape renders the cache and never calls a device, so a
scrape costs the same whatever the driver's latency and cannot slow a training loop's devices.
The exporter only reads: it changes no clock, no limit and writes no journal.

Names follow Prometheus conventions: base units (joules, watts, hertz, celsius, seconds),
``_total`` on counters. Labels match dcgm-exporter's where they mean the same (``gpu``: the
index, ``UUID``, ``device``: e.g. ``nvidia0``, ``modelName``, ``Hostname``), so dashboards built
for ``DCGM_FI_DEV_POWER_USAGE`` need only the metric name changed. Per device at most 13 series.

=================================================  =======  ======================================
metric                                             type     meaning
=================================================  =======  ======================================
``powerlib_device_info``                           gauge 1  labels ``name``, ``vendor``, ``kind``,
                                                            ``backend``, ``energy_source``
``powerlib_device_energy_joules_total``            counter  the device's energy counter
``powerlib_device_power_watts``                    gauge    power draw
``powerlib_device_sm_clock_hertz``                 gauge    compute clock
``powerlib_device_power_limit_watts``              gauge    power limit in force
``powerlib_device_power_limit_min_watts``          gauge    lowest settable limit
``powerlib_device_power_limit_max_watts``          gauge    highest settable limit
``powerlib_device_power_limit_default_watts``      gauge    default limit
``powerlib_device_locked_sm_clock_min_hertz``      gauge    lock floor (when the backend can tell)
``powerlib_device_locked_sm_clock_max_hertz``      gauge    lock ceiling (when the backend can tell)
``powerlib_device_temperature_celsius``            gauge    temperature
``powerlib_device_sample_timestamp_seconds``       gauge    Unix time of the cached reading
``powerlib_device_sample_errors_total``            counter  failed reads
``powerlib_session_steps_total``                   counter  steps of a ``powerlib.measure``
``powerlib_session_step_seconds``                  summary  step time (``_sum``, ``_count``)
``powerlib_session_energy_joules_total``           counter  energy of a measurement's devices
``powerlib_session_tokens_total``                  counter  tokens the steps reported
``powerlib_session_planned_saving_ratio``          gauge    saving the applied plan replayed
``powerlib_session_stage_sm_clock_hertz``          gauge    clock a session last asked its stage
=================================================  =======  ======================================
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from powerlib.device import Backend, Device, PowerState
from powerlib.errors import BackendUnavailableError, InvalidArgumentError, PowerlibError

__all__ = ["DEFAULT_PORT", "DeviceSampler", "Exporter", "make_registry"]

DEFAULT_PORT = 9464
"""The port the exporter listens on by default (OpenTelemetry's Prometheus exporter default)."""

_MHZ = 1e6


def _prometheus() -> Any:
    try:
        import prometheus_client  # noqa: PLC0415 - optional extra
    except ImportError as err:
        raise BackendUnavailableError(
            "the exporter needs prometheus-client: pip install 'powerlib[prometheus]'"
        ) from err
    return prometheus_client


@dataclass(frozen=True, slots=True)
class _Cached:
    state: PowerState | None
    energy_j: float
    sampled_unix_s: float
    errors: int


class DeviceSampler:
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

    def __init__(self, sampler: DeviceSampler | None, hostname: str, *, sessions: bool) -> None:
        self._sampler = sampler
        self._hostname = hostname
        self._sessions = sessions
        self._rendered: tuple[int, list[Any]] | None = None  # (generation, device families)

    def describe(self) -> list[Any]:
        return []  # unchecked collector: names vary with what is running

    def collect(self) -> Iterator[Any]:
        _prometheus()
        import prometheus_client.core as core  # noqa: PLC0415 - optional extra

        if self._sampler is not None:
            generation = self._sampler.generation
            cached = self._rendered
            if cached is None or cached[0] != generation:
                cached = (generation, list(self._devices(core)))
                self._rendered = cached
            yield from cached[1]
        if self._sessions:
            yield from self._session_metrics(core)

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

    def _session_metrics(self, core: Any) -> Iterator[Any]:
        from powerlib.measurement import active_measurements  # noqa: PLC0415

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
        from powerlib.runtime.session import active_sessions  # noqa: PLC0415

        saving = core.GaugeMetricFamily(
            "powerlib_session_planned_saving_ratio",
            "Energy saving of the applied plan, replayed on the profile (fraction)",
            labels=["stage", "Hostname"],
        )
        clock = core.GaugeMetricFamily(
            "powerlib_session_stage_sm_clock_hertz",
            "Clock the session last asked for its stage (Hz)",
            labels=["stage", "Hostname"],
        )
        for s in active_sessions():
            values = [str(s.stage), self._hostname]
            summary = s.outcome.summary if s.outcome is not None else None
            pct = ((summary or {}).get("realized") or {}).get("saving_percent")
            if isinstance(pct, (int, float)):
                saving.add_metric(values, pct / 100.0)
            freq = s.controller.last_requested if s.controller is not None else None
            if freq is not None:
                clock.add_metric(values, freq * _MHZ)
        yield from (saving, clock)


def make_registry(
    sampler: DeviceSampler | None, *, sessions: bool = True, hostname: str | None = None
) -> Any:
    """A ``prometheus_client.CollectorRegistry`` with powerlib's collector (and nothing else)."""
    prom = _prometheus()
    registry = prom.CollectorRegistry(auto_describe=False)
    registry.register(_Collector(sampler, hostname or socket.gethostname(), sessions=sessions))
    return registry


class Exporter:
    """Sampler + registry + HTTP server (or textfile writer); a context manager.

    Args:
        devices: Devices to publish (default: every device of ``backend``); ``[]`` publishes
            only sessions and measurements.
        backend: A :class:`Backend`, a backend name, or ``None`` (``POWERLIB_BACKEND``).
        port: HTTP port (``0``: any free port, see :attr:`port`); ``None`` serves nothing.
        addr: Address to listen on (default all interfaces, as node exporters do).
        interval_s: Seconds between device reads.
        textfile: Write the metrics here every ``interval_s`` (atomically) instead of, or as
            well as, serving them.
        sessions: Also publish this process's measurements and sessions.
    """

    def __init__(
        self,
        devices: Iterable[Device | int | str] | None = None,
        *,
        backend: Backend | str | None = None,
        port: int | None = DEFAULT_PORT,
        addr: str = "0.0.0.0",  # noqa: S104 - an exporter is scraped from other hosts
        interval_s: float = 1.0,
        textfile: str | os.PathLike[str] | None = None,
        sessions: bool = True,
    ) -> None:
        _prometheus()
        if port is not None and not 0 <= port <= 65535:
            raise InvalidArgumentError(f"port must be 0-65535, got {port}")
        self._devices_spec = None if devices is None else list(devices)
        self._backend_spec = backend
        self._port = port
        self._addr = addr
        self.interval_s = interval_s
        self.textfile = Path(textfile) if textfile is not None else None
        self._sessions = sessions
        self._backend: Backend | None = None
        self._own_backend = False
        self.sampler: DeviceSampler | None = None
        self.registry: Any = None
        self._server: Any = None
        self._server_thread: threading.Thread | None = None
        self._writer: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def port(self) -> int | None:
        """The port served (the one chosen when ``port=0``)."""
        return None if self._server is None else int(self._server.server_port)

    def start(self) -> Exporter:
        """Open the devices, start sampling and serving. Returns ``self``."""
        prom = _prometheus()
        devices = self._open_devices()
        self.sampler = DeviceSampler(devices, self.interval_s) if devices else None
        self.registry = make_registry(self.sampler, sessions=self._sessions)
        if self.sampler is not None:
            self.sampler.start()
        if self._port is not None:
            try:
                self._server, self._server_thread = prom.start_http_server(
                    self._port, addr=self._addr, registry=self.registry
                )
            except OSError as err:
                self.close()
                raise InvalidArgumentError(
                    f"cannot listen on {self._addr}:{self._port}: {err.strerror}"
                ) from err
        if self.textfile is not None:
            self.write_textfile()
            self._writer = threading.Thread(
                target=self._write_loop, name="powerlib-textfile", daemon=True
            )
            self._writer.start()
        return self

    def render(self) -> bytes:
        """The metrics in the Prometheus text format (what a scrape returns)."""
        return _prometheus().generate_latest(self.registry)  # type: ignore[no-any-return]

    def write_textfile(self) -> None:
        """Write the metrics to :attr:`textfile` atomically (temporary file, then rename)."""
        assert self.textfile is not None
        _prometheus().write_to_textfile(str(self.textfile), self.registry)

    def _write_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.write_textfile()
            except OSError:
                continue

    def close(self) -> None:
        """Stop serving, writing and sampling; release what it opened. Idempotent."""
        self._stop.set()
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self.sampler is not None:
            self.sampler.stop()
        if self._own_backend and self._backend is not None:
            self._backend.close()
            self._own_backend = False

    def __enter__(self) -> Exporter:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _open_devices(self) -> list[Device]:
        spec = self._devices_spec
        if spec == []:
            return []
        if isinstance(self._backend_spec, Backend):
            self._backend = self._backend_spec
        elif not (spec and all(isinstance(d, Device) for d in spec)):
            from powerlib.registry import open_backend  # noqa: PLC0415

            self._backend = open_backend(self._backend_spec)
            self._own_backend = True
        if spec is None:
            assert self._backend is not None
            return list(self._backend.devices())
        out = []
        for d in spec:
            if isinstance(d, Device):
                out.append(d)
            else:
                assert self._backend is not None
                out.append(self._backend.device(d))
        return out
