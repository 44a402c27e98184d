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
microsecond, ``benchmarks/measure_overhead.py``). A sampler thread
(:mod:`powerlib.measurement.reader`) reads every device's energy counter and power every
``sample_period_s``; energy is attributed to the windows afterwards by
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

import logging
import math
import os
import queue
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from powerlib.backend import Backend
from powerlib.config import launcher_rank, measure_events_path
from powerlib.device import Device
from powerlib.errors import InvalidArgumentError
from powerlib.measure_api.events import write_events
from powerlib.measure_api.result import (
    DeviceEnergy,
    MeasurementResult,
    WindowEnergy,
    reduce_results,
)
from powerlib.measurement.markers import StreamMarker, cuda_marker
from powerlib.measurement.reader import LOCAL, DeviceReads, open_devices

__all__ = [
    "Measurement",
    "Window",
    "active_measurements",
    "measure",
]

logger = logging.getLogger(__name__)

_STREAM_TIMEOUT_S = 30.0
"""How long the exit waits for the device stream to reach its last marker."""

_ACTIVE: weakref.WeakSet[Measurement] = weakref.WeakSet()


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
            devices if devices is None or devices == LOCAL else list(devices)
        )
        self._backend_spec = backend
        self.sample_period_s = float(sample_period_s)
        self._clock = clock if clock is not None else time.monotonic
        self._align = align
        self._sampler_mode = sampler
        self.flush_timeout_s = float(flush_timeout_s)
        if events_path is False:  # powerlib measure itself: it reads the file, never writes it
            self._events_path: Path | None = None
        elif events_path is None or events_path is True:
            self._events_path = measure_events_path()
        else:
            self._events_path = Path(events_path)
        self._marker_override = stream_marker
        self._backend: Backend | None = None
        self._own_backend = False
        self._reads = DeviceReads([], self._clock, self.sample_period_s)
        self.windows: list[Window] = []
        """Closed windows, in the order they ended."""
        self._counts: dict[tuple[str, str], int] = {}
        self._open_steps: list[Window] = []
        self._marker: StreamMarker | None = None
        self._marks: queue.SimpleQueue[tuple[Window, bool, object] | None] = queue.SimpleQueue()
        self._waiter: threading.Thread | None = None
        self._events_written = 0
        self._next_events_s = math.inf
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
        opened = open_devices(self._device_spec, self._backend_spec)
        self._backend, self._own_backend = opened.backend, opened.own_backend
        try:
            self._reads = DeviceReads(opened.devices, self._clock, self.sample_period_s)
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
            self._next_events_s = self._clock() + 0.5
            self._reads.start(on_tick=self._tick)
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
        self._reads.stop(self.end_s, self.flush_timeout_s)
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
        return self._reads.power_series(self.start_s)

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
        self._reads.poll()

    def _tick(self) -> None:
        """After each round of the sampler thread: append new windows every half second."""
        if self._events_path is not None and self._clock() >= self._next_events_s:
            self._write_events()
            self._next_events_s = self._clock() + 0.5

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
        return self._reads.devices

    def snapshot(self) -> list[dict[str, Any]]:
        """Per device so far, from the raw reads: ``device_id``, ``energy_j``, ``power_w``, ``time_s``.

        Cheap (no attribution): what ``powerlib measure --jsonl`` and the exporter publish.
        """
        return self._reads.snapshot()

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
        for t in self._reads.tracks:
            tl = self._reads.timeline(t)
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
                for t, e in zip(self._reads.tracks, energies)
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

    # -- plumbing --------------------------------------------------------------------------------

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
            write_events(self._events_path, windows, self.rank)
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
    return launcher_rank()
