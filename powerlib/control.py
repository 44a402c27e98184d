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
one; a journal whose restore failed stays in place for a later ``powerlib restore``.

During training, :meth:`ControlSession.apply_sm_clocks` never raises on a driver error: it resets
the device's clocks (the safe state), warns once, and ignores later requests for that device, so
the job keeps running.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from powerlib.config import Settings
from powerlib.device import Backend, Device
from powerlib.errors import (
    DeviceBusyError,
    DeviceNotFoundError,
    InvalidArgumentError,
    PermissionDeniedError,
    PowerlibError,
    UntrustedStateError,
)
from powerlib.journal import (
    Change,
    DeviceLock,
    JournalEntry,
    JournalError,
    Owner,
    StateDir,
    device_key,
    iter_entries,
    now_s,
    show_path,
)
from powerlib.registry import open_backend

__all__ = [
    "ensure_not_controlled",
    "ControlSession",
    "RestoreOutcome",
    "restore_device",
    "restore_failure",
    "restore_journals",
]

logger = logging.getLogger(__name__)

_POWER_TOLERANCE_W = 1.0
_CLOCK_TOLERANCE_MHZ = 0.5
_HANDLED_SIGNALS = tuple(
    s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None
)


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreOutcome:
    """What happened to one item of one device during a restore.

    Attributes:
        device_id: The device.
        item: ``"sm_clocks"``, ``"memory_clocks"``, ``"power_limit"``, or ``"journal"`` for a
            journal-level event (unreadable, owner alive, device gone).
        action: What was (or, in a dry run, would be) done, in words.
        ok: False if something failed; the journal is then kept.
        target: The value restored to (``None`` = unlocked / default).
        journal: Journal file, when the restore came from one.
        owner_pid: The journal owner's pid.
        error_code: When not ok, the CLI exit code of the failure (the README's table): the
            driver's error (4, 5, 9, 10...), 11 for an unreadable journal, 12 for an untrusted
            one, 1 for a device that still reads modified after the restore.
    """

    device_id: str
    item: str
    action: str
    ok: bool
    target: Any = None
    journal: str | None = None
    owner_pid: int | None = None
    error_code: int | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "device_id": self.device_id,
            "item": self.item,
            "action": self.action,
            "ok": self.ok,
            "target": self.target,
            "journal": self.journal,
            "owner_pid": self.owner_pid,
            "error_code": self.error_code,
        }


def restore_device(
    device: Device, changes: Sequence[Change], *, dry_run: bool = False
) -> list[RestoreOutcome]:
    """Put back every changed item of ``device`` (last changed first); never raises.

    After a real restore the device is read again, and an item that does not read back as
    restored (a driver that accepted the write but did not apply it) is reported as failed
    (``error_code`` 1), so its journal is kept. Memory clock locks cannot be read back and are
    not verified; neither is a power limit left alone because someone else changed it.

    Args:
        device: The device, opened by its backend.
        changes: What was changed, with the originals.
        dry_run: Say what would be done, change nothing.
    """
    outcomes: list[RestoreOutcome] = []
    expected: dict[int, Any] = {}  # outcome index -> the value the item must read back as
    for change in reversed(changes):
        original = change.original
        try:
            if change.item == "sm_clocks":
                action = (
                    "unlock SM clocks"
                    if original is None
                    else "lock SM clocks to {}-{} MHz".format(*original)
                )
                if not dry_run:
                    if original is None:
                        device.reset_sm_clocks()
                        expected[len(outcomes)] = None
                    else:
                        expected[len(outcomes)] = device.lock_sm_clocks(
                            float(original[0]), float(original[1])
                        )
            elif change.item == "memory_clocks":
                action = "unlock memory clocks"
                if not dry_run:
                    device.reset_memory_clocks()
            else:
                action = _restore_power_limit(device, change, dry_run)
                if not dry_run and not action.startswith("left"):
                    expected[len(outcomes)] = float(original)
            done = action if dry_run or action.startswith("left") else f"{action}: done"
            outcomes.append(
                RestoreOutcome(
                    device_id=device.device_id,
                    item=change.item,
                    action=done,
                    ok=True,
                    target=original,
                )
            )
        except PowerlibError as err:
            outcomes.append(
                RestoreOutcome(
                    device_id=device.device_id,
                    item=change.item,
                    action=f"failed: {err}",
                    ok=False,
                    target=original,
                    error_code=err.exit_code,
                )
            )
    if expected:
        _verify(device, outcomes, expected)
    return outcomes


