"""The per-device frequency controller: the training thread hands over, a worker calls the driver.

NVML clock calls take milliseconds (10-20 ms per call reported; docs/vendor-calls.md, "Call
latency"), longer than the gap between two pipeline instructions. :class:`FrequencyController`
keeps them off the training thread: :meth:`request` stores the wanted frequency in a one-slot mailbox and wakes the worker;
the worker applies the *latest* request (older ones that were never applied are dropped) and
skips a request equal to what the device already runs. Every change goes through
:meth:`ControlSession.apply_sm_clocks <powerlib.control.ControlSession.apply_sm_clocks>`, so it is
journaled first and a driver error degrades to "reset and keep training" with one warning.
A change that failed is kept in :attr:`FrequencyController.applied` with ``ok=False`` and the
reason the control session recorded (``ControlSession.degraded``); the session's phases stop on
it, on every rank (docs/real-gpu.md §2-§3), and :meth:`FrequencyController.stop` then keeps the
device at its baseline for the rest of the session.

``threaded=False`` applies each request on the caller's thread instead: the emulator uses it,
because virtual time has no second thread to overlap with.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from powerlib.control import ControlSession
from powerlib.device import Device
from powerlib.errors import PowerlibError

__all__ = ["AppliedChange", "FrequencyController"]

logger = logging.getLogger(__name__)

_RESET = -1.0  # mailbox value: unlock the clocks


@dataclass(frozen=True, slots=True)
class AppliedChange:
    """One driver call the controller made.

    Attributes:
        freq_mhz: The locked frequency, or ``None`` for a reset (clocks unlocked).
        time_s: When it was applied (the session's clock).
        ok: False if the driver refused (the device was then reset and left alone).
        reason: Why it failed (``None`` when ``ok``).
    """

    freq_mhz: float | None
    time_s: float
    ok: bool
    reason: str | None = None

    def failure(self) -> str:
        """One line: what could not be done and why (for a change that failed)."""
        what = "reset its clocks" if self.freq_mhz is None else f"set {self.freq_mhz:g} MHz"
        return f"could not {what}: {self.reason or 'the driver refused the change'}"


class FrequencyController:
    """Applies frequency requests for one device, asynchronously by default.

    Args:
        control: The session that journals and restores every change.
        device: The device to control.
        threaded: Apply on a worker thread (default) or on the caller's thread.
        clock: Time source for the log (seconds).
    """

    def __init__(
        self,
        control: ControlSession,
        device: Device,
        *,
        threaded: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._control = control
        self._device = device
        self._clock = clock
        self._threaded = threaded
        self._cond = threading.Condition(threading.Lock())
        self._pending: float | None = None  # mailbox: latest unapplied request
        self._after: object = None  # stream marker the pending request waits for
        self._busy = False
        self._stopping = False
        self._stopped = False  # stop(): no more requests, the device stays at its baseline
        self._last_requested: float | None = None
        self._current: float | None = None  # what the device runs (as far as we set it)
        self.applied: list[AppliedChange] = []
        self.marker: Any = None
        """The stream-marker kind (``record``/``wait``) that ``after`` tokens come from."""
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(
                target=self._run, name=f"powerlib-freq-{device.index}", daemon=True
            )
            self._thread.start()

    @property
    def last_requested(self) -> float | None:
        """The latest requested frequency (``None`` after a reset or before any request)."""
        return self._last_requested

    @property
    def device(self) -> Device:
        """The controlled device."""
        return self._device

    def request(self, freq_mhz: float, *, after: object = None) -> None:
        """Ask for ``freq_mhz``; returns at once. A repeat of the last request costs nothing.

        Args:
            freq_mhz: The clock.
            after: A marker on the device's stream (a CUDA event the caller recorded): the
                worker waits until the device reaches it before calling the driver, so the
                clock does not land on work queued before it, and the training thread never
                synchronizes (issue 32, point 4).
        """
        if freq_mhz == self._last_requested or self._stopped:
            return
        self._last_requested = freq_mhz
        if not self._threaded:
            self._apply(freq_mhz)
            return
        with self._cond:
            self._pending = freq_mhz
            self._after = after
            self._cond.notify()

    def reset(self) -> None:
        """Unlock the clocks (after any pending request)."""
        self._last_requested = None
        if not self._threaded:
            self._apply(_RESET)
            return
        with self._cond:
            self._pending = _RESET
            self._cond.notify()

    def stop(self) -> None:
        """Reset the clocks and ignore every later request (this rank's device failed).

        A reset (:meth:`reset`) still goes through; nothing locks the device again.
        """
        self.reset()
        self._stopped = True

    @property
    def stopped(self) -> bool:
        """:meth:`stop` was called."""
        return self._stopped

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Block until every request made so far has been applied (tests, phase changes)."""
        if not self._threaded:
            return True
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Apply what is pending, then stop the worker. Idempotent."""
        if self._thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._stopping:
                    self._cond.wait()
                if self._pending is None:  # stopping, nothing left
                    return
                freq, self._pending = self._pending, None
                after, self._after = self._after, None
                self._busy = True
            try:
                if after is not None and self.marker is not None:
                    self.marker.wait(after)
                self._apply(freq)
            except Exception as err:  # the worker must outlive a bad request; training goes on
                logger.exception("frequency request %s for %s failed", freq, self._device.device_id)
                # recorded as failed: the session's phases stop on it (the training thread sees it)
                self.applied.append(
                    AppliedChange(
                        None if freq == _RESET else freq,
                        self._clock(),
                        False,
                        f"{type(err).__name__}: {err}",
                    )
                )
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _apply(self, freq_mhz: float) -> None:
        if freq_mhz == _RESET:
            reason: str | None = None
            try:
                self._control.reset_sm_clocks(self._device)
                ok = True
            except PowerlibError as err:
                logger.warning("could not reset the clocks of %s: %s", self._device.device_id, err)
                ok = False
                reason = str(err)
            self._current = None
            self.applied.append(AppliedChange(None, self._clock(), ok, reason))
            return
        if freq_mhz == self._current:
            return  # no-op change
        ok = self._control.apply_sm_clocks(self._device, freq_mhz)
        self._current = freq_mhz if ok else None
        self.applied.append(
            AppliedChange(freq_mhz, self._clock(), ok, None if ok else self._degraded_reason())
        )

    def _degraded_reason(self) -> str | None:
        """Why the control session gave up on the device (``ControlSession.degraded``), if known."""
        degraded = getattr(self._control, "degraded", None)
        if not isinstance(degraded, Mapping):
            return None
        why = degraded.get(self._device.device_id)
        return None if why is None else str(why)
