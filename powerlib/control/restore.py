"""Put devices back: from a session's own record, or from the journals a dead session left.

:func:`restore_device` puts back the changed items of one device; :func:`restore_journals`
(``powerlib restore``, the guardian) does it for every journal in the state folder, and
:class:`~powerlib.control.ControlSession` for the devices it changed. Both go through
:func:`restore_and_discard`, which deletes a journal only once every item in it is restored.

Restores compare before they write (the GROMACS rule): a power limit that someone else changed
after powerlib set it is left alone and reported. Restores continue past failures and report each
one (a :class:`RestoreOutcome` per item); a journal whose restore failed stays in place for a later
``powerlib restore``.

A restore may run as root on a shared node, so it trusts nothing a journal says about where to
write: the state folder and the sysfs root are always the invoking ones (:func:`_settings_for`),
and the state folder and each journal must pass the checks of :mod:`powerlib.control.trust`
(owned by the invoking user or root). For another user's state (a Slurm epilog acting for the
job's user) there is :func:`restore_for_user`, which only ever resets that job's devices to the
driver's defaults: root never writes a value a user's file supplies (docs/agent.md §4).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from powerlib.backend import Backend
from powerlib.config import Settings
from powerlib.control.journal import (
    UNKNOWN_LOCK,
    Change,
    JournalEntry,
    JournalError,
    iter_entries,
    list_journals,
    remove_journal,
)
from powerlib.control.locks import DeviceLock
from powerlib.control.state import Owner, StateDir
from powerlib.device import ClockLockState, Device, PowerState
from powerlib.errors import (
    DeviceNotFoundError,
    PermissionDeniedError,
    PowerlibError,
    UntrustedStateError,
)
from powerlib.inputs import show_path
from powerlib.registry import open_backend

__all__ = [
    "RestoreOutcome",
    "restore_and_discard",
    "restore_device",
    "restore_failure",
    "restore_journals",
]

logger = logging.getLogger(__name__)

_POWER_TOLERANCE_W = 1.0
_CLOCK_TOLERANCE_MHZ = 0.5


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
        error_code: When not ok, the CLI exit code of the failure (docs/json-and-exit-codes.md): the
            driver's error (4, 5, 9, 10...), 11 for an unreadable journal, 12 for an untrusted
            one, 1 for a device that still reads modified after the restore.
        skipped: Nothing was done, deliberately: state a restore acting for a user must not
            trust, or a device outside that user's job, or one another process controls. Not a
            failure (``ok`` stays True): a user's own files must not make an epilog fail and
            drain the node. The action says why; ``powerlib restore`` logs it.
        found: For a power limit left alone because it reads a value this restore did not set:
            that value (the session's ``ok`` is then False where the caller needs to know, e.g.
            the agent's lease).
        verified: Whether the device was read back after the restore and reads as restored:
            True; ``None`` when it was not or could not be (a dry run, memory clocks, NVML's
            "no lock" which the driver cannot state, an item left alone). A device that reads
            back as still modified is a failure (``ok`` False), never ``verified``.
    """

    device_id: str
    item: str
    action: str
    ok: bool
    target: Any = None
    journal: str | None = None
    owner_pid: int | None = None
    error_code: int | None = None
    skipped: bool = False
    found: Any = None
    verified: bool | None = None

    def to_json(self) -> dict[str, object]:
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
            "skipped": self.skipped,
            "verified": self.verified,
        }