def _verify(device: Device, outcomes: list[RestoreOutcome], expected: dict[int, Any]) -> None:
    """Re-read ``device``; turn each restored item that does not read back as such into a failure."""
    try:
        state = device.read_state()
    except PowerlibError as err:
        for i in expected:
            outcomes[i] = dataclasses.replace(
                outcomes[i],
                ok=False,
                action=f"{outcomes[i].action}, but reading the device back failed: {err}",
                error_code=err.exit_code,
            )
        return
    freqs = device.info.supported_sm_freqs_mhz
    full_range = (freqs[0], freqs[-1]) if freqs else None
    for i, want in expected.items():
        if outcomes[i].item == "sm_clocks":
            got = state.locked_sm_freqs_mhz
            want_range = None if want is None or tuple(want) == full_range else tuple(want)
            same = (got is None and want_range is None) or (
                got is not None
                and want_range is not None
                and all(abs(a - b) <= _CLOCK_TOLERANCE_MHZ for a, b in zip(got, want_range))
            )
            shown = "unlocked" if got is None else "locked to {:g}-{:g} MHz".format(*got)
        else:
            got_w = state.power_limit_w
            same = got_w is None or abs(got_w - want) <= _POWER_TOLERANCE_W  # None: cannot tell
            shown = f"at {got_w:g} W" if got_w is not None else "unknown"
        if not same:
            outcomes[i] = dataclasses.replace(
                outcomes[i],
                ok=False,
                action=(
                    f"failed: {outcomes[i].action.removesuffix(': done')} was accepted, but the "
                    f"device still reads {shown}: still modified"
                ),
                error_code=1,
            )


def _restore_power_limit(device: Device, change: Change, dry_run: bool) -> str:
    original_w = float(change.original)
    current_w = device.read_state().power_limit_w
    if current_w is not None and abs(current_w - original_w) <= _POWER_TOLERANCE_W:
        return f"power limit already at {original_w:g} W"
    ours = [float(t) for t in (change.target, change.previous_target) if t is not None]
    if (
        current_w is not None
        and ours
        and all(abs(current_w - t) > _POWER_TOLERANCE_W for t in ours)
    ):
        return (
            f"left the power limit at {current_w:g} W: changed by someone else after powerlib set "
            f"{ours[0]:g} W"
        )
    if not dry_run:
        device.set_power_limit(original_w)
    return f"set power limit back to {original_w:g} W"


def _backend_settings(backend: Backend) -> dict[str, Any]:
    s = backend.settings
    return {"sysfs_root": str(s.sysfs_root), "sim_model": s.sim_model, "sim_gpus": s.sim_gpus}


#: Built-in backends that never read ``Settings.sysfs_root``: a journal's recorded sysfs root
#: is irrelevant to them. Every other backend (sysfs, plug-ins) must match the invoking one.
_SYSFS_FREE_BACKENDS = frozenset({"nvidia", "amd", "simulated"})


def _settings_for(entry: JournalEntry, base: Settings, journal: Path) -> Settings:
    """The settings to reopen ``entry``'s backend with: the invoking ones, never the journal's.

    A journal names its backend and, for the simulated one, the model and count (which choose
    files only inside the invoking state folder). It never chooses where a restore writes: the
    state folder is always the invoking one, and so is the sysfs root.

    Raises:
        UntrustedStateError: The journal recorded a different sysfs root for a backend that
            writes under it.
    """
    saved = entry.backend_settings
    recorded_root = saved.get("sysfs_root")
    if (
        recorded_root is not None
        and entry.backend not in _SYSFS_FREE_BACKENDS
        and Path(recorded_root) != base.sysfs_root
    ):
        raise UntrustedStateError(
            f"refusing the journal {show_path(journal)}: it was written with the sysfs root "
            f"{show_path(recorded_root)} but this restore uses {show_path(base.sysfs_root)}, and a "
            "journal never chooses where a restore writes; run the restore with "
            "POWERLIB_SYSFS_ROOT set to that root if it is the right one"
        )
    try:
        return base.replace(
            backend=entry.backend,
            sim_model=saved.get("sim_model", base.sim_model),
            sim_gpus=int(saved.get("sim_gpus", base.sim_gpus)),
            sim_clock="wall",
            cuda_visible_devices=None,  # a restore must see every device to find this one
            hip_visible_devices=None,
            rocr_visible_devices=None,
        )
    except PowerlibError as err:
        raise JournalError(
            f"journal {show_path(journal)} records unusable backend settings ({err}); left in place"
        ) from err


