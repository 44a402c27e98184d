"""A restore acting for another user: root, in a Slurm epilog, resets a job's devices.

``powerlib restore --for-user UID --job JOB`` (and the agent when a lease's owner is gone) puts
back what that user's dead sessions left, on that job's devices only, and never writes a value
the user's files supply: each changed item is reset to the driver's default and read back
(docs/agent.md §4). :func:`restore_for_user` says the rules in full.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from powerlib.backend import match_device
from powerlib.config import Settings, user_state_dirs
from powerlib.control.journal import (
    Change,
    JournalEntry,
    journal_names,
    read_journal,
    remove_journal,
)
from powerlib.control.locks import DeviceLock
from powerlib.control.restore import RestoreOutcome, journal_note, restore_device
from powerlib.control.state import Owner, StateDir, device_key
from powerlib.control.trust import describe_owner, open_user_folder
from powerlib.device import Device
from powerlib.errors import DeviceBusyError, DeviceNotFoundError, PowerlibError
from powerlib.inputs import show_path
from powerlib.registry import open_backend

__all__ = ["restore_for_user"]

logger = logging.getLogger(__name__)

_ITEMS_BY_CAPABILITY = (
    ("sm_clocks", "can_lock_sm_clocks"),
    ("memory_clocks", "can_lock_memory_clocks"),
    ("power_limit", "can_set_power_limit"),
)


def restore_for_user(
    settings: Settings,
    uid: int,
    devices: Iterable[str],
    *,
    user_dirs: Sequence[Path] | None = None,
    include_live: bool = False,
    dry_run: bool = False,
) -> list[RestoreOutcome]:
    """Put back what ``uid``'s dead sessions left on that user's job's devices (root, an epilog).

    The trust rules for acting on someone else's behalf (docs/agent.md §4):

    * **Only the job's devices.** ``devices`` (any id form, resolved exactly on this restore's
      own backend) come from root: ``--devices`` or the job's grant. Only the journals filed
      under those devices' names are opened; any other file is counted in one skipped line.
    * **No value from the user's files.** A journal only says which items of which device were
      changed; each is reset to the driver's default (clocks unlocked, the default power
      limit) and read back. A journal that cannot be read or trusted, filed under one of the
      job's devices' names, resets every item of that device that has a driver default. An
      item the device cannot reset to a default is skipped and said, never a failure.
    * **Root's own lock.** The device's lock is taken in root's state folder
      (``settings.state_dir``), the one the agent's leases hold: a device leased by a live
      process is left to its lease and skipped.
    * **The user's folders are hostile.** Each is opened from ``/`` one component at a time,
      following no link in any of them, with root's folders above the user's part and exactly
      the user's from there down, root not counted as an owner of the user's folders and files,
      and never on a FUSE mount (:func:`~powerlib.control.trust.open_user_folder`); every later
      step goes through that descriptor (``openat``), nothing is created in it, and a journal is
      removed with ``unlinkat`` once its device is reset. A folder that is untrusted, planted by
      someone else, missing or unreadable is skipped and said: it never fails the restore, so
      no user can make an epilog exit non-zero and drain a node. Only a device of the job that
      could not be reset is a failure.

    Args:
        settings: Root's settings: its backend (``auto`` finds the node's devices), sysfs root,
            and state folder, where device locks are taken.
        uid: The user acted for.
        devices: The job's devices.
        user_dirs: The user's state folders (default :func:`~powerlib.config.user_state_dirs`).
        include_live: Also journals whose owner still runs.
        dry_run: Say what would be done; change and delete nothing.

    Raises:
        DeviceNotFoundError: A device selector names no device of this node.
        BackendUnavailableError: The backend cannot be opened.
    """
    settings = settings.replace(
        cuda_visible_devices=None, hip_visible_devices=None, rocr_visible_devices=None
    )
    folders = list(user_state_dirs(uid, settings.state_dir) if user_dirs is None else user_dirs)
    backend = open_backend(settings=settings)
    try:
        all_devices = backend.devices()
        job: dict[str, Device] = {}
        for selector in devices:
            dev = match_device(all_devices, selector)
            if dev is None:
                raise DeviceNotFoundError(
                    f"no {backend.name} device {show_path(str(selector))} on this node (an "
                    "index, UUID or PCI bus id)"
                )
            job[dev.device_id] = dev
        by_name = {f"{device_key(backend.name, d.device_id)}.json": d for d in job.values()}
        root_state = StateDir(settings.state_dir)
        outcomes: list[RestoreOutcome] = []
        for folder in dict.fromkeys(Path(f) for f in folders):
            outcomes.extend(
                _restore_user_folder(folder, uid, job, by_name, root_state, include_live, dry_run)
            )
        return outcomes
    finally:
        backend.close()


def _skip(path: Path, action: str, entry: JournalEntry | None = None) -> RestoreOutcome:
    """A journal-level note of what a restore for a user deliberately left, logged."""
    logger.warning("%s: %s", show_path(path), action)
    return dataclasses.replace(journal_note(path, action, entry=entry), skipped=True)


def _restore_user_folder(
    folder: Path,
    uid: int,
    job: dict[str, Device],
    by_name: dict[str, Device],
    root_state: StateDir,
    include_live: bool,
    dry_run: bool,
) -> list[RestoreOutcome]:
    """Restore from one of the user's state folders.

    Only the journals filed under the job's devices' names are opened (``openat``); any other
    file is counted in one skipped line, so a folder of a million junk files costs a listing,
    not a million reads or a million log lines.
    """
    try:
        fd = open_user_folder(folder, uid)
    except PowerlibError as err:
        return [_skip(folder, f"skipped the state folder of {describe_owner(uid)}: {err}")]
    if fd is None:
        return []
    state = _UserStateDir(folder, uid, fd)
    try:
        return _restore_user_state(state, uid, job, by_name, root_state, include_live, dry_run)
    finally:
        os.close(fd)


class _UserStateDir(StateDir):
    """A user's state folder as :func:`~powerlib.control.trust.open_user_folder` opened it.

    Every operation goes through that descriptor, never the folder's name again, so a component
    its user swaps afterwards changes nothing; ``journal/`` and ``locks/`` are opened from it
    with ``O_NOFOLLOW`` and, like the journals, must be owned by exactly ``uid`` (not root).

    Args:
        root: The folder's path (for messages).
        uid: Its user.
        fd: Its descriptor (the caller keeps and closes it).
    """

    def __init__(self, root: Path, uid: int, fd: int) -> None:
        super().__init__(root)
        self.trusted_uids = frozenset({uid})
        self._fd = fd

    @contextlib.contextmanager
    def folder(self, sub: str | None = None) -> Iterator[int]:
        """A descriptor of the folder (``sub=None``) or of ``journal``/``locks`` in it."""
        fd = os.dup(self._fd) if sub is None else self._open_dir(self.root / sub, self._fd)
        try:
            yield fd
        finally:
            os.close(fd)

    def inspect(self) -> bool:
        """Check ``journal/`` and ``locks/`` where they exist (the folder itself was walked)."""
        for sub in (self.journal_dir, self.lock_dir):
            with contextlib.suppress(FileNotFoundError), self.folder(sub.name):
                pass
        return True


def _restore_user_state(
    state: StateDir,
    uid: int,
    job: dict[str, Device],
    by_name: dict[str, Device],
    root_state: StateDir,
    include_live: bool,
    dry_run: bool,
) -> list[RestoreOutcome]:
    """Restore from one of the user's state folders, opened and checked (``state``)."""
    try:
        state.inspect()
        names = journal_names(state)
    except PowerlibError as err:
        return [_skip(state.root, f"skipped the state folder of {describe_owner(uid)}: {err}")]
    outcomes: list[RestoreOutcome] = []
    others = len(names - by_name.keys())
    if others:
        outcomes.append(
            _skip(
                state.journal_dir,
                f"skipped {others} journal file(s) not filed under one of the job's devices "
                f"({', '.join(job) or 'none'}); a restore for {describe_owner(uid)} acts on "
                "nothing else",
            )
        )
    for name, dev in by_name.items():
        if name not in names:
            continue
        path = state.journal_dir / name
        try:
            entry: JournalEntry | None = read_journal(state, path)
        except PowerlibError as err:
            entry = None  # its name is all root needs: the device is reset to its defaults
            reason = f"the journal is not trusted ({err})"
            items = [c for c, capability in _ITEMS_BY_CAPABILITY if _can(dev, capability)]
        else:
            assert entry is not None
            if not include_live and entry.owner.is_alive():
                outcomes.append(
                    _skip(
                        path,
                        f"skipped: its owner (pid {entry.owner.pid}) is still running; use --all "
                        "to force",
                        entry,
                    )
                )
                continue
            reason = "the journal's values are never used for another user"
            capable = {c for c, capability in _ITEMS_BY_CAPABILITY if _can(dev, capability)}
            items = [c.item for c in entry.changes if c.item in capable]
            cannot = [c.item for c in entry.changes if c.item not in capable]
            if cannot:  # a user's file must never make the restore fail: said, not acted on
                outcomes.append(
                    _skip(
                        path,
                        f"skipped {', '.join(cannot)} of {dev.device_id}: the device cannot "
                        "reset it to a driver default",
                        entry,
                    )
                )
        outcomes.extend(
            _reset_to_defaults(dev, items, reason, root_state, state, path, entry, dry_run)
        )
    return outcomes


