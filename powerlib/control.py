"""Change device settings so that they are always put back.

A :class:`ControlSession` is the only way powerlib changes clocks and power limits on behalf of a
job. Before its first change of an item on a device it

1. takes the device's lock (a second controller gets ``DeviceBusyError`` naming the owner's pid),
2. restores any journal a dead owner left for that device,
3. reads the original value and writes it, fsynced, to the device's journal,

and only then makes the change. It restores the captured originals — not defaults — when the
``with`` block ends (normally or by an exception, ``KeyboardInterrupt`` included), at interpreter
exit, and on SIGTERM or SIGHUP (its handlers chain to those the host program installed). A process
killed by SIGKILL, the OOM killer or a crash leaves its journal behind; ``powerlib restore``, the
next session that touches the device, or the optional guardian process put the device back.

Restores compare before they write (the GROMACS rule): a power limit that someone else changed
after powerlib set it is left alone and reported. Restores continue past failures and report each
one; a journal whose restore failed stays in place for a later ``powerlib restore``. How a device
is put back, and how the journals a dead session left are read and trusted, is
:mod:`powerlib.restore`; its names are importable from here too.

During training, :meth:`ControlSession.apply_sm_clocks` never raises on a driver error: it resets
the device's clocks (the safe state), warns once, and ignores later requests for that device, so
the job keeps running.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from powerlib.config import Settings
from powerlib.device import Backend, Device
from powerlib.errors import (
    DeviceBusyError,
    DeviceNotFoundError,
    InvalidArgumentError,
    PowerlibError,
)
from powerlib.journal import (
    Change,
    DeviceLock,
    JournalEntry,
    JournalError,
    Owner,
    StateDir,
    device_key,
    now_s,
)
from powerlib.restore import (
    RestoreOutcome,
    restore_and_discard,
    restore_device,
    restore_failure,
    restore_journals,
)

__all__ = [
    "ensure_not_controlled",
    "ControlSession",
    "RestoreOutcome",
    "restore_device",
    "restore_failure",
    "restore_journals",
]

logger = logging.getLogger(__name__)

_HANDLED_SIGNALS = tuple(
    s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None
)


def _backend_settings(backend: Backend) -> dict[str, Any]:
    s = backend.settings
    return {"sysfs_root": str(s.sysfs_root), "sim_model": s.sim_model, "sim_gpus": s.sim_gpus}


@dataclass
class _Controlled:
    device: Device
    lock: DeviceLock | None
    entry: JournalEntry


# -- process-wide safety nets ---------------------------------------------------------------------

_ACTIVE: list[ControlSession] = []
_ACTIVE_GUARD = threading.RLock()
_PREVIOUS_HANDLERS: dict[int, Any] = {}
_ATEXIT_REGISTERED = False


def _restore_all(reason: str) -> None:
    with _ACTIVE_GUARD:
        sessions = list(_ACTIVE)
    for session in reversed(sessions):
        logger.info("restoring devices: %s", reason)
        session.close()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    previous = _PREVIOUS_HANDLERS.get(signum, signal.SIG_DFL)  # read first: closing unregisters
    _restore_all(f"signal {signal.Signals(signum).name}")
    if callable(previous):
        previous(signum, frame)  # the host program's handler decides what happens next
        return
    raise SystemExit(128 + signum)  # the default action terminates; let finally blocks run


def _register_atexit() -> None:
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        atexit.register(_restore_all, "interpreter exit")
        _ATEXIT_REGISTERED = True


def _install_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        logger.debug("not in the main thread: signal handlers not installed (atexit still is)")
        return
    for signum in _HANDLED_SIGNALS:
        current = signal.getsignal(signum)
        if current is _on_signal or current is signal.SIG_IGN:
            continue  # already ours, or the host ignores it: then so do we
        _PREVIOUS_HANDLERS[signum] = current
        signal.signal(signum, _on_signal)


def _remove_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, previous in list(_PREVIOUS_HANDLERS.items()):
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        del _PREVIOUS_HANDLERS[signum]


class ControlSession:
    """The one controller of some devices: every change is journaled and put back.

    Args:
        backend: The open backend whose devices the session may change.
        guardian: Start a watchdog process that restores the devices within about a second of
            this process dying, even by SIGKILL.
        handle_signals: Install SIGTERM/SIGHUP handlers (main thread only; chained).

    Example::

        with powerlib.open_backend() as backend, ControlSession(backend) as session:
            session.lock_sm_clocks(0, 1200)
            train()
    """

    def __init__(
        self, backend: Backend, *, guardian: bool = False, handle_signals: bool = True
    ) -> None:
        self.backend = backend
        self.settings = backend.settings
        self._state = StateDir(self.settings.state_dir)
        self._owner = Owner.current()
        self._controlled: dict[str, _Controlled] = {}
        self._guard = threading.RLock()
        self._degraded: set[str] = set()
        self._use_guardian = guardian
        self._handle_signals = handle_signals
        self._guardian: subprocess.Popen[bytes] | None = None
        self._is_open = False

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> ControlSession:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> ControlSession:
        """Register the safety nets (and start the guardian). Called by ``__enter__``."""
        if self._is_open:
            return self
        if self._use_guardian and self.backend.persistent:
            self._state.prepare()
            self._guardian = _start_guardian(self.settings, self._owner)
        with _ACTIVE_GUARD:
            _ACTIVE.append(self)
            _register_atexit()
            if self._handle_signals:
                _install_signal_handlers()
        self._is_open = True
        return self

    def close(self) -> list[RestoreOutcome]:
        """Restore every device and release the locks. Idempotent; never raises."""
        outcomes = self.restore()
        with _ACTIVE_GUARD:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            if not _ACTIVE:
                _remove_signal_handlers()
        if self._guardian is not None:
            _stop_guardian(self._guardian)
            self._guardian = None
        self._is_open = False
        return outcomes

    @property
    def controlled_devices(self) -> list[str]:
        """Ids of the devices this session has changed and not yet restored."""
        return list(self._controlled)

    # -- changes ---------------------------------------------------------------------------------

    def lock_sm_clocks(
        self, device: int | str | Device, min_mhz: float, max_mhz: float | None = None
    ) -> tuple[float, float]:
        """Journal, then lock SM clocks (see :meth:`Device.lock_sm_clocks`)."""
        dev = self._resolve(device)
        lo, hi = dev.validate_sm_clocks(
            min_mhz, max_mhz
        )  # bad input changes nothing, not even a journal
        self._record(dev, "sm_clocks", None)
        return dev.lock_sm_clocks(lo, hi)

    def reset_sm_clocks(self, device: int | str | Device) -> None:
        """Journal, then unlock SM clocks."""
        dev = self._resolve(device)
        self._record(dev, "sm_clocks", None)
        dev.reset_sm_clocks()

    def lock_memory_clocks(
        self, device: int | str | Device, min_mhz: float, max_mhz: float | None = None
    ) -> tuple[float, float]:
        """Journal, then lock memory clocks."""
        dev = self._resolve(device)
        self._record(dev, "memory_clocks", None)
        return dev.lock_memory_clocks(min_mhz, max_mhz)

    def set_power_limit(self, device: int | str | Device, power_limit_w: float) -> float:
        """Journal, then set the power limit."""
        dev = self._resolve(device)
        dev.validate_power_limit(power_limit_w)
        self._record(dev, "power_limit", float(power_limit_w))
        return dev.set_power_limit(power_limit_w)

    def reset_power_limit(self, device: int | str | Device) -> None:
        """Journal, then restore the default power limit."""
        dev = self._resolve(device)
        if dev.info.default_power_limit_w is not None:
            self._record(dev, "power_limit", dev.info.default_power_limit_w)
        dev.reset_power_limit()

    def apply_sm_clocks(self, device: int | str | Device, freq_mhz: float) -> bool:
        """Lock the SM clock for training; never raises on a device or driver error.

        On an error the device's clocks are reset (its safe state), one warning is issued, and
        later requests for that device are ignored, so the training job keeps running.

        Returns:
            True if the clock was applied.

        Raises:
            InvalidArgumentError: ``freq_mhz`` is out of range (a bug in the caller, not the driver).
        """
        dev = self._resolve(device)
        if dev.device_id in self._degraded:
            return False
        try:
            self.lock_sm_clocks(dev, freq_mhz)
            return True
        except InvalidArgumentError:
            raise
        except DeviceBusyError as err:
            # Another session owns the device: its clocks are that session's to restore, so
            # they are not touched here (a reset would undo the other session's lock).
            self._degraded.add(dev.device_id)
            message = (
                f"powerlib leaves {dev.info.name} ({dev.device_id}) alone for this session: {err}; "
                "training continues"
            )
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            return False
        except PowerlibError as err:
            self._degraded.add(dev.device_id)
            try:
                dev.reset_sm_clocks()
                state = "its clocks were reset"
            except PowerlibError as reset_err:
                state = f"resetting its clocks failed too ({reset_err})"
            message = (
                f"powerlib stops changing {dev.info.name} ({dev.device_id}) for this session after "
                f"a driver error: {err}; {state}; training continues"
            )
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            return False

    # -- restore ---------------------------------------------------------------------------------

    def restore(self) -> list[RestoreOutcome]:
        """Put every changed device back now (the session stays usable). Never raises."""
        outcomes: list[RestoreOutcome] = []
        with self._guard:
            for device_id in reversed(list(self._controlled)):
                ctl = self._controlled.pop(device_id)
                journal = None if ctl.lock is None else self._state.journal_path(ctl.entry.key)
                results = restore_and_discard(ctl.device, ctl.entry.changes, self._state, journal)
                outcomes.extend(results)
                if not all(r.ok for r in results):
                    failed = "; ".join(r.action for r in results if not r.ok)
                    logger.error(
                        "could not restore %s: %s; its journal is kept for `powerlib restore`",
                        device_id,
                        failed,
                    )
                if ctl.lock is not None:
                    ctl.lock.release()
        return outcomes

    # -- internals -------------------------------------------------------------------------------

    def _resolve(self, device: int | str | Device) -> Device:
        if isinstance(device, Device):
            if device not in self.backend.devices():
                raise DeviceNotFoundError(
                    "the device does not belong to this session's backend", device=device.device_id
                )
            return device
        return self.backend.device(device)

    def _record(self, dev: Device, item: str, target: Any) -> None:
        """Journal-before-write: capture the original of ``item`` once, durably."""
        with self._guard:
            if not self._is_open:
                self.start()
            ctl = self._controlled.get(dev.device_id) or self._take(dev)
            existing = ctl.entry.change(item)
            if existing is not None and (item != "power_limit" or existing.target == target):
                return  # original already journaled; clock changes do not rewrite the journal
            original = existing.original if existing is not None else self._capture(dev, item)
            entry = ctl.entry.with_change(Change(item=item, original=original, target=target))
            if ctl.lock is not None:
                self._state.write_journal(entry)
            ctl.entry = entry

    def _take(self, dev: Device) -> _Controlled:
        lock = None
        if self.backend.persistent:
            self._state.prepare()  # refuses before any change if the state dir is unusable
            key = device_key(dev.info.backend, dev.device_id)
            lock = DeviceLock(self._state, key)
            lock.acquire(self._owner)
            try:
                self._recover(dev, key)
            except BaseException:
                lock.release()
                raise
        entry = JournalEntry(
            device_id=dev.device_id,
            device_name=dev.info.name,
            backend=dev.info.backend,
            backend_settings=_backend_settings(self.backend),
            owner=self._owner,
            created_s=now_s(),
        )
        ctl = _Controlled(device=dev, lock=lock, entry=entry)
        self._controlled[dev.device_id] = ctl
        return ctl

    def _recover(self, dev: Device, key: str) -> None:
        """Restore a journal a dead owner left for this device (we hold its lock now)."""
        if not self._state.has_journal(key):
            return
        path = self._state.journal_path(key)
        entry = self._state.read_journal(path)  # JournalError: refuse to guess the original state
        logger.warning(
            "%s: restoring what pid %d left behind (journal %s)",
            dev.device_id,
            entry.owner.pid,
            path,
        )
        results = restore_and_discard(dev, entry.changes, self._state, path)
        if not all(r.ok for r in results):
            raise JournalError(
                f"could not restore the state pid {entry.owner.pid} left on {dev.device_id}: "
                + "; ".join(r.action for r in results if not r.ok),
                device=dev.device_id,
            )

    def _capture(self, dev: Device, item: str) -> Any:
        st = dev.read_state()
        if item == "sm_clocks":
            return None if st.locked_sm_freqs_mhz is None else list(st.locked_sm_freqs_mhz)
        if item == "power_limit":
            if st.power_limit_w is None:
                raise InvalidArgumentError(
                    "the current power limit cannot be read, so it could not be restored; refusing to change it",
                    device=dev.device_id,
                )
            return st.power_limit_w
        return None  # memory clock locks cannot be read back: restore means unlock


# -- the guardian ----------------------------------------------------------------------------------


def _start_guardian(settings: Settings, owner: Owner) -> subprocess.Popen[bytes]:
    """Start ``python -m powerlib.guardian`` in its own session, holding a pipe from us."""
    env = dict(os.environ, POWERLIB_STATE_DIR=str(settings.state_dir))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "powerlib.guardian",
            "--owner-pid",
            str(owner.pid),
            "--owner-start-time",
            repr(owner.start_time_s),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # survives a Ctrl-C or kill of our process group
        close_fds=True,
        cwd="/",  # `-m` puts the cwd first on sys.path: never let a job's folder shadow powerlib
        env=env,
    )


def _stop_guardian(proc: subprocess.Popen[bytes]) -> None:
    """Tell the guardian we finished cleanly (close its pipe) and reap it."""
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()


def ensure_not_controlled(backend: Backend, dev: Device) -> None:
    """Refuse a device that a running session controls (``powerlib set``/``reset`` use it).

    A session holds the device's lock from its ``with`` line to its restore; changing the
    device under it would fight its clocks, and its restore would then undo the change.

    Raises:
        DeviceBusyError: The device's lock is held, naming the holder's pid when known.
    """
    if not backend.persistent:
        return
    state = StateDir(backend.settings.state_dir)
    key = device_key(dev.info.backend, dev.device_id)
    if not DeviceLock.is_free(state, key):
        holder = DeviceLock(state, key).read_owner()
        who = f"pid {holder.pid}" if holder else "another process"
        raise DeviceBusyError(
            f"a powerlib session ({who}) controls this device; it restores the device when it ends",
            device=dev.device_id,
        )
