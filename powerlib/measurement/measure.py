"""``powerlib.measure``: energy per step, per token and per window of a training loop.

::

    with powerlib.measure() as m:
        for batch in loader:
            with m.step(tokens=batch.numel()):
                train_step(batch)
        with m.window("eval"):
            evaluate()
    print(m.result().summary())          # energy_j, time_s, average_power_w, J/step, J/token
    m.result(reduce="world")             # every rank, each physical device once

The training thread only records boundary times (a clock read and a list append: about a
microsecond, ``benchmarks/measure_overhead.py``). A sampler thread reads every device's energy
counter and power every ``sample_period_s``; energy is attributed to the windows afterwards by
:mod:`powerlib.measurement.timeline`, which reads a counter's exact deltas between its updates
and splits them at boundaries by the sampled power. No device call and no
``torch.cuda.synchronize`` run on the training thread.

On a GPU (``align="cuda"``, or ``"auto"`` once CUDA is initialised) each boundary also records a
CUDA event on the current stream (asynchronous, a few µs) and a waiter thread stamps the moment
the event completes: the window is the GPU's time for the step, not the host's, which runs ahead.
``auto`` is decided at each boundary: a measurement entered before the model moves to the GPU
switches to events once CUDA is initialised.

Without a device (no GPU and no ``POWERLIB_BACKEND``: ``auto`` finds nothing) a measurement
warns once per process and records time only (``devices`` is empty, every energy 0): measuring
never breaks training (docs/real-gpu.md §7). Only a backend or devices named explicitly that
cannot be opened raise.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import random
import socket
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from powerlib.config import Settings
from powerlib.device import Backend, Device
from powerlib.errors import InvalidArgumentError, PowerlibError
from powerlib.inputs import json_depth
from powerlib.measurement.markers import StreamMarker, cuda_marker
from powerlib.measurement.result import (
    DeviceEnergy,
    MeasurementResult,
    WindowEnergy,
    reduce_results,
)
from powerlib.measurement.timeline import EnergyTimeline, build_timeline

__all__ = [
    "EVENTS_ENV",
    "LOCAL",
    "Measurement",
    "StreamMarker",
    "Window",
    "active_measurements",
    "measure",
    "read_events",
    "warn_no_device",
]

logger = logging.getLogger(__name__)

EVENTS_ENV = "POWERLIB_MEASURE_EVENTS"
"""When set (``powerlib measure`` sets it for its child), measurements append their windows to
this file as JSON lines, so the parent can mark and attribute the child's steps."""

MAX_DUTY = 0.05
"""Most of a core the sampler thread may keep busy; slower reads stretch its period."""

_STREAM_TIMEOUT_S = 30.0
"""How long the exit waits for the device stream to reach its last marker."""

_ACTIVE: weakref.WeakSet[Measurement] = weakref.WeakSet()

LOCAL = "local"
"""``devices=LOCAL``: this process's device, chosen as a session chooses its own
(:func:`powerlib.runtime.options.local_device`, docs/real-gpu.md §4)."""

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
    message = (
        f"powerlib: measuring time only, no energy: {reason} (set POWERLIB_BACKEND to measure a "
        "device; POWERLIB_BACKEND=simulated for simulated GPUs)"
    )
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def active_measurements() -> list[Measurement]:
    """The measurements running in this process (the in-process exporter publishes them)."""
    return [m for m in list(_ACTIVE) if m.running]