def restore_device(
    device: Device, changes: Sequence[Change], *, dry_run: bool = False
) -> list[RestoreOutcome]:
    """Put back every changed item of ``device`` (last changed first); never raises.

    After a real restore the device is read again from the driver (docs/real-gpu.md §1), and an
    item that does not read back as restored (a driver that accepted the write but did not apply
    it) is reported as failed (``error_code`` 1), so its journal is kept. SM clocks are read with
    :meth:`Device.read_sm_lock`: an unlock must leave no lock the driver reports, a re-lock the
    original range where the driver reports ranges; where the driver cannot say (NVML reports no
    "unlocked"), the outcome says "not verified" and ``verified`` stays ``None``. Memory clock
    locks cannot be read back and are not verified; neither is a power limit left alone because
    someone else changed it.

    Args:
        device: The device, opened by its backend.
        changes: What was changed, with the originals.
        dry_run: Say what would be done, change nothing.
    """
    outcomes: list[RestoreOutcome] = []
    expected: dict[int, Any] = {}  # outcome index -> the value the item must read back as
    for change in reversed(changes):
        original = change.original
        found = None
        try:
            if change.item == "sm_clocks":
                if original is None:
                    action = "unlock SM clocks"
                elif original == UNKNOWN_LOCK:
                    action = (
                        "unlock SM clocks (someone else had locked them before the session, to "
                        "a range the driver does not report)"
                    )
                else:
                    action = "lock SM clocks to {}-{} MHz".format(*original)
                if not dry_run:
                    if original is None or original == UNKNOWN_LOCK:
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
                action, found = _restore_power_limit(device, change, dry_run)
                if not dry_run and found is None:
                    expected[len(outcomes)] = float(original)
            left = change.item == "power_limit" and found is not None
            done = action if dry_run or left else f"{action}: done"
            outcomes.append(
                RestoreOutcome(
                    device_id=device.device_id,
                    item=change.item,
                    action=done,
                    ok=True,
                    target=original,
                    found=found if left else None,
                )
            )
        except PowerlibError as err:
            outcomes.append(_failed_item(device.device_id, change, f"failed: {err}", err))
    if expected:
        _verify(device, outcomes, expected)
    return outcomes


def restore_and_discard(
    device: Device,
    changes: Sequence[Change],
    state: StateDir,
    journal: Path | None,
    *,
    dry_run: bool = False,
) -> list[RestoreOutcome]:
    """Put ``device`` back (:func:`restore_device`), then delete its journal if all went well.

    The one way a restore ends, whether a session closes or ``powerlib restore`` reads what a
    dead session left: a journal is deleted only when every item in it is restored, so a failed
    item keeps it for another try. Never raises on a device error.

    Args:
        device: The device, opened by its backend.
        changes: What was changed, with the originals.
        state: The state folder that holds the journal.
        journal: The journal to delete afterwards; ``None`` when there is none (a backend that
            keeps no journals).
        dry_run: Say what would be done, change nothing, delete nothing.
    """
    outcomes = restore_device(device, changes, dry_run=dry_run)
    if journal is not None and not dry_run and all(o.ok for o in outcomes):
        remove_journal(state, journal)
    return outcomes


def _failed_item(
    device_id: str,
    change: Change,
    action: str,
    error: PowerlibError,
    *,
    journal: Path | None = None,
    owner_pid: int | None = None,
) -> RestoreOutcome:
    """An item that was not put back, with ``error``'s exit code (its journal is kept)."""
    return RestoreOutcome(
        device_id=device_id,
        item=change.item,
        action=action,
        ok=False,
        target=change.original,
        journal=None if journal is None else str(journal),
        owner_pid=owner_pid,
        error_code=error.exit_code,
    )


def journal_note(
    path: Path,
    action: str,
    *,
    error: PowerlibError | None = None,
    entry: JournalEntry | None = None,
) -> RestoreOutcome:
    """A journal-level outcome: unreadable, refused or skipped (``entry`` when it was read)."""
    return RestoreOutcome(
        device_id="?" if entry is None else entry.device_id,
        item="journal",
        action=action,
        ok=error is None,
        journal=str(path),
        owner_pid=None if entry is None else entry.owner.pid,
        error_code=None if error is None else error.exit_code,
    )


def _verify(device: Device, outcomes: list[RestoreOutcome], expected: dict[int, Any]) -> None:
    """Read ``device`` back from the driver; fail each restored item that still reads modified.

    SM clocks are read with :meth:`Device.read_sm_lock` (never this process's record of what it
    set), the power limit with :meth:`Device.read_state`. An item the driver reads as restored
    gets ``verified`` True; one the driver cannot tell about keeps ``verified`` None and says
    so in its action; one that reads modified, or cannot be read at all, becomes a failure.
    """
    freqs = device.info.supported_sm_freqs_mhz
    full_range = (freqs[0], freqs[-1]) if freqs else None
    reads: dict[str, ClockLockState | PowerState] = {}
    for i, want in expected.items():
        item = outcomes[i].item
        try:
            if item not in reads:
                reads[item] = device.read_sm_lock() if item == "sm_clocks" else device.read_state()
        except PowerlibError as err:
            outcomes[i] = dataclasses.replace(
                outcomes[i],
                ok=False,
                action=f"{outcomes[i].action}, but reading the device back failed: {err}",
                error_code=err.exit_code,
            )
            continue
        read = reads[item]
        if isinstance(read, ClockLockState):  # the sm_clocks item
            want_range = None if want is None else (float(want[0]), float(want[1]))
            same, shown = _sm_lock_reads_as(read, want_range, full_range)
        else:
            got_w = read.power_limit_w
            same = None if got_w is None else abs(got_w - want) <= _POWER_TOLERANCE_W
            shown = f"at {got_w:g} W" if got_w is not None else "the power limit"
        if same is None:
            outcomes[i] = dataclasses.replace(
                outcomes[i],
                action=f"{outcomes[i].action} (not verified: the driver cannot report {shown})",
            )
        elif same:
            outcomes[i] = dataclasses.replace(outcomes[i], verified=True)
        else:
            outcomes[i] = dataclasses.replace(
                outcomes[i],
                ok=False,
                action=(
                    f"failed: {outcomes[i].action.removesuffix(': done')} was accepted, but the "
                    f"device still reads {shown}: still modified"
                ),
                error_code=1,
            )


