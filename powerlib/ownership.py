"""Who may be trusted and who controls a device: trust checks, owners and per-device locks.

``<key>`` (:func:`device_key`) is the backend name and the device's stable id (UUID, sysfs zone),
never an index. ``locks/<key>.lock`` in the state folder is a POSIX record lock held by the one
session controlling the device; ``locks/<key>.owner`` says who holds it (pid, start time, host),
for "device busy" messages.

Why POSIX record locks (``lockf``) and not ``flock``: a record lock belongs to the process, so it
is released when the process dies and is *not* inherited by ``fork`` children (a DataLoader worker
that outlives a killed trainer would otherwise keep the device "busy"). The price is that closing
any descriptor of the lock file in the owning process drops the lock, so this module never opens a
lock file twice in one process (see :data:`_HELD`).

An :class:`Owner` is named by pid *and* process start time (psutil), so a reused pid is never
mistaken for the owner.

Trust (``powerlib restore`` runs as root on shared nodes): a state folder (the root, ``journal/``,
``locks/``), a journal or a lock file is used only if it is owned by the invoking user (euid),
root, or a uid the caller names explicitly (``powerlib restore --trust-owner UID``), is not
writable by group or others, and is a real folder or a regular file (never a symlink, fifo or
device). Anything else raises :class:`~powerlib.errors.UntrustedStateError` with one line naming
the path, its owner and its mode (:func:`check_trusted`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import pwd
import re
import socket
import stat
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil

from powerlib.errors import (
    DeviceBusyError,
    PermissionDeniedError,
    PowerlibError,
    UntrustedStateError,
)
from powerlib.inputs import decode_text, parse_json, read_bytes

if TYPE_CHECKING:
    from powerlib.journal import StateDir

__all__ = [
    "DeviceLock",
    "Owner",
    "check_trusted",
    "create_new",
    "describe_owner",
    "device_key",
    "show_path",
]

logger = logging.getLogger(__name__)

_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_START_TIME_TOLERANCE_S = 0.05
_MAX_PID = 2**31 - 1
_MAX_TEXT = 512

# Lock files this process holds, by path: opening one again would drop the POSIX lock.
_HELD: dict[str, DeviceLock] = {}
_HELD_GUARD = threading.Lock()


class _OwnerFileError(PowerlibError):
    """A lock's owner file is unreadable; the owner is then unknown (never raised further)."""


def device_key(backend: str, device_id: str) -> str:
    """File-name-safe key of one device: backend name plus stable id."""
    return f"{backend}--{_KEY_UNSAFE.sub('_', device_id)}"


def show_path(path: str | os.PathLike[str]) -> str:
    """A path for a one-line message: as is, or quoted with escapes if it holds control chars."""
    text = os.fspath(path)
    return text if text.isprintable() else ascii(text)


def describe_owner(uid: int) -> str:
    """``uid 1000 (alice)``, or ``uid 12345`` when no user of that uid is known."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, OverflowError):
        return f"uid {uid}"


def _trusted_owners(trusted_uids: Iterable[int]) -> str:
    return " or ".join(describe_owner(uid) for uid in sorted(set(trusted_uids)))


def check_trusted(
    path: str | os.PathLike[str],
    st: os.stat_result,
    *,
    what: str,
    directory: bool,
    trusted_uids: Iterable[int],
) -> None:
    """Refuse ``path`` unless it is state that a restore running as root may act on.

    Args:
        path: The folder or file (for the message).
        st: Its ``lstat`` (folders) or the ``fstat`` of its opened descriptor (journals).
        what: What it is, for the message ("state folder", "journal").
        directory: True for a folder, False for a regular file.
        trusted_uids: Owners that are trusted (the euid and root at least).

    Raises:
        UntrustedStateError: One line naming the path, its owner and mode, and the rule broken.
    """
    trusted = set(trusted_uids)
    mode = st.st_mode
    want_type = stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)
    if not want_type:
        kind = _file_kind(mode)
        problem = f"it is {kind}, not {'a folder' if directory else 'a regular file'}"
        hint = "remove it"
    elif st.st_uid not in trusted:
        problem = f"it is not owned by {_trusted_owners(trusted)}"
        hint = (
            f"a restore for that user's job is `powerlib restore --for-user {st.st_uid} --job "
            "JOB`, which resets the job's devices to their defaults"
        )
    elif mode & (stat.S_IWGRP | stat.S_IWOTH):
        writers = " and ".join(
            who for bit, who in ((stat.S_IWGRP, "group"), (stat.S_IWOTH, "others")) if mode & bit
        )
        problem = f"it is writable by {writers}"
        hint = "chmod go-w it if its content is trusted"
    else:
        return
    raise UntrustedStateError(
        f"refusing the {what} {show_path(path)} (owner {describe_owner(st.st_uid)}, mode "
        f"{stat.S_IMODE(mode):04o} {stat.filemode(mode)}): {problem}; {hint}"
    )


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISFIFO, "a fifo"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return kind
    return "not a regular file or folder"


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
        if not isinstance(data, Mapping):
            raise TypeError("owner is not an object")
        pid = data["pid"]
        if not is_int(pid) or not 0 < pid <= _MAX_PID:
            raise ValueError(f"owner pid {pid!r} is not a process id")
        return cls(
            pid=pid,
            start_time_s=finite_number(data["start_time_s"], "owner start_time_s"),
            hostname=bounded_text(data["hostname"], "owner hostname"),
            argv=bounded_text(data.get("argv", ""), "owner argv", limit=4096),
        )


def is_int(value: Any) -> bool:
    """True for an ``int`` that is not a ``bool`` (journal and owner fields)."""
    return isinstance(value, int) and not isinstance(value, bool)


def finite_number(value: Any, name: str) -> float:
    """``value`` as a finite float; ``TypeError``/``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} is not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} is not finite")
    return number