class Window:
    """One step or named window; a context manager (``with m.step(): ...``).

    Attributes:
        kind: ``step`` or ``window``.
        name: Its name.
        index: Its number among its kind and name, from 0.
        tokens: Tokens processed (settable until it ends).
        start_s: Start on the measurement's clock (the GPU's completion time once aligned).
        end_s: End, or ``None`` while open.
    """

    __slots__ = ("_m", "end_s", "index", "kind", "name", "start_s", "tokens")

    def __init__(self, m: Measurement, kind: str, name: str, tokens: float | None) -> None:
        self._m = m
        self.kind = kind
        self.name = name
        self.tokens = tokens
        self.index = -1
        self.start_s = math.nan
        self.end_s: float | None = None

    def __enter__(self) -> Window:
        self._m._open(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._m._close_window(self)


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


class Measurement:
    """Energy per device, step and window; see the module docstring. Make one with :func:`measure`.

    Args:
        devices: What to measure: ``Device`` objects, indexes or ids of ``backend``'s devices;
            :data:`LOCAL` (``"local"``): this process's device; default every device of the
            backend (a shared device is counted once per world by :meth:`result` with
            ``reduce="world"``).
        backend: A :class:`Backend`, a backend name, or ``None`` (``POWERLIB_BACKEND``).
        sample_period_s: How often the sampler thread reads each device (default 10 ms).
        clock: Time source in seconds; default ``time.monotonic`` (the same in every process
            on a host). Tests pass a simulated backend's virtual clock.
        align: ``auto`` (CUDA events when CUDA is initialised), ``cuda`` or ``host``.
        sampler: ``thread`` (default) or ``manual``: nothing samples unless :meth:`poll` is
            called (deterministic tests on a virtual clock).
        flush_timeout_s: At exit, how long to keep reading for each counter's next update, so
            the last step's end is bracketed by counter values, not extrapolated.
        events_path: Append windows as JSON lines here (default ``$POWERLIB_MEASURE_EVENTS``;
            ``False``: never).
        stream_marker: Overrides the CUDA marker (tests).

    Raises:
        InvalidArgumentError: A bad argument or an unknown device.
        BackendUnavailableError: At the ``with`` line, a backend named explicitly (``backend``
            or ``POWERLIB_BACKEND``) cannot open. Without one, a missing device warns once and
            the measurement records time only.
    """

    def __init__(
        self,
        devices: Iterable[Device | int | str] | str | None = None,
        *,
        backend: Backend | str | None = None,
        sample_period_s: float = 0.01,
        clock: Callable[[], float] | None = None,
        align: str = "auto",
        sampler: str = "thread",
        flush_timeout_s: float = 1.0,
        events_path: str | os.PathLike[str] | bool | None = None,
        stream_marker: StreamMarker | None = None,
    ) -> None:
        if not (math.isfinite(sample_period_s) and sample_period_s > 0):
            raise InvalidArgumentError(
                f"sample_period_s must be a positive number of seconds, got {sample_period_s!r}"
            )
        if align not in ("auto", "cuda", "host"):
            raise InvalidArgumentError(f"align must be auto, cuda or host, got {align!r}")
        if sampler not in ("thread", "manual"):
            raise InvalidArgumentError(f"sampler must be thread or manual, got {sampler!r}")
        if isinstance(devices, str) and devices != LOCAL:
            raise InvalidArgumentError(
                f"devices must be {LOCAL!r}, None or a list of devices, got {devices!r}"
            )
        self._device_spec: list[Device | int | str] | str | None = (
            devices if devices is None or devices == LOCAL else list(devices)  # type: ignore[arg-type]
        )
        self._backend_spec = backend
        self.sample_period_s = float(sample_period_s)
        self._clock = clock if clock is not None else time.monotonic
        self._align = align
        self._sampler_mode = sampler
        self.flush_timeout_s = float(flush_timeout_s)
        env_path = os.environ.get(EVENTS_ENV) or None
        if events_path is False:  # powerlib measure itself: it reads the file, never writes it
            self._events_path: Path | None = None
        elif events_path is None or events_path is True:
            self._events_path = Path(env_path) if env_path else None
        else:
            self._events_path = Path(events_path)
        self._marker_override = stream_marker
        self._backend: Backend | None = None
        self._own_backend = False
        self._backend_opened = False
        self._tracks: list[_Track] = []
        self.windows: list[Window] = []
        """Closed windows, in the order they ended."""
        self._counts: dict[tuple[str, str], int] = {}
        self._open_steps: list[Window] = []
        self._marker: StreamMarker | None = None
        self._marks: queue.SimpleQueue[tuple[Window, bool, object] | None] = queue.SimpleQueue()
        self._waiter: threading.Thread | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._flushing = False
        self._events_written = 0
        self.start_s = math.nan
        self.end_s: float | None = None
        self.start_unix_s = math.nan
        self.running = False
        self.rank = 0
        self.hostname = socket.gethostname()
        self._result: MeasurementResult | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> Measurement:
        if self.running or self.end_s is not None:
            raise InvalidArgumentError("a measurement is entered once; make a new one")
        try:
            self._open_devices()
        except BaseException:
            self._close_backend()
            raise
        self._marker = (
            self._marker_override if self._marker_override is not None else cuda_marker(self._align)
        )
        self.rank = _rank()
        self.start_unix_s = time.time()
        self.poll()
        self.start_s = self._clock()
        self.running = True
        _ACTIVE.add(self)
        if self._sampler_mode == "thread":
            self._thread = threading.Thread(
                target=self._sample_loop, name="powerlib-measure", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """End the measurement: stop sampling (after the flush) and release what it opened.

        Idempotent. Windows still open are closed at this moment.
        """
        if not self.running:
            return
        for w in reversed(self._open_steps):
            self._close_window(w)
        self.end_s = self._clock()
        end_window = Window(self, "end", "end", None)
        self._mark(end_window, is_end=True)
        if self._waiter is not None:
            self._marks.put(None)
            self._waiter.join(timeout=_STREAM_TIMEOUT_S)
            if self._waiter.is_alive():  # a hung stream must not hang the job's exit
                logger.warning(
                    "measure: the device stream did not reach the end marker within %.0f s; "
                    "the newest windows keep their host times",
                    _STREAM_TIMEOUT_S,
                )
            if end_window.end_s is not None:
                self.end_s = max(self.end_s, end_window.end_s)
        self.running = False
        if self._thread is not None:
            self._flush()
            self._stop.set()
            self._wake.set()
            self._thread.join()
            self._thread = None
        else:
            self.poll()
        self._write_events()
        _ACTIVE.discard(self)
        self._close_backend()

    # -- windows ---------------------------------------------------------------------------------

    def step(self, tokens: float | None = None) -> Window:
        """A training step: ``with m.step(tokens=n): ...``."""
        return Window(self, "step", "step", tokens)

    def window(self, name: str, tokens: float | None = None) -> Window:
        """A named window (``"eval"``, ``"checkpoint"``...): ``with m.window("eval"): ...``."""
        return Window(self, "window", str(name), tokens)

    def begin_step(self, tokens: float | None = None) -> Window:
        """Start a step without a ``with`` block (trainer callbacks); :meth:`end_step` ends it."""
        w = Window(self, "step", "step", tokens)
        self._open(w)
        self._open_steps.append(w)
        return w

    def end_step(self, tokens: float | None = None) -> Window | None:
        """End the step :meth:`begin_step` started (``tokens`` given here win). ``None`` if none."""
        if not self._open_steps:
            return None
        w = self._open_steps.pop()
        if tokens is not None:
            w.tokens = tokens
        self._close_window(w)
        return w

    def record(
        self,
        kind: str,
        name: str,
        start_s: float,
        end_s: float,
        *,
        tokens: float | None = None,
        index: int | None = None,
    ) -> Window:
        """Add a window timed elsewhere, on this measurement's clock.

        Another process on this host shares the clock (``time.monotonic`` is the same in
        every process): ``powerlib measure`` records the steps its child reports.

        Raises:
            InvalidArgumentError: Unknown kind, or the end is before the start.
        """
        if kind not in ("step", "window"):
            raise InvalidArgumentError(f"kind must be step or window, got {kind!r}")
        if not (math.isfinite(start_s) and math.isfinite(end_s) and end_s >= start_s):
            raise InvalidArgumentError(f"window end {end_s!r} is before its start {start_s!r}")
        w = Window(self, kind, str(name), tokens)
        key = (kind, w.name)
        w.index = self._counts.get(key, 0) if index is None else int(index)
        self._counts[key] = max(self._counts.get(key, 0), w.index + 1)
        w.start_s, w.end_s = float(start_s), float(end_s)
        self.windows.append(w)
        self._result = None
        return w

    def power_series(self) -> dict[str, tuple[list[float], list[float | None]]]:
        """Per device id: read times (s after the start) and power (W), for plots."""
        return {
            t.device.device_id: ([x - self.start_s for x in t.times], list(t.power))
            for t in self._tracks
        }

    def _open(self, w: Window) -> None:
        if not self.running:
            raise InvalidArgumentError(
                "the measurement is not running: use it inside its with block"
            )
        key = (w.kind, w.name)
        w.index = self._counts.get(key, 0)
        self._counts[key] = w.index + 1
        w.start_s = self._clock()
        self._mark(w, is_end=False)

    def _close_window(self, w: Window) -> None:
        if w.end_s is not None:
            return
        w.end_s = self._clock()
        self._mark(w, is_end=True)
        self.windows.append(w)

    def _mark(self, w: Window, *, is_end: bool) -> None:
        """Record a stream marker for a boundary of ``w`` (none: the host time stands).

        The waiter thread starts at the first marker: ``auto`` has none until CUDA is up.
        """
        token = None if self._marker is None else self._marker.record()
        if token is None:
            return
        if self._waiter is None:
            self._waiter = threading.Thread(
                target=self._wait_marks, name="powerlib-measure-stream", daemon=True
            )
            self._waiter.start()
        self._marks.put((w, is_end, token))

    # -- sampling --------------------------------------------------------------------------------

    def poll(self) -> None:
        """Read every device once (the sampler thread calls this; so do ``manual`` tests)."""
        for track in self._tracks:
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

    def _sample_loop(self) -> None:
        next_write = self._clock() + 0.5
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
            if self._events_path is not None and self._clock() >= next_write:
                self._write_events()
                next_write = self._clock() + 0.5

    def _flush(self) -> None:
        """Read until every counter has published past the end, or the timeout.

        Past the end means an update between two reads that both began after it (a read in
        flight at the end may still show a value from before it), so the end lies before a
        knot of :mod:`~powerlib.measurement.timeline` and is interpolated, not extrapolated.
        """
        assert self.end_s is not None
        end = self.end_s
        deadline = time.monotonic() + self.flush_timeout_s
        pending = [t for t in self._tracks if t.has_counter]
        self._flushing = True
        self._wake.set()  # a sampler stretched by slow reads reads again now
        while pending and time.monotonic() < deadline:
            time.sleep(self.sample_period_s)
            pending = [t for t in pending if not _updated_after(t, end)]
        if pending:
            logger.debug("measure: %d counter(s) did not update within the flush", len(pending))

    def _wait_marks(self) -> None:
        assert self._marker is not None
        while True:
            item = self._marks.get()
            if item is None:
                return
            w, is_end, token = item
            try:
                self._marker.wait(token)
            except Exception as err:  # noqa: BLE001 - a stream error must not kill the waiter
                logger.warning("measure: waiting for a stream marker failed: %s", err)
                continue
            now = self._clock()
            if is_end:
                w.end_s = now if w.end_s is None else max(w.end_s, now)
            else:
                w.start_s = max(w.start_s, now)

    # -- results ---------------------------------------------------------------------------------

    @property
    def devices(self) -> list[Device]:
        """The devices measured."""
        return [t.device for t in self._tracks]

    def snapshot(self) -> list[dict[str, Any]]:
        """Per device so far, from the raw reads: ``device_id``, ``energy_j``, ``power_w``, ``time_s``.

        Cheap (no attribution): what ``powerlib measure --jsonl`` and the exporter publish.
        """
        out = []
        for t in self._tracks:
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

    def result(self, reduce: str = "local", *, tokens_reduce: str = "sum") -> MeasurementResult:
        """Energy per device, per window and in total.

        Args:
            reduce: ``local`` (this process) or ``world``: gathered over ``torch.distributed``
                (a collective: every rank must call it), each physical device counted once.
            tokens_reduce: For ``world``: ``sum`` the ranks' tokens (each passed its own) or take
                the ``max`` (each passed the global count).

        While the measurement runs the result is ``provisional`` (the newest windows extend past
        the last counter update, so their energy is extrapolated from power).

        Raises:
            InvalidArgumentError: Unknown ``reduce``, or ``world`` without an initialised
                process group.
        """
        if reduce not in ("local", "world"):
            raise InvalidArgumentError(f"reduce must be 'local' or 'world', got {reduce!r}")
        if tokens_reduce not in ("sum", "max"):
            raise InvalidArgumentError(
                f"tokens_reduce must be 'sum' or 'max', got {tokens_reduce!r}"
            )
        if math.isnan(self.start_s):
            raise InvalidArgumentError("the measurement has not started")
        local = self._local_result()
        if reduce == "local":
            return local
        dist = _dist()
        if dist is None:
            raise InvalidArgumentError(
                "reduce='world' needs torch.distributed initialised (init_process_group) on every rank"
            )
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local.to_json())
        return reduce_results(
            [MeasurementResult.from_json(g) for g in gathered], tokens_reduce=tokens_reduce
        )

    def _local_result(self) -> MeasurementResult:
        if self._result is not None:
            return self._result
        provisional = self.running
        end = self.end_s if self.end_s is not None else self._clock()
        windows = sorted(
            (w for w in list(self.windows) if w.end_s is not None), key=lambda w: w.start_s
        )
        bounds = np.array(
            [self.start_s, end] + [b for w in windows for b in (w.start_s, w.end_s)], dtype=float
        )
        per_device: list[DeviceEnergy] = []
        energies: list[np.ndarray] = []
        for t in self._tracks:
            tl = self._timeline(t)
            e = tl.energy_at(bounds)
            energies.append(e)
            time_s = end - self.start_s
            energy = float(e[1] - e[0])
            per_device.append(
                DeviceEnergy(
                    device_id=t.device.device_id,
                    index=t.device.index,
                    name=t.device.info.name,
                    backend=t.device.info.backend,
                    hostname=self.hostname,
                    rank=self.rank,
                    energy_j=energy,
                    time_s=time_s,
                    average_power_w=energy / time_s if time_s > 0 else None,
                    source=tl.source,
                    estimated=tl.estimated,
                    counter_resets=tl.resets,
                    counter_wraps=tl.wraps,
                    samples=tl.samples,
                )
            )
        out_windows = []
        for i, w in enumerate(windows):
            assert w.end_s is not None
            dev_e = {
                t.device.device_id: float(e[3 + 2 * i] - e[2 + 2 * i])
                for t, e in zip(self._tracks, energies)
            }
            out_windows.append(
                WindowEnergy(
                    kind=w.kind,
                    name=w.name,
                    index=w.index,
                    rank=self.rank,
                    start_s=w.start_s - self.start_s,
                    time_s=w.end_s - w.start_s,
                    energy_j=math.fsum(dev_e.values()),
                    tokens=w.tokens,
                    device_energy_j=dev_e,
                )
            )
        result = MeasurementResult(
            reduce="local",
            ranks=1,
            start_unix_s=self.start_unix_s,
            time_s=end - self.start_s,
            devices=tuple(per_device),
            windows=tuple(out_windows),
            provisional=provisional,
        )
        if not provisional:
            self._result = result
        return result

    def _timeline(self, t: _Track) -> EnergyTimeline:
        n = min(len(t.times), len(t.read_s), len(t.counter), len(t.power))
        return build_timeline(
            t.times[:n],
            t.counter[:n] if t.has_counter else None,
            t.power[:n],
            wrap_j=t.wrap_j,
            read_s=t.read_s[:n],
        )

    # -- plumbing --------------------------------------------------------------------------------

    def _open_devices(self) -> None:
        """Open the backend and the devices; without a device named, warn and measure time only.

        A backend named explicitly (an argument or ``POWERLIB_BACKEND``) that cannot open, and
        devices listed explicitly that do not exist, raise; otherwise a failure to find a device
        is one warning and no device (docs/real-gpu.md §7).
        """
        spec = self._backend_spec
        settings: Settings | None = None
        if isinstance(spec, Backend):
            named_backend = True
        else:
            settings = Settings.from_env()
            named_backend = (spec if spec is not None else settings.backend) != "auto"
        named_devices = isinstance(self._device_spec, list)
        try:
            devices = self._find_devices(settings)
        except PowerlibError as err:
            self._close_backend()
            self._backend = None
            opened = self._backend_opened
            if (named_backend and not opened) or (named_devices and opened):
                raise
            warn_no_device(str(err))
            return
        if not devices:
            self._close_backend()
            self._backend = None
            if named_backend or named_devices:
                raise InvalidArgumentError("nothing to measure: the backend has no devices")
            warn_no_device("the backend has no devices")
            return
        seen: set[str] = set()
        for d in devices:
            if d.device_id not in seen:
                seen.add(d.device_id)
                self._tracks.append(_Track(d))

    def _find_devices(self, settings: Settings | None) -> list[Device]:
        """The backend (opened here unless given) and the devices :attr:`_device_spec` names."""
        spec = self._backend_spec
        self._backend_opened = False
        if isinstance(spec, Backend):
            backend: Backend | None = spec
        elif isinstance(self._device_spec, list) and all(
            isinstance(d, Device) for d in self._device_spec
        ):
            backend = None
        else:
            from powerlib.registry import open_backend  # noqa: PLC0415

            backend = open_backend(spec, settings)
            self._own_backend = True
        self._backend = backend
        self._backend_opened = True
        if self._device_spec is None:
            assert backend is not None
            return list(backend.devices())
        if self._device_spec == LOCAL:
            from powerlib.runtime.options import local_device  # noqa: PLC0415 - runtime imports us

            assert backend is not None
            return [local_device(backend, settings or Settings.from_env())]
        devices: list[Device] = []
        for d in self._device_spec:
            if isinstance(d, Device):
                devices.append(d)
            else:
                assert backend is not None
                devices.append(backend.device(d))
        return devices

    def _close_backend(self) -> None:
        if self._own_backend and self._backend is not None:
            self._backend.close()
        self._own_backend = False

    def _write_events(self) -> None:
        """Append the windows that ended since the last write to ``events_path`` as JSON lines."""
        if self._events_path is None:
            return
        windows = self.windows[self._events_written :]
        if not windows:
            return
        self._events_written += len(windows)
        try:
            with open(self._events_path, "a", encoding="utf-8") as f:
                for w in windows:
                    f.write(
                        json.dumps(
                            {
                                "kind": w.kind,
                                "name": w.name,
                                "index": w.index,
                                "rank": self.rank,
                                "pid": os.getpid(),
                                "start_s": w.start_s,
                                "end_s": w.end_s,
                                "tokens": w.tokens,
                            }
                        )
                        + "\n"
                    )
        except OSError as err:
            logger.warning("measure: cannot append windows to %s: %s", self._events_path, err)
            self._events_path = None


def measure(
    devices: Iterable[Device | int | str] | None = None,
    **options: Any,
) -> Measurement:
    """Measure energy around a block: ``with powerlib.measure() as m:`` (see :class:`Measurement`)."""
    return Measurement(devices, **options)


def _dist() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _rank() -> int:
    dist = _dist()
    if dist is not None:
        return int(dist.get_rank())
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


#: An events line is one flat object; deeper JSON is refused before the recursive decoder.
EVENTS_MAX_DEPTH = 8


def read_events(
    path: str | os.PathLike[str], *, warn: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """The windows a child appended to an events file.

    A malformed line (not JSON, not UTF-8, nested deeper than :data:`EVENTS_MAX_DEPTH`, a
    number out of range) is skipped, and one warning says how many were and why the first was:
    the child's bad line never costs the measurement (docs/measurement.md §6).

    Args:
        path: The events file (missing: no windows).
        warn: Called with that one warning line instead of logging it.
    """
    out = []
    skipped = 0
    first = ""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    if (
                        line.count("{") + line.count("[") > EVENTS_MAX_DEPTH
                        and json_depth(line, EVENTS_MAX_DEPTH) > EVENTS_MAX_DEPTH
                    ):
                        raise ValueError(f"JSON nested more than {EVENTS_MAX_DEPTH} levels deep")
                    item = json.loads(line)
                except (ValueError, RecursionError) as err:
                    skipped += 1
                    first = first or f"line {number}: {str(err)[:200]}"
                    continue
                if isinstance(item, dict) and isinstance(item.get("start_s"), (int, float)):
                    out.append(item)
    except FileNotFoundError:
        return []
    if skipped:
        message = f"skipped {skipped} malformed line(s) of the events file {path} (first: {first})"
        if warn is not None:
            warn(message)
        else:
            logger.warning("measure: %s", message)
    return out
