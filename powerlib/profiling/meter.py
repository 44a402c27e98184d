"""Cumulative energy of one device: its hardware counter, or power integrated over time.

Most GPUs (NVIDIA Volta and newer, AMD MI-series) and every RAPL domain have an energy counter;
an instruction's energy is the difference of two reads. A device that only reports power gets
the fallback: a sampler thread reads ``power_w`` every ``sample_period_s`` and integrates it
(rectangle rule, extended to the moment of the read), so a read costs no driver call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from powerlib.device import Device
from powerlib.errors import NotSupportedError, PowerlibError

__all__ = ["EnergyMeter"]

logger = logging.getLogger(__name__)


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

    def read_j(self) -> float:
        """Cumulative energy now (only differences are meaningful)."""
        if not self.integrated:
            energy = self._device.read_state().energy_j
            assert energy is not None
            return energy
        with self._lock:
            return self._energy_j + self._last_w * (self._clock() - self._last_t)

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
