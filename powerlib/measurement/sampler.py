"""One device's sampler: timestamped reads of its energy counter, power, clock and temperature.

The sessions' profile and apply phases and :mod:`powerlib.measure_api.measure` read devices the
same way (docs/measurement.md): the training thread never calls the driver; a sampler reads the
device every ``period_s`` and keeps ``(time, read duration, counter, power, clock,
temperature)``. :mod:`powerlib.measurement.timeline` turns the reads into ``E(t)`` (counter
updates located in time), and :mod:`powerlib.measurement.attribution` solves per-label power
from which spans each counter interval covered.

The sampler runs on a daemon thread against the wall clock, or, when the clock is the
emulator's virtual time (it has ``every``), as a timer of that clock: the same reads at the same
virtual instants, without a thread (docs/perseus.md §5.5).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from powerlib.device import Device
from powerlib.errors import DeviceLostError, PowerlibError
from powerlib.measurement.timeline import EnergyTimeline, build_timeline

__all__ = ["DEFAULT_SAMPLE_PERIOD_S", "BlockReading", "DeviceSampler", "first_read_showing"]

logger = logging.getLogger(__name__)

DEFAULT_SAMPLE_PERIOD_S = 0.0097
"""Between reads: a tenth of NVML's ~100 ms counter period, and not a divisor of it, so the
reads fall at every phase of the update period and the timeline's fit of the update instants
narrows below one read interval (docs/measurement.md §2)."""

MAX_READS = 1 << 20
FAILED_READS_IN_A_ROW = 20
"""Reads failing in a row (0.2 s at the default period) after which the sampler gives up."""
"""Reads kept per device (about 3 hours at the default period); older ones are dropped."""


@dataclass(frozen=True, slots=True)
class BlockReading:
    """What the device reported over a span of time: the clock it really ran, its heat.

    Attributes:
        reads: Reads inside the span.
        freq_mhz: Median SM clock over those reads (``None``: not reported).
        min_freq_mhz: Lowest SM clock read (a throttled read shows up here).
        temperature_c: Mean temperature, when reported.
    """

    reads: int
    freq_mhz: float | None
    min_freq_mhz: float | None
    temperature_c: float | None


def first_read_showing(
    times: np.ndarray,
    freqs: np.ndarray,
    freq_mhz: float,
    after_s: float,
    until_s: float = math.inf,
) -> tuple[float, float] | None:
    """When reads first showed ``freq_mhz`` after ``after_s`` (up to ``until_s``).

    Args:
        times: Read times, increasing.
        freqs: The clock each read showed (``nan``: none).
        freq_mhz: The clock looked for.
        after_s: From this time on.
        until_s: No later than this read time.

    Returns:
        ``(last other, first)``: the clock landed between the two (the first is ``after_s``
        when no read came between); ``None`` when no read shows it.
    """
    i = int(np.searchsorted(times, after_s, side="right"))
    previous = after_s
    while i < len(times) and times[i] <= until_s:
        if abs(freqs[i] - freq_mhz) < 0.5:
            return previous, float(times[i])
        previous = float(times[i])
        i += 1
    return None


class DeviceSampler:
    """Reads one device every ``period_s``, off the training thread.

    Args:
        device: The device.
        clock: Time source in seconds; a clock with ``every(period_s, callback)`` (the
            emulator's virtual time) runs the sampler as its timer instead of a thread.
        period_s: Between reads.

    Attributes:
        has_counter: The device publishes an energy counter (else power is integrated).
        duty: The share of each counter period in which the device samples power
            (:attr:`~powerlib.device.DeviceInfo.power_sampling_duty`; 1: the whole period).
    """

    def __init__(
        self,
        device: Device,
        *,
        clock: Callable[[], float] = time.perf_counter,
        period_s: float = DEFAULT_SAMPLE_PERIOD_S,
    ) -> None:
        self.device = device
        self._clock = clock
        self.period_s = period_s
        self.wrap_j: float | None = getattr(device, "energy_counter_wrap_j", None)
        self.duty = float(device.info.power_sampling_duty)
        self._lock = threading.Lock()
        self._times: list[float] = []
        self._read_s: list[float] = []
        self._counter: list[float | None] = []
        self._power: list[float | None] = []
        self._freq: list[float | None] = []
        self._temp: list[float | None] = []
        self._failures = 0
        self._in_a_row = 0
        self.failure: str | None = None
        """Why the sampler stopped reading (a lost device, or reads failing in a row), else
        ``None``: the caller stops measuring with this reason instead of blaming the counter."""
        self.has_counter = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cancel: Callable[[], None] | None = None
        self.poll()
        self.has_counter = bool(self._counter) and self._counter[-1] is not None
        every = getattr(clock, "every", None)
        if every is not None:
            self._cancel = every(period_s, self.poll)
        else:
            self._thread = threading.Thread(target=self._loop, name="powerlib-sampler", daemon=True)
            self._thread.start()

    def poll(self) -> None:
        """Read the device once (the thread or timer calls it)."""
        t0 = self._clock()
        try:
            state = self.device.read_state()
        except PowerlibError as err:
            self._failures += 1
            self._in_a_row += 1
            if self._failures in (1, 100):
                logger.warning("powerlib: reading %s failed: %s", self.device.device_id, err)
            if self.failure is None and (
                isinstance(err, DeviceLostError) or self._in_a_row >= FAILED_READS_IN_A_ROW
            ):
                self.failure = f"reading {self.device.device_id} failed: {err}"
                self._stop.set()  # a lost device, or one that keeps failing: stop asking
                if self._cancel is not None:
                    self._cancel()
                    self._cancel = None
            return
        self._in_a_row = 0
        t1 = self._clock()
        with self._lock:
            if len(self._times) >= MAX_READS:
                drop = MAX_READS // 4
                for series in (
                    self._times,
                    self._read_s,
                    self._counter,
                    self._power,
                    self._freq,
                    self._temp,
                ):
                    del series[:drop]
            self._times.append(0.5 * (t0 + t1))
            self._read_s.append(t1 - t0)
            self._counter.append(state.energy_j)
            self._power.append(state.power_w)
            self._freq.append(state.sm_freq_mhz)
            self._temp.append(state.temperature_c)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.poll()

    @property
    def reports_clock(self) -> bool:
        """Whether the reads show the SM clock (then landings are seen, not assumed)."""
        with self._lock:
            return any(f is not None for f in self._freq[-8:])

    @property
    def reads(self) -> int:
        """Reads so far."""
        return len(self._times)

    def timeline(self, since_s: float = -math.inf, *, refine: bool = True) -> EnergyTimeline:
        """``E(t)`` from the reads so far (:func:`~powerlib.measurement.timeline.build_timeline`).

        Args:
            since_s: Only reads from this time on (a short recent stretch is cheap to build).
            refine: See :func:`~powerlib.measurement.timeline.build_timeline`.
        """
        with self._lock:
            lo = int(np.searchsorted(np.asarray(self._times), since_s, side="left"))
            times, read_s = self._times[lo:], self._read_s[lo:]
            counter, power = self._counter[lo:], self._power[lo:]
        return build_timeline(
            times,
            counter if self.has_counter else None,
            power,
            wrap_j=self.wrap_j,
            read_s=read_s,
            refine=refine,
        )

    def first_clock_at(self, freq_mhz: float, after_s: float) -> tuple[float, float] | None:
        """When the reads first showed ``freq_mhz`` after ``after_s``: ``(last other, first)``.

        The clock landed between the two read times; ``None`` when no read shows it yet.
        """
        times, freqs = self.clock_reads(after_s)
        return first_read_showing(times, freqs, freq_mhz, after_s)

    def clock_reads(self, since_s: float) -> tuple[np.ndarray, np.ndarray]:
        """The read times from ``since_s`` on and the SM clock each showed (``nan``: none)."""
        with self._lock:
            lo = int(np.searchsorted(np.asarray(self._times), since_s, side="left"))
            times = np.asarray(self._times[lo:], dtype=float)
            freqs = np.asarray([math.nan if f is None else f for f in self._freq[lo:]], dtype=float)
        return times, freqs

    def temperature_reads(self) -> tuple[np.ndarray, np.ndarray]:
        """Every kept read's time and the temperature it showed (reads without one left out)."""
        with self._lock:
            pairs = [(t, c) for t, c in zip(self._times, self._temp) if c is not None]
        times = np.asarray([t for t, _ in pairs], dtype=float)
        return times, np.asarray([c for _, c in pairs], dtype=float)

    def reading(self, start_s: float, end_s: float) -> BlockReading:
        """The clock and temperature the reads in ``[start_s, end_s]`` showed."""
        with self._lock:
            times = np.asarray(self._times)
            lo = int(np.searchsorted(times, start_s, side="left"))
            hi = int(np.searchsorted(times, end_s, side="right"))
            freqs = [f for f in self._freq[lo:hi] if f is not None]
            temps = [t for t in self._temp[lo:hi] if t is not None]
        return BlockReading(
            reads=hi - lo,
            freq_mhz=float(np.median(freqs)) if freqs else None,
            min_freq_mhz=min(freqs) if freqs else None,
            temperature_c=float(np.mean(temps)) if temps else None,
        )

    def close(self) -> None:
        """Stop reading. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._cancel is not None:
            self._cancel()
            self._cancel = None