def restore_journals(
    settings: Settings,
    *,
    include_live: bool = False,
    dry_run: bool = False,
    owner: Owner | None = None,
    trusted_uids: Iterable[int] = (),
) -> list[RestoreOutcome]:
    """Restore devices from the journals in ``settings.state_dir``.

    The state folder is checked first (see :meth:`StateDir.inspect`): a folder that is
    untrusted, unreadable or not a folder raises, and nothing is done. A read-only one (which
    cannot hold device locks nor lose restored journals) restores nothing either, and reports
    each journaled item as a failed outcome. Otherwise each journal is read (trusted, bounded,
    validated) and restored on its own; a journal that cannot be read or restored becomes a
    failed outcome, and the others go on.

    Args:
        settings: Where the state directory is, and the sysfs root; backends are reopened with
            the backend, model and count each journal recorded, nothing else.
        include_live: Also restore journals whose owner still runs (``powerlib restore --all``).
        dry_run: Report what would be done; change nothing, delete nothing.
        owner: Only journals of this owner (the guardian).
        trusted_uids: Owners of state folders and journals to trust besides the euid and root.

    Returns:
        One outcome per item, plus journal-level outcomes (unreadable, refused, skipped). Empty
        when the state folder does not exist or holds no journal.

    Raises:
        UntrustedStateError: The state folder (or the folder holding it) is untrusted.
        ConfigError: The state path cannot be a folder.
        PermissionDeniedError: The state folder cannot be listed.
    """
    state = StateDir(settings.state_dir, trusted_uids=trusted_uids)
    if not state.inspect():
        return []
    paths = state.journals()
    if not paths:
        return []
    read_only: PowerlibError | None = None
    if not dry_run:
        try:
            state.check_writable()
        except PermissionDeniedError as err:
            read_only = err  # every journal is reported, none is acted on
    outcomes: list[RestoreOutcome] = []
    backends: dict[tuple[Any, ...], Backend] = {}
    try:
        for path, entry in iter_entries(state):
            if isinstance(entry, PowerlibError):
                outcomes.append(
                    RestoreOutcome(
                        device_id="?",
                        item="journal",
                        action=str(entry),
                        ok=False,
                        journal=str(path),
                        error_code=entry.exit_code,
                    )
                )
                continue
            if owner is not None and (entry.owner.pid, entry.owner.start_time_s) != (
                owner.pid,
                owner.start_time_s,
            ):
                continue
            if read_only is not None and (include_live or not entry.owner.is_alive()):
                outcomes.extend(
                    RestoreOutcome(
                        device_id=entry.device_id,
                        item=change.item,
                        action=f"not restored: {read_only}",
                        ok=False,
                        target=change.original,
                        journal=str(path),
                        owner_pid=entry.owner.pid,
                        error_code=read_only.exit_code,
                    )
                    for change in reversed(entry.changes)
                )
                continue
            outcomes.extend(
                _restore_entry(state, path, entry, settings, backends, include_live, dry_run)
            )
    finally:
        for backend in backends.values():
            backend.close()
    return outcomes


