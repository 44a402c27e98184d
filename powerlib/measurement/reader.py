"""The device side of ``powerlib.measure``: which devices it reads, and the thread that reads them.

A :class:`~powerlib.measure_api.measure.Measurement` has two halves (docs/measurement.md §1):
the training thread records window boundaries, and a sampler thread reads every device's
energy counter and power. This module is the second half:

- :func:`open_devices` turns what the caller named (devices, :data:`LOCAL`, or nothing: every
  device of the backend) into devices, and decides what a missing device means: an error when a
  backend or devices were named, else one warning and a time-only measurement
  (:func:`warn_no_device`, docs/real-gpu.md §7);
- :class:`DeviceReads` keeps each device's timestamped reads, runs the sampler thread (dithered
  period, at most :data:`MAX_DUTY` of a core), flushes past the end so the last boundary is
  bracketed by counter updates, and builds each device's ``E(t)``
  (:func:`~powerlib.measurement.timeline.build_timeline`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from powerlib.backend import Backend
from powerlib.config import Settings
from powerlib.device import Device
from powerlib.errors import InvalidArgumentError, PowerlibError
from powerlib.measurement.timeline import EnergyTimeline, build_timeline
from powerlib.registry import local_device, open_backend

__all__ = [
    "LOCAL",
    "MAX_DUTY",
    "DeviceReads",
    "OpenedDevices",
    "open_devices",
    "warn_no_device",
]

logger = logging.getLogger(__name__)

LOCAL = "local"
"""``devices=LOCAL``: this process's device, chosen as a session chooses its own
(:func:`powerlib.registry.local_device`, docs/real-gpu.md §4)."""

MAX_DUTY = 0.05
"""Most of a core the sampler thread may keep busy; slower reads stretch its period."""

_NO_DEVICE_WARNED = False


def warn_no_device(reason: str) -> None:
    """Say once per process that measuring goes on without a device: time only, no energy.

    One logged warning and one ``RuntimeWarning`` (as a session's own warnings), the first
    time; later calls log at INFO (docs/real-gpu.md §7).
    """
    global _NO_DEVICE_WARNED
    if _NO_DEVICE_WARNED:
        logger.info("powerlib: measuring time only, no device: %s", reason)
        return
    _NO_DEVICE_WARNED = True
    hint = (
        ""
        if "POWERLIB_BACKEND" in reason
        else " (set POWERLIB_BACKEND to measure a device; POWERLIB_BACKEND=simulated for "
        "simulated GPUs)"
    )
    message = f"powerlib: measuring time only, no energy: {reason}{hint}"
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


@dataclass(frozen=True, slots=True)
class OpenedDevices:
    """What :func:`open_devices` found.

    Attributes:
        backend: The backend the devices belong to (``None``: no device, or devices given).
        own_backend: :func:`open_devices` opened ``backend``: the caller closes it at the end.
        devices: The devices, each once (empty: measure time only).
    """

    backend: Backend | None
    own_backend: bool
    devices: list[Device]


_NONE = OpenedDevices(None, False, [])


def open_devices(
    devices: Sequence[Device | int | str] | str | None, backend: Backend | str | None
) -> OpenedDevices:
    """Open the backend and the devices; without a device named, warn and measure time only.

    Args:
        devices: ``Device`` objects, indexes or ids of ``backend``'s devices; :data:`LOCAL`;
            ``None``: every device of the backend.
        backend: A :class:`Backend`, a backend name, or ``None`` (``POWERLIB_BACKEND``).

    Raises:
        PowerlibError: A backend named explicitly (an argument or ``POWERLIB_BACKEND``) that
            cannot open, or devices listed explicitly that do not exist; otherwise a failure
            to find a device is one warning and no device (docs/real-gpu.md §7).
        InvalidArgumentError: A backend or devices were named and the backend has no devices.
    """
    settings: Settings | None = None
    if isinstance(backend, Backend):
        named_backend = True
    else:
        settings = Settings.from_env()
        named_backend = (backend if backend is not None else settings.backend) != "auto"
    named_devices = isinstance(devices, list)
    try:
        opened, own = _backend_for(devices, backend, settings)
    except PowerlibError as err:
        if named_backend:
            raise
        warn_no_device(str(err))
        return _NONE
    try:
        found = _devices_of(opened, devices, settings)
    except BaseException as err:
        if own and opened is not None:
            opened.close()
        if not isinstance(err, PowerlibError) or named_devices:
            raise
        warn_no_device(str(err))
        return _NONE
    if not found:
        if own and opened is not None:
            opened.close()
        if named_backend or named_devices:
            raise InvalidArgumentError("nothing to measure: the backend has no devices")
        warn_no_device("the backend has no devices")
        return _NONE
    unique: dict[str, Device] = {}
    for d in found:
        unique.setdefault(d.device_id, d)
    return OpenedDevices(opened, own, list(unique.values()))


def _backend_for(
    devices: Sequence[Device | int | str] | str | None,
    backend: Backend | str | None,
    settings: Settings | None,
) -> tuple[Backend | None, bool]:
    """The backend (opened here, then owned, unless given) the devices belong to."""
    if isinstance(backend, Backend):
        return backend, False
    if isinstance(devices, list) and all(isinstance(d, Device) for d in devices):
        return None, False
    return open_backend(backend, settings), True


def _devices_of(
    backend: Backend | None,
    devices: Sequence[Device | int | str] | str | None,
    settings: Settings | None,
) -> list[Device]:
    if devices is None:
        assert backend is not None
        return list(backend.devices())
    if devices == LOCAL:
        assert backend is not None
        return [local_device(backend, settings or Settings.from_env())]
    out: list[Device] = []
    for d in devices:
        if isinstance(d, Device):
            out.append(d)
        else:
            assert backend is not None
            out.append(backend.device(d))
    return out


class _Track:
    """One device's reads."""

    __slots__ = ("counter", "device", "has_counter", "power", "read_s", "times", "wrap_j")

    def __init__(self, device: Device) -> None:
        self.device = device
        self.has_counter = device.read_state().energy_j is not None
        self.wrap_j: float | None = getattr(device, "energy_counter_wrap_j", None)
        self.times: list[float] = []
        self.read_s: list[float] = []
        """How long each read took: the device was read at some instant of it."""
        self.counter: list[float | None] = []
        self.power: list[float | None] = []


def _updated_after(track: _Track, end_s: float) -> bool:
    """Whether two reads that both began after ``end_s`` show different counter values."""
    n = min(len(track.times), len(track.read_s), len(track.counter))
    seen: set[float] = set()
    for i in range(n - 1, -1, -1):  # newest first: the flush runs after a long measurement
        if track.times[i] - 0.5 * track.read_s[i] < end_s:
            break
        value = track.counter[i]
        if value is not None:
            seen.add(value)
    return len(seen) > 1


class DeviceReads:
    """Timestamped reads of a measurement's devices, and the sampler thread that takes them.

    Args:
        devices: The devices, each once.
        clock: Time source in seconds (the measurement's).
        sample_period_s: Base period of the sampler thread.
    """

    def __init__(
        self, devices: Sequence[Device], clock: Callable[[], float], sample_period_s: float
    ) -> None:
        self.tracks = [_Track(d) for d in devices]
        self.sample_period_s = sample_period_s
        self._clock = clock
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._flushing = False

    @property
    def devices(self) -> list[Device]:
        """The devices read."""
        return [t.device for t in self.tracks]

    def poll(self) -> None:
        """Read every device once (the sampler thread calls this; so do ``manual`` tests)."""
        for track in self.tracks:
            t0 = self._clock()
            try:
                state = track.device.read_state()
            except PowerlibError as err:
                logger.warning("reading %s failed: %s", track.device.device_id, err)
                continue
            t1 = self._clock()
            track.times.append(0.5 * (t0 + t1))
            track.read_s.append(t1 - t0)
            track.counter.append(state.energy_j)
            track.power.append(state.power_w)

    def start(self, on_tick: Callable[[], None] | None = None) -> None:
        """Start the sampler thread; it calls ``on_tick`` after each round of reads."""
        self._thread = threading.Thread(
            target=self._sample_loop, args=(on_tick,), name="powerlib-measure", daemon=True
        )
        self._thread.start()

    def stop(self, end_s: float, flush_timeout_s: float) -> None:
        """Flush past ``end_s`` and stop the thread; without a thread, read once more."""
        if self._thread is None:
            self.poll()
            return
        self._flush(end_s, flush_timeout_s)
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self._thread = None

    def _sample_loop(self, on_tick: Callable[[], None] | None) -> None:
        wait_s = self.sample_period_s
        # Dithered periods: reads at a fixed period keep the same phase against the counter's
        # own update period, so every update is bracketed alike and the brackets' intersection
        # (timeline._energy_consistent) stays as wide as one of them; random phases narrow it.
        dither = random.Random()
        while True:
            if self._wake.wait(wait_s * dither.uniform(0.6, 1.4)):
                self._wake.clear()
            if self._stop.is_set():
                return
            # The sampler's own CPU time, not its wall time: a read that waited for the GIL
            # (the training thread held it) stole nothing from the loop, and counting the wait
            # stretched the period to hundreds of ms on a busy CPU loop.
            t0 = time.thread_time()
            self.poll()
            busy_s = time.thread_time() - t0
            # Keep the sampler's share of a core under MAX_DUTY: slow reads (many devices, a
            # slow driver) stretch the period instead of stealing the loop's time. The flush
            # after the end reads at the base period: the loop is no longer running.
            wait_s = (
                self.sample_period_s
                if self._flushing
                else max(self.sample_period_s, busy_s / MAX_DUTY - busy_s)
            )
            if on_tick is not None:
                on_tick()

    def _flush(self, end_s: float, timeout_s: float) -> None:
        """Read until every counter has published past the end, or the timeout.

        Past the end means an update between two reads that both began after it (a read in
        flight at the end may still show a value from before it), so the end lies before a
        knot of :mod:`~powerlib.measurement.timeline` and is interpolated, not extrapolated.
        """
        deadline = time.monotonic() + timeout_s
        pending = [t for t in self.tracks if t.has_counter]
        self._flushing = True
        self._wake.set()  # a sampler stretched by slow reads reads again now
        while pending and time.monotonic() < deadline:
            time.sleep(self.sample_period_s)
            pending = [t for t in pending if not _updated_after(t, end_s)]
        if pending:
            logger.debug("measure: %d counter(s) did not update within the flush", len(pending))

    def snapshot(self) -> list[dict[str, Any]]:
        """Per device so far, from the raw reads: ``device_id``, ``energy_j``, ``power_w``, ``time_s``.

        Cheap (no attribution): what ``powerlib measure --jsonl`` and the exporter publish.
        """
        out = []
        for t in self.tracks:
            n = min(len(t.times), len(t.counter), len(t.power))
            if n == 0:
                continue
            if t.has_counter:
                first = next((c for c in t.counter[:n] if c is not None), None)
                last = next((c for c in reversed(t.counter[:n]) if c is not None), None)
                energy = (last - first) if first is not None and last is not None else None
                if energy is not None and energy < 0:
                    energy = None  # a reset: result() accounts for it
            else:
                tl = build_timeline(t.times[:n], None, t.power[:n])
                energy = float(tl.energy_at([t.times[n - 1]])[0])
            out.append(
                {
                    "device_id": t.device.device_id,
                    "index": t.device.index,
                    "energy_j": energy,
                    "power_w": t.power[n - 1],
                    "time_s": t.times[n - 1] - t.times[0],
                }
            )
        return out

    def power_series(self, start_s: float) -> dict[str, tuple[list[float], list[float | None]]]:
        """Per device id: read times (s after ``start_s``) and power (W), for plots."""
        return {
            t.device.device_id: ([x - start_s for x in t.times], list(t.power)) for t in self.tracks
        }

    def timeline(self, track: _Track) -> EnergyTimeline:
        """``E(t)`` of one device from its reads so far."""
        n = min(len(track.times), len(track.read_s), len(track.counter), len(track.power))
        return build_timeline(
            track.times[:n],
            track.counter[:n] if track.has_counter else None,
            track.power[:n],
            wrap_j=track.wrap_j,
            read_s=track.read_s[:n],
        )