def _can(dev: Device, capability: str) -> bool:
    """Whether ``dev`` can reset the item ``capability`` stands for to a driver default."""
    caps = dev.info.capabilities
    if capability == "can_set_power_limit":
        return caps.can_set_power_limit and dev.info.default_power_limit_w is not None
    return bool(getattr(caps, capability))


def _reset_to_defaults(
    dev: Device,
    items: Sequence[str],
    reason: str,
    root_state: StateDir,
    user_state: StateDir,
    journal: Path,
    entry: JournalEntry | None,
    dry_run: bool,
) -> list[RestoreOutcome]:
    """Reset ``items`` of ``dev`` to the driver's defaults under root's lock, and read back."""
    owner_pid = None if entry is None else entry.owner.pid
    changes = [
        Change(item=item, original=dev.info.default_power_limit_w)
        if item == "power_limit"
        else Change(item=item, original=None)
        for item in items
    ]
    if not changes:  # nothing the device can reset: the journal has told all it can
        if not dry_run:
            remove_journal(user_state, journal)
        return []
    lock = DeviceLock(root_state, device_key(dev.info.backend, dev.device_id))
    if not dry_run:
        try:
            root_state.prepare()
            lock.acquire(Owner.current())
        except DeviceBusyError as err:
            return [
                _skip(
                    journal,
                    f"left {dev.device_id} alone: {err.message} (its lease puts it back)",
                    entry,
                )
            ]
        except PowerlibError as err:
            return [
                RestoreOutcome(
                    device_id=dev.device_id,
                    item="journal",
                    action=f"failed: not reset, root's device lock cannot be taken: {err}",
                    ok=False,
                    journal=str(journal),
                    owner_pid=owner_pid,
                    error_code=err.exit_code,
                )
            ]
    try:
        done = restore_device(dev, changes, dry_run=dry_run)
    finally:
        lock.release()
    outcomes = [
        dataclasses.replace(
            o,
            action=f"reset to the driver default ({reason}): {o.action}",
            journal=str(journal),
            owner_pid=owner_pid,
        )
        for o in done
    ]
    if not dry_run and all(o.ok for o in outcomes):
        remove_journal(user_state, journal)
    return outcomes
