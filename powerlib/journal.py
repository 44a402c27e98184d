"""Crash-safe records of what powerlib changed on a device, and the state folder that holds them.

Layout of the state directory (``POWERLIB_STATE_DIR``, created 0700)::

    journal/<key>.json   what a session changed on one device, with the original values (0600)
    locks/<key>.lock     a POSIX record lock held by the one session controlling the device
    locks/<key>.owner    who holds it (pid, start time, host), for "device busy" messages

``<key>`` is the backend name and the device's stable id (UUID, sysfs zone), never an index. The
keys, owners, locks and the trust rules live in :mod:`powerlib.ownership`; they are importable
from here too.

A journal names its owner by pid *and* process start time (psutil), so a reused pid is never
mistaken for the owner. Journals are written atomically (temporary file, fsync, rename, fsync of
the directory) before the change they describe; files are opened with ``O_NOFOLLOW`` and the
directories are refused if they are symlinks.

Trust (``powerlib restore`` runs as root on shared nodes): a state folder (the root, ``journal/``,
``locks/``) or a journal is used only if it passes :func:`~powerlib.ownership.check_trusted`
(owned by the euid, root or a uid named with ``--trust-owner``, not writable by group or others,
a real folder or regular file). A journal is read through :mod:`powerlib.inputs` (1 MiB cap,
UTF-8, nesting limit) with ``O_NOFOLLOW``, and its owner and mode are checked with ``fstat`` on
the opened descriptor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import stat
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from powerlib.errors import (
    ConfigError,
    PermissionDeniedError,
    PowerlibError,
    UntrustedStateError,
)
from powerlib.inputs import decode_text, parse_json, read_bytes
from powerlib.ownership import (
    DeviceLock,
    Owner,
    bounded_text,
    check_trusted,
    create_new,
    describe_owner,
    device_key,
    finite_number,
    is_int,
    show_path,
)

__all__ = [
    "JOURNAL_SCHEMA",
    "Change",
    "DeviceLock",
    "JournalEntry",
    "JournalError",
    "Owner",
    "StateDir",
    "UNKNOWN_LOCK",
    "check_trusted",
    "describe_owner",
    "device_key",
]

logger = logging.getLogger(__name__)

JOURNAL_SCHEMA = "powerlib.journal.v1"
#: A journal is well under 4 KiB; anything over this cap is refused unread.
JOURNAL_MAX_BYTES = 1024 * 1024
#: A journal nests 4 levels deep (entry, changes, change, clock range).
JOURNAL_MAX_DEPTH = 16
_JOURNAL_NAME = re.compile(r"[A-Za-z0-9._-]+\.json")
_BACKEND_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_ITEMS = ("sm_clocks", "memory_clocks", "power_limit")
#: The original of SM clocks someone else locked to a range the driver does not report (NVML):
#: journaled only by a forced session (docs/real-gpu.md §1); restoring it means unlocking.
UNKNOWN_LOCK = "unknown-lock"


class JournalError(PowerlibError):
    """A journal is unreadable (truncated, corrupted, foreign schema); it is left in place."""

    exit_code = 11


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """One setting a session changed on a device.

    Attributes:
        item: ``"sm_clocks"``, ``"memory_clocks"`` or ``"power_limit"``.
        original: The value before the session touched it: ``[lo, hi]`` MHz or ``None`` (unlocked)
            for clocks, or :data:`UNKNOWN_LOCK` for SM clocks locked to a range the driver does
            not report (a restore unlocks them); watts for the power limit.
        target: The value the session set last, when it is one value (the power limit); ``None``
            for clocks, which a session may change many times per second.
        previous_target: The target before ``target``. The journal is written *before* the device,
            so a process killed in between leaves the device at ``previous_target``; a restore
            must not mistake that for someone else's change.
    """

    item: str
    original: Any
    target: Any = None
    previous_target: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class JournalEntry:
    """Everything needed to put one device back, from any process.

    Attributes:
        device_id: Stable id of the device.
        device_name: For humans.
        backend: Registry name of the backend to reopen.
        backend_settings: The settings needed to reopen the same backend (sysfs root, simulated
            model and count); visibility variables are not recorded: restores see every device.
        owner: The session's process.
        created_s: When the journal was first written (``time.time()``).
        changes: Changed items, in the order they were first touched.
    """

    device_id: str
    device_name: str
    backend: str
    backend_settings: Mapping[str, Any]
    owner: Owner
    created_s: float
    changes: tuple[Change, ...] = field(default_factory=tuple)

    @property
    def key(self) -> str:
        """The device key (file names)."""
        return device_key(self.backend, self.device_id)

    def with_change(self, change: Change) -> JournalEntry:
        """A copy with ``change`` recorded.

        The original of an item is captured once and never overwritten; a later change of the
        same item only updates its target.
        """
        existing = self.change(change.item)
        if existing is None:
            return dataclasses.replace(self, changes=(*self.changes, change))
        updated = Change(
            item=change.item,
            original=existing.original,
            target=change.target,
            previous_target=existing.target,
        )
        return dataclasses.replace(
            self, changes=tuple(updated if c.item == change.item else c for c in self.changes)
        )

    def change(self, item: str) -> Change | None:
        """The change of ``item``, if any."""
        return next((c for c in self.changes if c.item == item), None)

    def to_json(self) -> dict[str, Any]:
        """JSON form (schema ``powerlib.journal.v1``)."""
        return {
            "schema": JOURNAL_SCHEMA,
            "device_id": self.device_id,
            "device_name": self.device_name,
            "backend": self.backend,
            "backend_settings": dict(self.backend_settings),
            "owner": self.owner.to_json(),
            "created_s": self.created_s,
            "changes": [
                {
                    "item": c.item,
                    "original": c.original,
                    "target": c.target,
                    "previous_target": c.previous_target,
                }
                for c in self.changes
            ],
        }

    @classmethod
    def from_json(cls, data: Any, source: str) -> JournalEntry:
        """Parse a journal; ``JournalError`` names ``source`` and what is wrong.

        Every field is checked for its type and range (finite numbers, ``[lo, hi]`` clock
        ranges, known items, one change per item), so a restore never acts on a guess.
        """
        try:
            if not isinstance(data, Mapping):
                raise TypeError(f"it is a JSON {type(data).__name__}, not an object")
            if data.get("schema") != JOURNAL_SCHEMA:
                raise ValueError(f"unknown schema {data.get('schema')!r}")
            raw_changes = data["changes"]
            if not isinstance(raw_changes, list):
                raise TypeError("changes is not a list")
            changes: list[Change] = []
            for raw in raw_changes:
                if not isinstance(raw, Mapping):
                    raise TypeError("a change is not an object")
                item = raw["item"]
                if item not in _ITEMS:
                    raise ValueError(f"unknown item {item!r}")
                if any(c.item == item for c in changes):
                    raise ValueError(f"item {item!r} appears twice")
                changes.append(
                    Change(
                        item=item,
                        original=_setting(item, raw["original"], "original"),
                        target=_setting(item, raw.get("target"), "target"),
                        previous_target=_setting(  # absent in older journals
                            item, raw.get("previous_target"), "previous_target"
                        ),
                    )
                )
            backend = data["backend"]
            if not isinstance(backend, str) or not _BACKEND_NAME.fullmatch(backend):
                raise ValueError(f"backend {backend!r} is not a backend name")
            backend_settings = data.get("backend_settings", {})
            if not isinstance(backend_settings, Mapping):
                raise TypeError("backend_settings is not an object")
            return cls(
                device_id=bounded_text(data["device_id"], "device_id", empty_ok=False),
                device_name=bounded_text(data.get("device_name", ""), "device_name"),
                backend=backend,
                backend_settings=_backend_settings(backend_settings),
                owner=Owner.from_json(data["owner"]),
                created_s=finite_number(data["created_s"], "created_s"),
                changes=tuple(changes),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            raise JournalError(
                f"journal {show_path(source)} is malformed ({err}); left in place"
            ) from err


def _setting(item: str, value: Any, name: str) -> Any:
    """A recorded value: ``None``, watts, a ``[lo, hi]`` MHz range, or :data:`UNKNOWN_LOCK`."""
    if value is None:
        if item == "power_limit" and name == "original":
            raise ValueError("the original power limit is missing")
        return None
    if item == "sm_clocks" and name == "original" and value == UNKNOWN_LOCK:
        return UNKNOWN_LOCK
    if item == "power_limit":
        watts = finite_number(value, f"power_limit {name}")
        if watts <= 0:
            raise ValueError(f"power_limit {name} {watts:g} W is not positive")
        return watts
    if not isinstance(value, list) or len(value) != 2:
        raise TypeError(f"{item} {name} is not a [lo, hi] MHz range")
    lo, hi = (finite_number(v, f"{item} {name}") for v in value)
    if not 0 < lo <= hi:
        raise ValueError(f"{item} {name} [{lo:g}, {hi:g}] is not a clock range")
    return [lo, hi]


def _backend_settings(saved: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in saved.items():
        if key == "sysfs_root":
            out[key] = bounded_text(value, f"backend_settings.{key}", limit=4096)
        elif key == "sim_model":
            if not isinstance(value, str) or not _BACKEND_NAME.fullmatch(value):
                raise ValueError(f"backend_settings.sim_model {value!r} is not a model name")
            out[key] = value
        elif key == "sim_gpus":
            if not is_int(value) or not 0 <= value <= 1024:
                raise ValueError(f"backend_settings.sim_gpus {value!r} is not a count of GPUs")
            out[key] = value
        # Other keys (a newer powerlib's) are ignored: they never reach a backend.
    return out


class StateDir:
    """The state directory: validated once, then journals and locks live under it.

    Every file operation goes through folder descriptors (:meth:`folder`): the state folder is
    opened with ``O_DIRECTORY | O_NOFOLLOW`` and checked with ``fstat``, and ``journal/`` and
    ``locks/`` are opened relative to it the same way, so a folder that its owner swaps for a
    symlink between a check and a use is never followed (``openat``, ``unlinkat``,
    ``renameat``; docs/agent.md §4). Only the state folder's own path is resolved by name, and
    its parent must not let others replace it (:meth:`_check_parent`).

    Args:
        root: ``Settings.state_dir``.
        trusted_uids: Owners trusted besides the euid and root (a restore acting for a user);
            only ever widens who may own the folders and journals, never the mode and type
            rules.
    """

    def __init__(self, root: Path, trusted_uids: Iterable[int] = ()) -> None:
        self.root = Path(root)
        self.journal_dir = self.root / "journal"
        self.lock_dir = self.root / "locks"
        self.trusted_uids = frozenset({os.geteuid(), 0, *trusted_uids})

    def prepare(self) -> StateDir:
        """Create the directories (0700) and check they are usable and trusted.

        The rules are those a restore applies (:meth:`inspect`), so a session never writes a
        journal that ``powerlib restore`` would refuse.

        Raises:
            PermissionDeniedError: A directory cannot be created or written.
            UntrustedStateError: A directory is a symlink, not a directory, owned by someone
                untrusted, or writable by group or others, or its parent lets others replace it.
        """
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as err:
            raise self._cannot_create(self.root, err) from err
        self._check_parent()  # a journal restore would refuse protects nothing
        with self.folder() as root_fd:
            for path in (self.journal_dir, self.lock_dir):
                try:
                    os.mkdir(path.name, 0o700, dir_fd=root_fd)
                except FileExistsError:
                    pass
                except OSError as err:
                    raise self._cannot_create(path, err) from err
        for path in (self.root, self.journal_dir, self.lock_dir):
            with self.folder(None if path is self.root else path.name):
                self._check_access(path)
        return self

    @staticmethod
    def _cannot_create(path: Path, err: OSError) -> PermissionDeniedError:
        return PermissionDeniedError(
            f"cannot create the state directory {show_path(path)} ({err.strerror}); "
            "powerlib will not change a device it cannot journal: set POWERLIB_STATE_DIR "
            "to a writable local directory"
        )

    @staticmethod
    def _check_access(path: Path) -> None:
        # access(2) through /proc/self/fd would follow the descriptor; the folder is checked
        # by name here, after its descriptor passed the trust checks
        if not os.access(path, os.W_OK | os.X_OK, follow_symlinks=False):
            raise PermissionDeniedError(
                f"the state directory {show_path(path)} is not writable; powerlib will not "
                "change a device it cannot journal: set POWERLIB_STATE_DIR to a writable "
                "local directory"
            )

    @contextlib.contextmanager
    def folder(self, sub: str | None = None) -> Iterator[int]:
        """A descriptor of the state folder (``sub=None``) or of ``journal``/``locks`` in it.

        Each is opened ``O_DIRECTORY | O_NOFOLLOW`` (the sub-folder relative to the state
        folder's descriptor) and checked with ``fstat`` (:func:`check_trusted`) before it is
        yielded; the descriptor is closed afterwards.

        Raises:
            FileNotFoundError: The folder does not exist.
            UntrustedStateError: A symlink, not a folder, an untrusted owner or a writable mode.
            ConfigError: A part of the state path is a file.
            PermissionDeniedError: The folder cannot be opened.
        """
        path = self.root if sub is None else self.root / sub
        root_fd = self._open_dir(self.root, None)
        try:
            if sub is None:
                yield root_fd
                return
            fd = self._open_dir(path, root_fd)
            try:
                yield fd
            finally:
                os.close(fd)
        finally:
            os.close(root_fd)

    def _open_dir(self, path: Path, parent_fd: int | None) -> int:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = (
                os.open(path, flags)
                if parent_fd is None
                else os.open(path.name, flags, dir_fd=parent_fd)
            )
        except FileNotFoundError:
            raise
        except OSError as err:
            try:  # say what is there instead: a symlink, a file, a fifo ...
                st = (
                    os.lstat(path.name, dir_fd=parent_fd)
                    if parent_fd is not None
                    else os.lstat(path)
                )
            except OSError:
                st = None  # a part of the path above it is not a folder
            if st is not None and not stat.S_ISDIR(st.st_mode):
                check_trusted(
                    path, st, what="state folder", directory=True, trusted_uids=self.trusted_uids
                )
            if err.errno == errno.ENOTDIR and st is None:
                raise ConfigError(
                    f"the state folder {show_path(path)} cannot exist: a part of its path is "
                    "a file, not a folder; set POWERLIB_STATE_DIR to a local folder"
                ) from err
            raise PermissionDeniedError(
                f"cannot open the state folder {show_path(path)} ({err.strerror})"
            ) from err
        try:
            check_trusted(
                path, os.fstat(fd), what="state folder", directory=True,
                trusted_uids=self.trusted_uids,
            )  # fmt: skip
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_folder(self, path: Path) -> bool:
        """Check one state folder; False if it is missing.

        A sub-folder is checked by ``lstat`` relative to the state folder's checked descriptor:
        checking needs no permission to list it.
        """
        try:
            with self.folder() as root_fd:
                if path == self.root:
                    return True
                try:
                    st = os.lstat(path.name, dir_fd=root_fd)
                except FileNotFoundError:
                    return False
                except OSError as err:
                    raise PermissionDeniedError(
                        f"cannot inspect the state folder {show_path(path)} ({err.strerror})"
                    ) from err
                check_trusted(
                    path, st, what="state folder", directory=True, trusted_uids=self.trusted_uids
                )
                return True
        except FileNotFoundError:
            return False

    def inspect(self) -> bool:
        """Check, without creating anything, that the state is one a restore may act on.

        The root, ``journal/`` and ``locks/`` must pass :func:`check_trusted`, and the folder
        holding the root must not let others swap it (owned by a trusted user, and not writable
        by group or others unless sticky, like ``/tmp``).

        Returns:
            False if the state folder does not exist (nothing to restore).

        Raises:
            UntrustedStateError: A folder is untrusted (the line names path, owner and mode).
            ConfigError: The state path cannot be a folder (a part of it is a file).
            PermissionDeniedError: A folder cannot be inspected.
        """
        if not self._check_folder(self.root):
            return False
        self._check_parent()
        self._check_folder(self.journal_dir)
        self._check_folder(self.lock_dir)
        return True

    def _check_parent(self) -> None:
        """Refuse a state folder that others could rename away and replace with their own."""
        parent = self.root.parent
        try:
            st = os.stat(parent)  # symlinks above the state folder (/var/run -> /run) are fine
        except OSError as err:
            raise PermissionDeniedError(
                f"cannot inspect {show_path(parent)}, the folder holding the state folder "
                f"({err.strerror})"
            ) from err
        others_can_swap = st.st_uid not in self.trusted_uids or (
            st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX
        )
        if others_can_swap:
            raise UntrustedStateError(
                f"refusing the state folder {show_path(self.root)}: the folder holding it, "
                f"{show_path(parent)} (owner {describe_owner(st.st_uid)}, mode "
                f"{stat.S_IMODE(st.st_mode):04o} {stat.filemode(st.st_mode)}), lets others "
                "replace it; put the state folder in a folder only trusted users can write "
                "(/run, $XDG_RUNTIME_DIR, or a sticky one such as /tmp)"
            )

    def check_writable(self) -> None:
        """Refuse a restore that could neither lock devices nor remove journals.

        ``os.access`` honours read-only mounts and immutable folders even for root.

        Raises:
            PermissionDeniedError: ``journal/`` or ``locks/`` (or the root, when ``locks/`` is
                yet to be created) cannot be written by this process.
        """
        for path in (self.journal_dir, self.lock_dir if self.lock_dir.exists() else self.root):
            if not os.access(path, os.W_OK | os.X_OK):
                raise PermissionDeniedError(
                    f"the state folder {show_path(path)} is read-only for uid {os.geteuid()}: "
                    "restore cannot take device locks or remove journals, so it restored "
                    "nothing; the journals are left in place"
                )

    def journal_path(self, key: str) -> Path:
        """Where the journal of device ``key`` lives."""
        return self.journal_dir / f"{key}.json"

    def has_journal(self, key: str) -> bool:
        """Whether ``journal/<key>.json`` exists (as anything: a symlink is reported too)."""
        try:
            with self.folder("journal") as fd:
                os.stat(f"{key}.json", dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def write_journal(self, entry: JournalEntry) -> Path:
        """Write ``entry`` atomically and durably (temporary file, fsync, rename, fsync dir)."""
        path = self.journal_path(entry.key)
        tmp = f".{path.name}.{os.getpid()}.tmp"
        data = json.dumps(entry.to_json(), indent=1).encode()
        try:
            with self.folder("journal") as dir_fd:
                try:
                    fd = create_new(tmp, dir_fd=dir_fd)
                    try:
                        os.write(fd, data)
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                    os.fsync(dir_fd)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=dir_fd)
                    raise
        except OSError as err:
            raise PermissionDeniedError(
                f"cannot write the journal {path} ({err.strerror}); the device was not changed"
            ) from err
        return path

    def read_journal(self, path: Path) -> JournalEntry:
        """Read one journal, refusing it unless it is trusted, bounded and well-formed.

        The file is opened with ``O_NOFOLLOW`` relative to the checked descriptor of
        ``journal/`` and its owner, mode and type are checked with ``fstat`` on that
        descriptor (what is checked is what is read); at most :data:`JOURNAL_MAX_BYTES` are
        read, as UTF-8 JSON nested at most :data:`JOURNAL_MAX_DEPTH` deep. A journal must be
        filed under its own device's key.

        Raises:
            UntrustedStateError: A symlink, fifo or other non-regular file, a file owned by an
                untrusted user, or a group/world-writable one.
            JournalError: Unreadable, too large, not UTF-8, not JSON, too deep, malformed, or
                filed under another device's name.
        """
        path = self.journal_dir / Path(path).name
        shown = show_path(path)
        if not _JOURNAL_NAME.fullmatch(path.name):
            raise JournalError(
                f"journal {shown} is not named after a device key ([A-Za-z0-9._-]+.json); "
                "left in place"
            )

        def trusted(st: os.stat_result) -> None:
            check_trusted(path, st, what="journal", directory=False, trusted_uids=self.trusted_uids)

        try:
            with self.folder("journal") as dir_fd:
                try:
                    trusted(os.lstat(path.name, dir_fd=dir_fd))  # symlinks, fifos: never opened
                except OSError as err:
                    raise JournalError(f"journal {shown} cannot be read ({err.strerror})") from err
                try:
                    raw = read_bytes(
                        path,
                        what="journal",
                        error=JournalError,
                        max_bytes=JOURNAL_MAX_BYTES,
                        follow_symlinks=False,
                        check=trusted,
                        dir_fd=dir_fd,
                    )
                    text = decode_text(raw, path=shown, what="journal", error=JournalError)
                    data = parse_json(
                        text, path=shown, what="journal", error=JournalError,
                        max_depth=JOURNAL_MAX_DEPTH,
                    )  # fmt: skip
                except JournalError as err:
                    raise JournalError(f"{err}; the journal is left in place") from err.__cause__
        except FileNotFoundError as err:
            raise JournalError(f"journal {shown} cannot be read (its folder is gone)") from err
        entry = JournalEntry.from_json(data, str(path))
        if path.name != f"{entry.key}.json":
            raise JournalError(
                f"journal {shown} describes {entry.backend} device {show_path(entry.device_id)}, "
                f"whose journal is {entry.key}.json; left in place"
            )
        return entry

    def journals(self) -> list[Path]:
        """Every journal file (``*.json``, not hidden), oldest first.

        Raises:
            PermissionDeniedError: ``journal/`` exists but cannot be listed.
            UntrustedStateError: ``journal/`` is untrusted (or was swapped for a symlink).
        """
        names = self.journal_names()
        if not names:
            return []
        found = []
        try:
            with self.folder("journal") as fd:
                for name in names:
                    try:
                        mtime = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mtime
                    except FileNotFoundError:
                        continue  # restored and removed meanwhile
                    found.append((mtime, name, self.journal_dir / name))
        except (FileNotFoundError, ConfigError):
            return []
        return [path for _, _, path in sorted(found)]

    def journal_names(self) -> set[str]:
        """The names of the journal files (``*.json``, not hidden), without opening any.

        A hidden name is a journal being written (its temporary file).

        Raises:
            PermissionDeniedError: ``journal/`` exists but cannot be listed.
            UntrustedStateError: ``journal/`` is untrusted (or was swapped for a symlink).
        """
        try:
            with self.folder("journal") as fd, os.scandir(fd) as it:
                return {e.name for e in it if e.name.endswith(".json") and e.name[0] != "."}
        except (FileNotFoundError, ConfigError):
            return set()
        except PermissionDeniedError as err:  # the folder could not even be opened
            if not isinstance(err.__cause__, PermissionError):
                raise
            raise self._cannot_list(err.__cause__) from err
        except OSError as err:
            raise self._cannot_list(err) from err

    def _cannot_list(self, err: OSError) -> PermissionDeniedError:
        return PermissionDeniedError(
            f"cannot list the journals in {show_path(self.journal_dir)} ({err.strerror}); "
            "nothing was restored"
        )

    def remove_journal(self, path: Path) -> None:
        """Delete a journal once its device is restored (``unlinkat`` in ``journal/``)."""
        with contextlib.suppress(OSError, PowerlibError), self.folder("journal") as fd:
            os.unlink(Path(path).name, dir_fd=fd)


def iter_entries(state: StateDir) -> Iterator[tuple[Path, JournalEntry | PowerlibError]]:
    """Every journal with its parsed entry, or the error that refuses it.

    The error is a :class:`JournalError` (unreadable, malformed) or an
    :class:`~powerlib.errors.UntrustedStateError` (owner, mode, type). A journal removed after
    it was listed (its owner finished meanwhile) is skipped.
    """
    for path in state.journals():
        try:
            yield path, state.read_journal(path)
        except (JournalError, UntrustedStateError) as err:
            if not os.path.lexists(path):
                continue
            yield path, err


def now_s() -> float:
    """Wall-clock time for journal stamps."""
    return time.time()