def bounded_text(value: Any, name: str, *, limit: int = _MAX_TEXT, empty_ok: bool = True) -> str:
    """``value`` as a printable string of at most ``limit`` characters, else raise."""
    if not isinstance(value, str):
        raise TypeError(f"{name} is not a string")
    if len(value) > limit or not value.isprintable() or (not value and not empty_ok):
        raise ValueError(f"{name} is empty, longer than {limit} characters or not printable")
    return value


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
                    f"the device is already held by this process (pid {os.getpid()}): another "
                    "powerlib session in it controls the device; end that session first",
                    device=self.key,
                )
            try:
                with self.state.folder("locks") as dir_fd:
                    fd = os.open(
                        self.path.name,
                        os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                        0o600,
                        dir_fd=dir_fd,
                    )
            except OSError as err:
                raise PermissionDeniedError(
                    f"cannot open the lock file {self.path} ({err.strerror})"
                ) from err
            try:
                self._check_lock_file(fd)
            except BaseException:
                os.close(fd)
                raise
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

    def _check_lock_file(self, fd: int) -> None:
        """The opened lock file must be a trusted regular file with one name (no hard link)."""
        st = os.fstat(fd)
        check_trusted(
            self.path, st, what="lock file", directory=False, trusted_uids=self.state.trusted_uids
        )
        if st.st_nlink != 1:
            raise UntrustedStateError(
                f"refusing the lock file {show_path(self.path)} (owner "
                f"{describe_owner(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o} "
                f"{stat.filemode(st.st_mode)}): it has {st.st_nlink} hard links; remove it"
            )

    def release(self) -> None:
        """Give the lock up (idempotent)."""
        with _HELD_GUARD:
            if self._fd is None:
                return
            with contextlib.suppress(OSError, PowerlibError), self.state.folder("locks") as d:
                os.unlink(self.owner_path.name, dir_fd=d)
            os.close(self._fd)  # closing the only descriptor releases the record lock
            self._fd = None
            _HELD.pop(str(self.path), None)

    def _write_owner(self, owner: Owner) -> None:
        tmp = f".{self.owner_path.name}.{os.getpid()}.tmp"
        try:
            with self.state.folder("locks") as dir_fd:
                fd = create_new(tmp, dir_fd=dir_fd)
                with os.fdopen(fd, "w") as f:
                    json.dump(owner.to_json(), f)
                os.replace(tmp, self.owner_path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except (OSError, PowerlibError) as err:  # only used for messages: never fatal
            logger.debug("cannot write %s: %s", self.owner_path, err)

    def read_owner(self) -> Owner | None:
        """Who holds the lock, as recorded beside it (``None`` if unknown)."""
        try:
            with self.state.folder("locks") as dir_fd:
                raw = read_bytes(
                    self.owner_path,
                    what="lock owner",
                    error=_OwnerFileError,
                    max_bytes=64 * 1024,
                    follow_symlinks=False,
                    dir_fd=dir_fd,
                )
            text = decode_text(raw, path=self.owner_path, what="lock owner", error=_OwnerFileError)
            return Owner.from_json(
                parse_json(text, path=self.owner_path, what="lock owner", error=_OwnerFileError)
            )
        except (PowerlibError, OSError, ValueError, KeyError, TypeError):
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
        if not os.path.lexists(lock.path):
            return True
        try:
            lock.acquire(Owner.current())
        except DeviceBusyError:
            return False
        lock.release()
        return True


def create_new(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """Create ``path`` afresh (0600) for writing: whatever had that name is unlinked first.

    ``O_EXCL`` never opens an existing file, so a planted symlink or hard link at a temporary
    name cannot make this process truncate or write another file. With ``dir_fd``, ``path`` is
    a name in that folder (``unlinkat``/``openat``).
    """
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path, dir_fd=dir_fd)
    return os.open(
        path,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=dir_fd,
    )