def restore_failure(outcomes: Sequence[RestoreOutcome]) -> PowerlibError | None:
    """The error a restore with these outcomes ends in, or ``None`` if every step succeeded.

    Its exit code is the first failure's (the README's table) and its message is one line: the
    first failure, and how many more there are.
    """
    failed = [o for o in outcomes if not o.ok]
    if not failed:
        return None
    first = failed[0]
    where = f"{first.device_id} {first.item}: " if first.item != "journal" else ""
    more = f" (and {len(failed) - 1} more failed step(s), see --json)" if len(failed) > 1 else ""
    kept = "" if "left in place" in first.action else "; journals kept for another try"
    err = PowerlibError(f"restore incomplete: {where}{first.action}{more}{kept}")
    err.exit_code = first.error_code or 1
    return err


def _restore_entry(
    state: StateDir,
    path: Path,
    entry: JournalEntry,
    base: Settings,
    backends: dict[tuple[Any, ...], Backend],
    include_live: bool,
    dry_run: bool,
) -> list[RestoreOutcome]:
    def note(action: str, error: PowerlibError | None = None) -> list[RestoreOutcome]:
        return [
            RestoreOutcome(
                device_id=entry.device_id,
                item="journal",
                action=action,
                ok=error is None,
                journal=str(path),
                owner_pid=entry.owner.pid,
                error_code=None if error is None else error.exit_code,
            )
        ]

    alive = entry.owner.is_alive()
    if alive and not include_live:
        return note(
            f"skipped: its owner (pid {entry.owner.pid}) is still running; use --all to force"
        )
    try:
        settings = _settings_for(entry, base, path)
    except PowerlibError as err:
        return note(f"failed: {err}", err)
    lock = DeviceLock(state, entry.key)
    if not dry_run:
        try:
            state.prepare()
            lock.acquire(Owner.current())
        except PowerlibError as err:
            if not include_live:
                return note(f"failed: not restored, the device lock cannot be taken: {err}", err)
            logger.warning("restoring %s without its lock: %s", entry.device_id, err)
    try:
        cache_key = (
            settings.backend,
            str(settings.sysfs_root),
            settings.sim_model,
            settings.sim_gpus,
        )
        if cache_key not in backends:
            backends[cache_key] = open_backend(settings=settings)
        device = next(
            (d for d in backends[cache_key].devices() if d.device_id == entry.device_id), None
        )
        if device is None:  # exact id only: an index or a prefix must never pick another device
            raise DeviceNotFoundError(
                f"no {entry.backend} device has the id {show_path(entry.device_id)}"
            )
    except PowerlibError as err:
        lock.release()
        return note(
            f"failed: cannot open {entry.backend} device {show_path(entry.device_id)}: {err}", err
        )
    try:
        results = [
            dataclasses.replace(o, journal=str(path), owner_pid=entry.owner.pid)
            for o in restore_device(device, entry.changes, dry_run=dry_run)
        ]
        if not dry_run and all(o.ok for o in results):
            state.remove_journal(path)
        return results
    finally:
        lock.release()


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
                results = restore_device(ctl.device, ctl.entry.changes)
                outcomes.extend(results)
                if all(r.ok for r in results):
                    if ctl.lock is not None:
                        self._state.remove_journal(self._state.journal_path(ctl.entry.key))
                else:
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
        path = self._state.journal_path(key)
        if not path.exists() and not path.is_symlink():
            return
        entry = self._state.read_journal(path)  # JournalError: refuse to guess the original state
        logger.warning(
            "%s: restoring what pid %d left behind (journal %s)",
            dev.device_id,
            entry.owner.pid,
            path,
        )
        results = restore_device(dev, entry.changes)
        if not all(r.ok for r in results):
            raise JournalError(
                f"could not restore the state pid {entry.owner.pid} left on {dev.device_id}: "
                + "; ".join(r.action for r in results if not r.ok),
                device=dev.device_id,
            )
        self._state.remove_journal(path)

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


def wait_for_owner_exit(owner: Owner, stream_fd: int, poll_s: float = 0.2) -> None:
    """Block until ``stream_fd`` reaches EOF or ``owner`` stops running (the guardian's wait).

    Polling the owner as well as the pipe covers a pipe kept open by the owner's forked children.
    """
    while True:
        readable, _, _ = select.select([stream_fd], [], [], poll_s)
        if readable and not os.read(stream_fd, 4096):
            return
        if not owner.is_alive():
            return


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
