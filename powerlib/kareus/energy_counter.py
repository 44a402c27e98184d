"""Cumulative energy of one device: its hardware counter, or power integrated over time.

Kareus's partition meter (:class:`~powerlib.kareus.meter.SpanMeter`) reads every device
through one :class:`EnergyMeter`. (The sessions' profile and apply phases read devices through
the engine's :class:`~powerlib.measurement.sampler.DeviceSampler` instead.)

Most GPUs (NVIDIA Volta and newer, AMD MI-series) and every RAPL domain have an energy counter;
an instruction's energy is the difference of two reads. A device that only reports power gets
the fallback: a sampler thread reads ``power_w`` every ``sample_period_s`` and integrates it
(rectangle rule, extended to the moment of the read), so a read costs no driver call.

A counter publishes a new value only every so often (NVML and the simulator: about every 100 ms),
so the difference of two reads taken closer together than that is mostly zero or one whole update.
The meter therefore also watches its own reads: how often the value changed between two reads
tells how often the counter updates (:meth:`EnergyMeter.resolution`,
:func:`~powerlib.measurement.counter_period.estimate_counter_period_s`), and from that period, an
instruction's length and the number of samples, :func:`energy_error` bounds how well the profile
resolves the instruction's energy.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from powerlib.device import Device
from powerlib.errors import NotSupportedError, PowerlibError
from powerlib.measurement.counter_period import estimate_counter_period_s

__all__ = ["CounterResolution", "EnergyMeter", "energy_error"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CounterResolution:
    """How finely a device's energy counter moved under the meter's reads.

    Attributes:
        intervals: Intervals between consecutive reads (of positive length).
        changes: Of those, how many saw the counter move.
        period_s: Estimated update period of the counter (see
            :func:`~powerlib.measurement.counter_period.estimate_counter_period_s`); ``None``
            when energy is integrated from power or too few reads were made.
        at_most: ``period_s`` is an upper bound (every read saw a new value).
    """

    intervals: int
    changes: int
    period_s: float | None
    at_most: bool = False

    def to_json(self) -> dict[str, object]:
        """``{"intervals", "changes", "period_s", "at_most"}``."""
        return {
            "intervals": self.intervals,
            "changes": self.changes,
            "period_s": self.period_s,
            "at_most": self.at_most,
        }


def energy_error(time_s: float, period_s: float, samples: int) -> float:
    """Bound on the relative standard error of a mean instruction energy read off a counter.

    An instruction of ``time_s`` spans ``r = time_s / period_s`` counter updates on average, but
    sees a whole number of them each time, at a random phase: ``floor(r)`` or one more, whose
    standard deviation is at most one half, and at most ``sqrt(r)`` when ``r < 1`` (mostly
    none, sometimes one). Over ``samples`` independent samples the error of the mean is at most
    ``min(0.5, sqrt(r)) / (r * sqrt(samples))`` of the energy.

    Args:
        time_s: The instruction's (mean) time.
        period_s: The counter's update period.
        samples: How many times it was measured.

    Returns:
        The bound, as a fraction (``inf`` for a zero time or no samples).
    """
    if time_s <= 0 or samples <= 0:
        return math.inf
    if period_s <= 0:
        return 0.0
    updates = time_s / period_s
    return min(0.5, math.sqrt(updates)) / (updates * math.sqrt(samples))


class EnergyMeter:
    """Reads a device's cumulative energy in joules.

    Args:
        device: The device.
        clock: Time source in seconds (the session's; the emulator's virtual time).
        sample_period_s: Sampling period of the power-integration fallback.

    Attributes:
        integrated: True when energy is integrated from power readings (no counter).

    Raises:
        NotSupportedError: The device reports neither energy nor power.
    """

    def __init__(
        self,
        device: Device,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sample_period_s: float = 0.01,
    ) -> None:
        self._device = device
        self._clock = clock
        state = device.read_state()
        self.integrated = state.energy_j is None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_read: tuple[float, float] | None = None  # (time, value) of the latest read
        self._intervals_s: list[float] = []
        self._changes = 0
        if not self.integrated:
            return
        if state.power_w is None:
            raise NotSupportedError(
                f"{device.info.name} reports neither an energy counter nor power, so instruction "
                "energy cannot be measured",
                device=device.device_id,
            )
        self._energy_j = 0.0
        self._last_t = clock()
        self._last_w = state.power_w
        self._period_s = sample_period_s
        self._thread = threading.Thread(target=self._sample, name="powerlib-power", daemon=True)
        self._thread.start()

    def read_j(self, at_s: float | None = None) -> float:
        """Cumulative energy now (only differences are meaningful).

        Args:
            at_s: The caller's clock reading for this read (default: the meter reads its
                clock); used to watch the counter's resolution.
        """
        if not self.integrated:
            now = self._clock() if at_s is None else at_s
            energy = self._device.read_state().energy_j
            assert energy is not None
            last = self._last_read
            if last is not None and now > last[0]:
                self._intervals_s.append(now - last[0])
                if energy != last[1]:
                    self._changes += 1
            self._last_read = (now, energy)
            return energy
        with self._lock:
            return self._energy_j + self._last_w * (self._clock() - self._last_t)

    def resolution(self) -> CounterResolution:
        """How often the counter moved between this meter's reads so far, and its period."""
        if self.integrated:  # a model of power over time: no update steps to resolve
            return CounterResolution(intervals=0, changes=0, period_s=None)
        estimate = estimate_counter_period_s(self._intervals_s, self._changes)
        return CounterResolution(
            intervals=len(self._intervals_s),
            changes=self._changes,
            period_s=None if estimate is None else estimate[0],
            at_most=False if estimate is None else estimate[1],
        )

    def close(self) -> None:
        """Stop the sampler (if any). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _sample(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                power = self._device.read_state().power_w
            except PowerlibError as err:
                logger.warning("power sampling of %s failed: %s", self._device.device_id, err)
                continue
            with self._lock:
                now = self._clock()
                self._energy_j += self._last_w * (now - self._last_t)
                self._last_t = now
                if power is not None:
                    self._last_w = power
