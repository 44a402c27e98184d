"""Crash-safe records of what powerlib changed: journals, owners and per-device locks.

Layout of the state directory (``POWERLIB_STATE_DIR``, created 0700)::

    journal/<key>.json   what a session changed on one device, with the original values (0600)
    locks/<key>.lock     a POSIX record lock held by the one session controlling the device
    locks/<key>.owner    who holds it (pid, start time, host), for "device busy" messages

``<key>`` is the backend name and the device's stable id (UUID, sysfs zone), never an index.

Why POSIX record locks (``lockf``) and not ``flock``: a record lock belongs to the process, so it
is released when the process dies and is *not* inherited by ``fork`` children (a DataLoader worker
that outlives a killed trainer would otherwise keep the device "busy"). The price is that closing
any descriptor of the lock file in the owning process drops the lock, so this module never opens a
lock file twice in one process (see :data:`_HELD`).

A journal names its owner by pid *and* process start time (psutil), so a reused pid is never
mistaken for the owner. Journals are written atomically (temporary file, fsync, rename, fsync of
the directory) before the change they describe; files are opened with ``O_NOFOLLOW`` and the
directories are refused if they are symlinks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from powerlib.errors import ConfigError, DeviceBusyError, PermissionDeniedError, PowerlibError

__all__ = [
    "JOURNAL_SCHEMA",
    "Change",
    "DeviceLock",
    "JournalEntry",
    "JournalError",
    "Owner",
    "StateDir",
    "device_key",
]

logger = logging.getLogger(__name__)

JOURNAL_SCHEMA = "powerlib.journal.v1"
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_START_TIME_TOLERANCE_S = 0.05

# Lock files this process holds, by path: opening one again would drop the POSIX lock.
_HELD: dict[str, DeviceLock] = {}
_HELD_GUARD = threading.Lock()


class JournalError(PowerlibError):
    """A journal is unreadable (truncated, corrupted, foreign schema); it is left in place."""

    exit_code = 11


def device_key(backend: str, device_id: str) -> str:
    """File-name-safe key of one device: backend name plus stable id."""
    return f"{backend}--{_KEY_UNSAFE.sub('_', device_id)}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Owner:
    """A process that controls devices.

    Attributes:
        pid: Process id.
        start_time_s: Process start time (psutil ``create_time``), which tells a reused pid apart.
        hostname: Host the process runs on (a state directory must be local, but say so if not).
        argv: Its command line, for humans.
    """

    pid: int
    start_time_s: float
    hostname: str
    argv: str = ""

    @classmethod
    def current(cls) -> Owner:
        """This process."""
        return cls(
            pid=os.getpid(),
            start_time_s=psutil.Process().create_time(),
            hostname=socket.gethostname(),
            argv=" ".join(sys.argv)[:200],
        )

    def is_alive(self) -> bool:
        """True if this exact process (same pid *and* start time, same host) still runs."""
        if self.hostname != socket.gethostname():
            return (
                True  # cannot tell from here: treat as alive, never restore another host's devices
            )
        try:
            proc = psutil.Process(self.pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return False
            return abs(proc.create_time() - self.start_time_s) <= _START_TIME_TOLERANCE_S
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "pid": self.pid,
            "start_time_s": self.start_time_s,
            "hostname": self.hostname,
            "argv": self.argv,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Owner:
        """Parse the JSON form (``KeyError``/``TypeError``/``ValueError`` when malformed)."""
        return cls(
            pid=int(data["pid"]),
            start_time_s=float(data["start_time_s"]),
            hostname=str(data["hostname"]),
            argv=str(data.get("argv", "")),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """One setting a session changed on a device.

    Attributes:
        item: ``"sm_clocks"``, ``"memory_clocks"`` or ``"power_limit"``.
        original: The value before the session touched it: ``[lo, hi]`` MHz or ``None`` (unlocked)
            for clocks, watts for the power limit.
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
        """Parse a journal; ``JournalError`` names ``source`` and what is wrong."""
        try:
            if data.get("schema") != JOURNAL_SCHEMA:
                raise ValueError(f"unknown schema {data.get('schema')!r}")
            changes = []
            for raw in data["changes"]:
                item = str(raw["item"])
                if item not in ("sm_clocks", "memory_clocks", "power_limit"):
                    raise ValueError(f"unknown item {item!r}")
                changes.append(
                    Change(
                        item=item,
                        original=raw["original"],
                        target=raw.get("target"),
                        previous_target=raw.get("previous_target"),  # absent in older journals
                    )
                )
            return cls(
                device_id=str(data["device_id"]),
                device_name=str(data.get("device_name", "")),
                backend=str(data["backend"]),
                backend_settings=dict(data.get("backend_settings", {})),
                owner=Owner.from_json(data["owner"]),
                created_s=float(data["created_s"]),
                changes=tuple(changes),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            raise JournalError(f"journal {source} is malformed ({err}); left in place") from err


class StateDir:
    """The state directory: validated once, then journals and locks live under it.

    Args:
        root: ``Settings.state_dir``.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.journal_dir = self.root / "journal"
        self.lock_dir = self.root / "locks"

    def prepare(self) -> StateDir:
        """Create the directories (0700) and check they are usable.

        Raises:
            PermissionDeniedError: A directory cannot be created or written.
            ConfigError: A directory is a symlink or not a directory.
        """
        for path in (self.root, self.journal_dir, self.lock_dir):
            try:
                path.mkdir(mode=0o700, parents=path is self.root, exist_ok=True)
            except OSError as err:
                raise PermissionDeniedError(
                    f"cannot create the state directory {path} ({err.strerror}); powerlib will not "
                    "change a device it cannot journal: set POWERLIB_STATE_DIR to a writable local "
                    "directory"
                ) from err
            if path.is_symlink() or not path.is_dir():
                raise ConfigError(f"{path} is a symlink or not a directory; refusing to use it")
            if not os.access(path, os.W_OK | os.X_OK):
                raise PermissionDeniedError(
                    f"the state directory {path} is not writable; powerlib will not change a device "
                    "it cannot journal: set POWERLIB_STATE_DIR to a writable local directory"
                )
        return self

    def journal_path(self, key: str) -> Path:
        """Where the journal of device ``key`` lives."""
        return self.journal_dir / f"{key}.json"

    def write_journal(self, entry: JournalEntry) -> Path:
        """Write ``entry`` atomically and durably (temporary file, fsync, rename, fsync dir)."""
        path = self.journal_path(entry.key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        data = json.dumps(entry.to_json(), indent=1).encode()
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            dir_fd = os.open(self.journal_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as err:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise PermissionDeniedError(
                f"cannot write the journal {path} ({err.strerror}); the device was not changed"
            ) from err
        return path

    def read_journal(self, path: Path) -> JournalEntry:
        """Read one journal. Raises ``JournalError`` when it is unreadable or malformed."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                raw = f.read()
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise JournalError(
                    f"journal {path} is a symlink; not followed, left in place"
                ) from err
            raise JournalError(f"journal {path} cannot be read ({err.strerror})") from err
        try:
            data = json.loads(raw)
        except ValueError as err:
            raise JournalError(
                f"journal {path} is truncated or corrupted ({err}); left in place"
            ) from err
        return JournalEntry.from_json(data, str(path))

    def journals(self) -> list[Path]:
        """Every journal file, oldest first."""
        if not self.journal_dir.is_dir():
            return []
        paths = [p for p in self.journal_dir.glob("*.json") if not p.name.startswith(".")]
        return sorted(paths, key=lambda p: (p.lstat().st_mtime, p.name))

    def remove_journal(self, path: Path) -> None:
        """Delete a journal once its device is restored."""
        with contextlib.suppress(OSError):
            path.unlink()


class DeviceLock:
    """The exclusive right to change one device: a POSIX record lock on ``locks/<key>.lock``.

    Args:
        state: The prepared state directory.
        key: :func:`device_key` of the device.
    """

    def __init__(self, state: StateDir, key: str) -> None:
        self.state = state
        self.key = key
        self.path = state.lock_dir / f"{key}.lock"
        self.owner_path = state.lock_dir / f"{key}.owner"
        self._fd: int | None = None

    @property
    def is_held(self) -> bool:
        """True while this object holds the lock."""
        return self._fd is not None

    def acquire(self, owner: Owner) -> None:
        """Take the lock without waiting.

        Raises:
            DeviceBusyError: Another session (in this or another process) holds it; the message
                names the owner's pid.
            PermissionDeniedError: The lock file cannot be created.
        """
        with _HELD_GUARD:
            if str(self.path) in _HELD:
                raise DeviceBusyError(
                    f"another powerlib session in this process (pid {os.getpid()}) controls this "
                    "device",
                    device=self.key,
                )
            try:
                fd = os.open(
                    self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
                )
            except OSError as err:
                raise PermissionDeniedError(
                    f"cannot open the lock file {self.path} ({err.strerror})"
                ) from err
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EACCES, errno.EAGAIN):
                    holder = self.read_owner()
                    who = (
                        f"pid {holder.pid} ({holder.argv or 'unknown command'})"
                        if holder
                        else "another process"
                    )
                    raise DeviceBusyError(
                        f"the device is controlled by {who}; wait for it to finish",
                        device=self.key,
                    ) from err
                raise PermissionDeniedError(f"cannot lock {self.path} ({err.strerror})") from err
            self._fd = fd
            _HELD[str(self.path)] = self
        self._write_owner(owner)

    def release(self) -> None:
        """Give the lock up (idempotent)."""
        with _HELD_GUARD:
            if self._fd is None:
                return
            with contextlib.suppress(OSError):
                self.owner_path.unlink()
            os.close(self._fd)  # closing the only descriptor releases the record lock
            self._fd = None
            _HELD.pop(str(self.path), None)

    def _write_owner(self, owner: Owner) -> None:
        tmp = self.owner_path.with_name(f".{self.owner_path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
            with os.fdopen(fd, "w") as f:
                json.dump(owner.to_json(), f)
            os.replace(tmp, self.owner_path)
        except OSError as err:  # only used for messages: never fatal
            logger.debug("cannot write %s: %s", self.owner_path, err)

    def read_owner(self) -> Owner | None:
        """Who holds the lock, as recorded beside it (``None`` if unknown)."""
        try:
            fd = os.open(self.owner_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd) as f:
                return Owner.from_json(json.load(f))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @classmethod
    def is_free(cls, state: StateDir, key: str) -> bool:
        """True if nobody holds the lock.

        Checked by taking and dropping it, except in the process that holds it (reopening the
        file there would drop the POSIX lock).
        """
        lock = cls(state, key)
        with _HELD_GUARD:
            if str(lock.path) in _HELD:
                return False
        if not lock.path.exists():
            return True
        try:
            lock.acquire(Owner.current())
        except DeviceBusyError:
            return False
        lock.release()
        return True


def iter_entries(state: StateDir) -> Iterator[tuple[Path, JournalEntry | JournalError]]:
    """Every journal with its parsed entry, or the error that makes it unreadable."""
    for path in state.journals():
        try:
            yield path, state.read_journal(path)
        except JournalError as err:
            yield path, err


def now_s() -> float:
    """Wall-clock time for journal stamps."""
    return time.time()
