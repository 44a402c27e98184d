"""Change device settings so that they are always put back.

A :class:`ControlSession` is the only way powerlib changes clocks and power limits on behalf of a
job. Before its first change of an item on a device it

1. takes the device's lock (a second controller gets ``DeviceBusyError`` naming the owner's pid),
2. restores any journal a dead owner left for that device,
3. reads the original value and writes it, fsynced, to the device's journal,

and only then makes the change. The original is read from the driver: a clock lock or power limit
someone set before the session is kept as the original (with a warning) and put back; a lock the
driver reports without its range (NVML) is refused unless ``force=True`` (docs/real-gpu.md §1).
A change the driver refuses outright (no permission, not supported, a bad argument) is taken out
of the journal again, so nothing is left to restore or replay (docs/real-gpu.md §5).

It restores the captured originals — not defaults — when the
``with`` block ends (normally or by an exception, ``KeyboardInterrupt`` included), at interpreter
exit, and on SIGTERM or SIGHUP (its handlers chain to those the host program installed). A process
killed by SIGKILL, the OOM killer or a crash leaves its journal behind; ``powerlib restore``, the
next session that touches the device, or the guardian process put the device back. The guardian
is on by default where changes outlive the process and are made here, not through the node agent
(docs/real-gpu.md §6).

Restores compare before they write (the GROMACS rule): a power limit that someone else changed
after powerlib set it is left alone and reported. Restores continue past failures and report each
one; a journal whose restore failed stays in place for a later ``powerlib restore``. How a device
is put back, and how the journals a dead session left are read and trusted, is
:mod:`powerlib.control.restore`.

During training, :meth:`ControlSession.apply_sm_clocks` never raises on a driver error (a
transient one included, once the device's own bounded retries are spent): it resets the device's
clocks (the safe state), warns once, records why in :attr:`ControlSession.degraded`, and ignores
later requests for that device, so the job keeps running (docs/real-gpu.md §2).
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, TypeVar

from powerlib.backend import Backend
from powerlib.control import exits, guardian
from powerlib.control.journal import (
    UNKNOWN_LOCK,
    Change,
    JournalEntry,
    JournalError,
    has_journal,
    journal_path,
    now_s,
    read_journal,
    remove_journal,
    write_journal,
)
from powerlib.control.locks import DeviceLock
from powerlib.control.restore import (
    RestoreOutcome,
    restore_and_discard,
)
from powerlib.control.state import Owner, StateDir, device_key
from powerlib.device import Device
from powerlib.errors import (
    DeviceBusyError,
    DeviceNotFoundError,
    InvalidArgumentError,
    NotSupportedError,
    PermissionDeniedError,
    PowerlibError,
)

__all__ = ["ControlSession", "ensure_not_controlled"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Driver errors that prove a write changed nothing: its journal entry is taken back.
_REFUSALS = (PermissionDeniedError, NotSupportedError, InvalidArgumentError)
_POWER_TOLERANCE_W = 1.0  # as restore's: a limit within a watt of the default is the default
_CLOCK_TOLERANCE_MHZ = 0.5


def _backend_settings(backend: Backend) -> dict[str, object]:
    s = backend.settings
    return {"sysfs_root": str(s.sysfs_root), "sim_model": s.sim_model, "sim_gpus": s.sim_gpus}


@dataclass
class _Controlled:
    device: Device
    lock: DeviceLock | None
    entry: JournalEntry


class ControlSession:
    """The one controller of some devices: every change is journaled and put back.

    Args:
        backend: The open backend whose devices the session may change.
        guardian: Start a watchdog process that restores the devices within about a second of
            this process dying, even by SIGKILL. ``None`` (the default): on when the backend
            changes devices here and the changes outlive the process (``backend.persistent``,
            not the node agent's ``remote`` backend), off otherwise (docs/real-gpu.md §6).
        handle_signals: Install SIGTERM/SIGHUP handlers (main thread only; chained).
        force: Take a device whose clocks someone else locked although the driver cannot say
            to what range (NVML: an administrator's ``nvidia-smi -lgc``). Without it the first
            change of such a device raises ``DeviceBusyError``; with it the session warns, and
            its restore unlocks the clocks, as the lock it found cannot be put back
            (docs/real-gpu.md §1).
        warn: :meth:`apply_sm_clocks` warns (``RuntimeWarning`` and a log warning) when it gives
            up on a device; ``False`` logs it at INFO only, for a caller that reports the
            failure itself (a training session, from :attr:`degraded`).

    Attributes:
        degraded: The devices :meth:`apply_sm_clocks` gave up on, each with one line saying
            why and whether its clocks were reset.

    Example::

        with powerlib.open_backend() as backend, ControlSession(backend) as session:
            session.lock_sm_clocks(0, 1200)
            train()
    """

    def __init__(
        self,
        backend: Backend,
        *,
        guardian: bool | None = None,
        handle_signals: bool = True,
        force: bool = False,
        warn: bool = True,
    ) -> None:
        self.backend = backend
        self.settings = backend.settings
        self._state = StateDir(self.settings.state_dir)
        self._owner = Owner.current()
        self._controlled: dict[str, _Controlled] = {}
        self._guard = threading.RLock()
        self.degraded: dict[str, str] = {}
        self._guardian_forced = guardian is True  # asked for: a guardian that cannot start raises
        if guardian is None:
            guardian = backend.persistent and not getattr(backend, "remote", False)
        self._use_guardian = guardian
        self._force = force
        self._warn = warn
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
        self._ensure_guardian(logging.DEBUG)  # by default, a state dir that is unusable now
        # an unusable state dir refuses the first change instead, where the guardian is retried
        exits.register(self, handle_signals=self._handle_signals)
        self._is_open = True
        return self

    def close(self) -> list[RestoreOutcome]:
        """Restore every device and release the locks. Idempotent; never raises."""
        outcomes = self.restore()
        exits.unregister(self)
        if self._guardian is not None:
            # Only a restore that fully succeeded is a clean close: otherwise the guardian
            # keeps its one retry of the journals left behind.
            restored = all(o.ok for o in outcomes)
            guardian.stop(self._guardian, clean=restored and os.getpid() == self._owner.pid)
            self._guardian = None
        self._is_open = False
        return outcomes

    @property
    def controlled_devices(self) -> list[str]:
        """Ids of the devices this session has changed and not yet restored."""
        return list(self._controlled)

    # -- changes ---------------------------------------------------------------------------------

    # Each change journals first (:meth:`_record`); a write the driver refuses outright takes
    # the new journal entry back again (:meth:`_write`, docs/real-gpu.md §5).

    def lock_sm_clocks(
        self, device: int | str | Device, min_mhz: float, max_mhz: float | None = None
    ) -> tuple[float, float]:
        """Journal, then lock SM clocks (see :meth:`Device.lock_sm_clocks`).

        Raises:
            DeviceBusyError: Another session holds the device, or (without ``force``) someone
                locked its clocks to a range the driver cannot report.
        """
        dev = self._resolve(device)
        lo, hi = dev.validate_sm_clocks(
            min_mhz, max_mhz
        )  # bad input changes nothing, not even a journal
        return self._write(dev, "sm_clocks", None, lambda: dev.lock_sm_clocks(lo, hi))

    def reset_sm_clocks(self, device: int | str | Device) -> None:
        """Journal, then unlock SM clocks."""
        dev = self._resolve(device)
        self._write(dev, "sm_clocks", None, dev.reset_sm_clocks)

    def lock_memory_clocks(
        self, device: int | str | Device, min_mhz: float, max_mhz: float | None = None
    ) -> tuple[float, float]:
        """Journal, then lock memory clocks."""
        dev = self._resolve(device)
        return self._write(
            dev, "memory_clocks", None, lambda: dev.lock_memory_clocks(min_mhz, max_mhz)
        )

    def set_power_limit(
        self, device: int | str | Device, power_limit_w: float, *, ceiling_w: float | None = None
    ) -> float:
        """Journal, then set the power limit.

        ``ceiling_w``: a limit an administrator or the facility set (the device's before the
        session), never raised: a higher ``power_limit_w`` is refused (``InvalidArgumentError``)
        before anything is journaled or written (docs/perseus.md §7).
        """
        dev = self._resolve(device)
        dev.validate_power_limit(power_limit_w)
        if ceiling_w is not None and power_limit_w > ceiling_w + _POWER_TOLERANCE_W:
            raise InvalidArgumentError(
                f"a power limit of {power_limit_w:g} W is above the {ceiling_w:g} W limit the "
                "device had before (an administrator's or the facility's): powerlib never raises it",
                device=dev.device_id,
            )
        return self._write(
            dev, "power_limit", float(power_limit_w), lambda: dev.set_power_limit(power_limit_w)
        )

    def reset_power_limit(self, device: int | str | Device) -> None:
        """Journal, then restore the default power limit."""
        dev = self._resolve(device)
        if dev.info.default_power_limit_w is None:
            dev.reset_power_limit()  # raises NotSupportedError: nothing to journal
            return
        self._write(dev, "power_limit", dev.info.default_power_limit_w, dev.reset_power_limit)

    def apply_sm_clocks(self, device: int | str | Device, freq_mhz: float) -> bool:
        """Lock the SM clock for training; never raises on a device or driver error.

        On a driver error (a transient one after the device's bounded retries, a refusal, a
        read-back that contradicts the lock) the device's clocks are reset to its baseline (the
        safe state; a device this session has not changed, e.g. after a refusal that was taken
        out of the journal, is left as it was), one warning is issued, the reason is kept in
        :attr:`degraded`, and later requests for that device are ignored, so the training job
        keeps running (docs/real-gpu.md §2). A device another controller holds (``DeviceBusyError``: another
        session's lock, an agent lease, a lock the session must not take over) is left exactly
        as it is, as that controller restores it.

        Returns:
            True if the clock was applied.

        Raises:
            InvalidArgumentError: ``freq_mhz`` is out of range (a bug in the caller, not the driver).
        """
        dev = self._resolve(device)
        if dev.device_id in self.degraded:
            return False
        lo, hi = dev.validate_sm_clocks(freq_mhz)  # the caller's bug: raised, nothing degrades
        try:
            self.lock_sm_clocks(dev, lo, hi)
            return True
        except DeviceBusyError as err:
            # Another controller owns the device: its clocks are that controller's to restore,
            # so they are not touched here (a reset would undo its lock).
            self.degraded[dev.device_id] = f"left alone, its clocks untouched: {err}"
            message = (
                f"powerlib leaves {dev.info.name} ({dev.device_id}) alone for this session: {err}; "
                "training continues"
            )
        except PowerlibError as err:
            if dev.device_id not in self._controlled:  # refused before any change: as it was
                state = "its clocks were left as they were (nothing had been changed)"
            else:
                try:
                    dev.reset_sm_clocks()
                    state = "its clocks were reset to the baseline"
                except PowerlibError as reset_err:
                    state = f"resetting its clocks failed too ({reset_err})"
            self.degraded[dev.device_id] = f"{type(err).__name__}: {err}; {state}"
            message = (
                f"powerlib stops changing {dev.info.name} ({dev.device_id}) for this session after "
                f"a driver error: {err}; {state}; training continues"
            )
        if self._warn:
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        else:  # the caller reports it (a training session: one warning per failure)
            logger.info(message)
        return False

    # -- restore ---------------------------------------------------------------------------------

    def restore(self) -> list[RestoreOutcome]:
        """Put every changed device back now (the session stays usable). Never raises."""
        outcomes: list[RestoreOutcome] = []
        with self._guard:
            for device_id in reversed(list(self._controlled)):
                ctl = self._controlled.pop(device_id)
                journal = None if ctl.lock is None else journal_path(self._state, ctl.entry.key)
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

    def _write(self, dev: Device, item: str, target: Any, write: Callable[[], T]) -> T:
        """Journal ``item`` (:meth:`_record`), then ``write``; take back a change that was refused.

        A permission, support or argument error from the driver proves nothing changed: a change
        journaled just for this write is taken out again (:meth:`_unrecord`), so nothing is left
        to restore at exit or for a later run to replay (docs/real-gpu.md §5).
        """
        new = self._record(dev, item, target)
        try:
            return write()
        except _REFUSALS:
            if new:
                self._unrecord(dev, item)
            raise

    def _record(self, dev: Device, item: str, target: Any) -> bool:
        """Journal-before-write: capture the original of ``item`` once, durably.

        Returns:
            True when ``item`` was not journaled before (a new change).
        """
        with self._guard:
            if not self._is_open:
                self.start()
            ctl = self._controlled.get(dev.device_id) or self._take(dev)
            existing = ctl.entry.change(item)
            if existing is not None and (item != "power_limit" or existing.target == target):
                return False  # original already journaled; clock changes do not rewrite it
            try:
                original = existing.original if existing is not None else self._capture(dev, item)
                entry = ctl.entry.with_change(Change(item=item, original=original, target=target))
                if ctl.lock is not None:
                    write_journal(self._state, entry)
            except BaseException:
                if not ctl.entry.changes:
                    self._forget(ctl)  # refused at claim: the device is not ours after all
                raise
            ctl.entry = entry
            return existing is None

    def _unrecord(self, dev: Device, item: str) -> None:
        """Take back the journaled change of ``item`` whose write the driver refused.

        The device is read first: only an item that still reads as its original is taken back
        (a write of several files that failed half-way keeps its journal). A device left with
        no change is forgotten: its journal is deleted and its lock released.
        """
        with self._guard:
            ctl = self._controlled.get(dev.device_id)
            change = None if ctl is None else ctl.entry.change(item)
            if ctl is None or change is None or not _reads_as_original(dev, change):
                return
            entry = replace(
                ctl.entry, changes=tuple(c for c in ctl.entry.changes if c.item != item)
            )
            if not entry.changes:
                self._forget(ctl)
                return
            if ctl.lock is not None:
                try:
                    write_journal(self._state, entry)
                except PowerlibError as err:  # the old journal still restores a superset
                    logger.debug("%s: journal not rewritten: %s", dev.device_id, err)
                    return
            ctl.entry = entry

    def _forget(self, ctl: _Controlled) -> None:
        """Drop a device this session has not changed: delete its journal, release its lock."""
        self._controlled.pop(ctl.device.device_id, None)
        if ctl.lock is not None:
            remove_journal(self._state, journal_path(self._state, ctl.entry.key))
            ctl.lock.release()

    def _ensure_guardian(self, level: int) -> None:
        """Start the guardian if it is wanted and not running (docs/real-gpu.md §6).

        One that was asked for (``guardian=True``) raises when it cannot start; the default one
        is logged at ``level`` and tried again at the next device claim.
        """
        if self._guardian is not None or not (self._use_guardian and self.backend.persistent):
            return
        try:
            self._state.prepare()
            self._guardian = guardian.start(self.settings, self._owner)
        except (PowerlibError, OSError) as err:
            if self._guardian_forced:
                raise
            logger.log(level, "no guardian for this session (yet): %s", err)

    def _take(self, dev: Device) -> _Controlled:
        lock = None
        if self.backend.persistent:
            self._state.prepare()  # refuses before any change if the state dir is unusable
            self._ensure_guardian(logging.WARNING)
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
        if not has_journal(self._state, key):
            return
        path = journal_path(self._state, key)
        entry = read_journal(self._state, path)  # JournalError: refuse to guess the original state
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
        """Read the original of ``item`` from the driver (docs/real-gpu.md §1).

        Raises:
            DeviceBusyError: The clocks are locked to a range the driver cannot report, and the
                session was not forced.
            InvalidArgumentError: The power limit cannot be read.
        """
        if item == "sm_clocks":
            return self._capture_sm_clocks(dev)
        if item == "power_limit":
            st = dev.read_state()
            if st.power_limit_w is None:
                raise InvalidArgumentError(
                    "the current power limit cannot be read, so it could not be restored; refusing to change it",
                    device=dev.device_id,
                )
            default_w = dev.info.default_power_limit_w
            if default_w is not None and abs(st.power_limit_w - default_w) > _POWER_TOLERANCE_W:
                logger.warning(
                    "%s (%s): its power limit is %g W, not the default %g W, before powerlib "
                    "changes it: kept as the original, and put back when the session ends",
                    dev.info.name,
                    dev.device_id,
                    st.power_limit_w,
                    default_w,
                )
            return st.power_limit_w
        return None  # memory clock locks cannot be read back: restore means unlock

    def _capture_sm_clocks(self, dev: Device) -> Any:
        """The SM-clock original the driver reports: ``None``, ``[lo, hi]`` or unknown-lock."""
        found = dev.read_sm_lock()  # the driver, never this process's memory (NVML)
        if not found.locked:  # False, or None: the driver cannot tell (NVML without the reason)
            return None
        where = f"{dev.info.name} ({dev.device_id})"
        if found.range_mhz is not None:
            lo, hi = found.range_mhz
            logger.warning(
                "%s: its SM clocks are already locked to %g-%g MHz (set before this session, e.g. "
                "by an administrator): kept as the original, and locked again when the session "
                "ends",
                where,
                lo,
                hi,
            )
            return [float(lo), float(hi)]
        if not self._force:
            nvidia = dev.info.backend == "nvidia"
            raise DeviceBusyError(
                f"someone else locked the SM clocks of {where}"
                + (" (e.g. `nvidia-smi -lgc`)" if nvidia else "")
                + ", and the driver does not report to what range, so powerlib could not put "
                "that lock back; remove the lock first"
                + (" (`nvidia-smi -rgc`)" if nvidia else "")
                + ", or pass force=True to take the device anyway (its clocks are then unlocked "
                "when the session ends)",
                device=dev.device_id,
            )
        logger.warning(
            "%s: its SM clocks are locked by someone else to a range the driver does not report; "
            "force=True: powerlib takes the device anyway, and unlocks its clocks when the "
            "session ends (the lock it found cannot be put back)",
            where,
        )
        return UNKNOWN_LOCK


# -- the guardian ----------------------------------------------------------------------------------


def _reads_as_original(dev: Device, change: Change) -> bool:
    """Whether ``dev`` still reads as ``change``'s original (True where the driver cannot tell)."""
    try:
        if change.item == "sm_clocks":
            found = dev.read_sm_lock()
            if change.original is None:
                return found.locked is not True
            if change.original == UNKNOWN_LOCK or found.range_mhz is None:
                return found.locked is not False
            return all(
                abs(a - b) <= _CLOCK_TOLERANCE_MHZ
                for a, b in zip(found.range_mhz, change.original, strict=True)
            )
        if change.item == "power_limit":
            limit_w = dev.read_state().power_limit_w
            return limit_w is None or abs(limit_w - float(change.original)) <= _POWER_TOLERANCE_W
    except PowerlibError as err:
        logger.debug("%s: cannot read %s back: %s", dev.device_id, change.item, err)
        return False
    return True  # memory clock locks cannot be read back


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
