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

A request may be *delayed* (``delay_s``): applied that long after its stream marker is reached
(or after the call, without one), so that a clock change requested ahead lands when the next
instruction starts (the apply phase's request ahead, docs/runtime.md "Requesting clocks
ahead"). A delayed request waits beside the immediate one (it never drops an immediate request
still pending); a later immediate request supersedes it, and one for the same clock applies that
clock at once instead (threaded, when it carries no marker: the worker cannot wait for two
markers, and the delayed one was placed to land first). Inline, a delayed request needs a
timer: ``schedule_at`` (the emulator's :meth:`VirtualTime.at
<powerlib.emulator.device.VirtualTime.at>`, taken from ``clock`` when it has one); without one
it is applied at once.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from powerlib.control import ControlSession
from powerlib.device import Device
from powerlib.errors import InvalidArgumentError, PowerlibError

__all__ = ["AppliedChange", "FrequencyController"]

logger = logging.getLogger(__name__)

_RESET = -1.0  # mailbox value: unlock the clocks

ScheduleAt = Callable[[float, Callable[[], None]], Callable[[], None]]
"""``schedule_at(t_s, callback)`` calls ``callback`` at time ``t_s``; returns a cancel function."""


@dataclass(frozen=True, slots=True, eq=False)
class _Delayed:
    """A delayed request: its clock, stream marker, delay, and when it was made (monotonic)."""

    freq_mhz: float
    after: object
    delay_s: float
    made_s: float


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
        schedule_at: Inline only: the timer a delayed request waits on; default ``clock.at``
            when the clock has one (the emulator's virtual time), else none (applied at once).
    """

    def __init__(
        self,
        control: ControlSession,
        device: Device,
        *,
        threaded: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        schedule_at: ScheduleAt | None = None,
    ) -> None:
        self._control = control
        self._device = device
        self._clock = clock
        self._threaded = threaded
        self._cond = threading.Condition(threading.Lock())
        self._pending: float | None = None  # mailbox: latest unapplied request
        self._after: object = None  # stream marker the pending request waits for
        self._delayed: _Delayed | None = None  # a delayed request not applied yet
        self._cancel_timer: Callable[[], None] | None = None  # inline: its timer
        if schedule_at is None and not threaded:
            schedule_at = getattr(clock, "at", None)
        self._schedule_at = schedule_at
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

    @property
    def delayed_mhz(self) -> float | None:
        """The clock of the delayed request not applied yet (``None``: there is none)."""
        delayed = self._delayed
        return None if delayed is None else delayed.freq_mhz

    def request(self, freq_mhz: float, *, after: object = None, delay_s: float = 0.0) -> None:
        """Ask for ``freq_mhz``; returns at once. A repeat of the last request costs nothing.

        Args:
            freq_mhz: The clock.
            after: A marker on the device's stream (a CUDA event the caller recorded): the
                worker waits until the device reaches it before calling the driver, so the
                clock does not land on work queued before it, and the training thread never
                synchronizes (issue 32, point 4).
            delay_s: Apply it this long after ``after`` is reached (after this call without a
                marker): a delayed request (see the module doc). 0: as soon as it can be.

        Raises:
            InvalidArgumentError: ``delay_s`` is negative or not finite.
        """
        if not (math.isfinite(delay_s) and delay_s >= 0):
            raise InvalidArgumentError(f"delay_s must be a finite number >= 0, not {delay_s}")
        if self._stopped:
            return
        if delay_s > 0:
            self._request_delayed(_Delayed(freq_mhz, after, delay_s, time.monotonic()))
            return
        delayed = self._delayed
        now = delayed is not None and delayed.freq_mhz == freq_mhz
        if freq_mhz == self._last_requested and not (now and (not self._threaded or after is None)):
            return
        self._last_requested = freq_mhz
        if not self._threaded:
            self._drop_delayed()
            self._apply(freq_mhz)
            return
        with self._cond:
            self._pending = freq_mhz
            self._after = after
            self._delayed = None  # superseded (or, for its clock, applied now)
            self._cond.notify()

    def _request_delayed(self, delayed: _Delayed) -> None:
        if delayed.freq_mhz == self._last_requested:
            return  # asked for already: applied, or on its way
        self._last_requested = delayed.freq_mhz
        if self._threaded:
            with self._cond:
                self._delayed = delayed  # beside a pending immediate request, not instead
                self._cond.notify()
            return
        self._drop_delayed()
        if self._schedule_at is None:
            self._apply(delayed.freq_mhz)
            return
        self._delayed = delayed
        self._cancel_timer = self._schedule_at(
            self._clock() + delayed.delay_s, lambda: self._fire(delayed)
        )

    def _fire(self, delayed: _Delayed) -> None:
        """Inline: the timer of ``delayed`` is due; apply it unless it was superseded."""
        if self._delayed is delayed and not self._stopped:
            self._delayed = self._cancel_timer = None
            self._apply(delayed.freq_mhz)

    def _drop_delayed(self) -> None:
        """Inline: forget the delayed request and cancel its timer."""
        cancel, self._cancel_timer, self._delayed = self._cancel_timer, None, None
        if cancel is not None:
            cancel()

    def reset(self) -> None:
        """Unlock the clocks (after any pending request; a delayed one is dropped)."""
        self._last_requested = None
        if not self._threaded:
            self._drop_delayed()
            self._apply(_RESET)
            return
        with self._cond:
            self._pending = _RESET
            self._delayed = None
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
            while self._pending is not None or self._delayed is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Apply what is pending, then stop the worker. Idempotent.

        A delayed request is dropped: it was for an instruction that will not run.
        """
        if self._thread is None:
            self._drop_delayed()
            return
        with self._cond:
            self._stopping = True
            self._delayed = None
            self._cond.notify_all()
        self._thread.join()
        self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and self._delayed is None and not self._stopping:
                    self._cond.wait()
                delayed = None
                if self._pending is not None:
                    freq, self._pending = self._pending, None
                    after, self._after = self._after, None
                elif self._delayed is not None:
                    delayed = self._delayed
                    freq, after = delayed.freq_mhz, delayed.after
                else:  # stopping, nothing left
                    return
                self._busy = True
            try:
                waited = after is not None and self.marker is not None
                if waited:
                    self.marker.wait(after)
                if delayed is None or self._delay_over(delayed, marked=waited):
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

    def _delay_over(self, delayed: _Delayed, *, marked: bool) -> bool:
        """Wait out ``delayed``'s delay (from now, its marker reached, or from its request).

        Returns:
            True if it is still wanted then (it is taken), False if superseded meanwhile.
        """
        deadline = (time.monotonic() if marked else delayed.made_s) + delayed.delay_s
        with self._cond:
            while self._delayed is delayed:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._delayed = None
                    return True
                self._cond.wait(left)
        return False

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