def _sm_lock_reads_as(
    found: ClockLockState,
    want: tuple[float, float] | None,
    full_range: tuple[float, float] | None,
) -> tuple[bool | None, str]:
    """Whether the driver's lock state is ``want`` (``None``: unlocked); None: it cannot tell.

    A lock to the device's ``full_range`` may read as no lock at all (sysfs). Also returns what
    was read, in words (for a mismatch), or what could not be (when it cannot tell).
    """
    if found.range_mhz is not None:
        shown = "locked to {:g}-{:g} MHz".format(*found.range_mhz)
    elif found.locked is None:
        shown = "whether a lock is in force"
    else:
        shown = "locked" if found.locked else "unlocked"
    if want is None:
        if found.locked is None:
            return None, "whether a lock is in force"
        return (not found.locked), shown
    if found.locked is False:
        return want == full_range, shown
    if found.locked is None or found.range_mhz is None:
        return None, "the locked range"
    same = all(abs(a - b) <= _CLOCK_TOLERANCE_MHZ for a, b in zip(found.range_mhz, want))
    return same, shown


def _restore_power_limit(device: Device, change: Change, dry_run: bool) -> tuple[str, Any]:
    """The action, and the value found when it was left alone (someone else's), else None."""
    original_w = float(change.original)
    current_w = device.read_state().power_limit_w
    if current_w is not None and abs(current_w - original_w) <= _POWER_TOLERANCE_W:
        return f"power limit already at {original_w:g} W", None
    ours = [float(t) for t in (change.target, change.previous_target) if t is not None]
    if (
        current_w is not None
        and ours
        and all(abs(current_w - t) > _POWER_TOLERANCE_W for t in ours)
    ):
        return (
            f"left the power limit at {current_w:g} W: changed by someone else after powerlib set "
            f"{ours[0]:g} W",
            current_w,
        )
    if not dry_run:
        device.set_power_limit(original_w)
    return f"set power limit back to {original_w:g} W", None


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

    Returns:
        One outcome per item, plus journal-level outcomes (unreadable, refused, skipped). Empty
        when the state folder does not exist or holds no journal.

    Raises:
        UntrustedStateError: The state folder (or the folder holding it) is untrusted.
        ConfigError: The state path cannot be a folder.
        PermissionDeniedError: The state folder cannot be listed.
    """
    state = StateDir(settings.state_dir)  # another user's: restore_for_user, never their values
    if not state.inspect():
        return []
    paths = list_journals(state)
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
                outcomes.append(journal_note(path, str(entry), error=entry))
                continue
            if owner is not None and (entry.owner.pid, entry.owner.start_time_s) != (
                owner.pid,
                owner.start_time_s,
            ):
                continue
            if read_only is not None and (include_live or not entry.owner.is_alive()):
                outcomes.extend(
                    _failed_item(
                        entry.device_id,
                        change,
                        f"not restored: {read_only}",
                        read_only,
                        journal=path,
                        owner_pid=entry.owner.pid,
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

    Its exit code is the first failure's (docs/json-and-exit-codes.md) and its message is one line: the
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
        return [journal_note(path, action, error=error, entry=entry)]

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
        return [
            dataclasses.replace(o, journal=str(path), owner_pid=entry.owner.pid)
            for o in restore_and_discard(device, entry.changes, state, path, dry_run=dry_run)
        ]
    finally:
        lock.release()
