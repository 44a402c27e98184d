"""The state folder: where journals and locks live, the keys they are filed under, their owners.

Layout of the state directory (``POWERLIB_STATE_DIR``, created 0700)::

    journal/<key>.json   what a session changed on one device, with the original values (0600)
    locks/<key>.lock     a POSIX record lock held by the one session controlling the device
    locks/<key>.owner    who holds it (pid, start time, host), for "device busy" messages

``<key>`` (:func:`device_key`) is the backend name and the device's stable id (UUID, sysfs
zone), never an index. An :class:`Owner` is named by pid *and* process start time (psutil), so a
reused pid is never mistaken for the owner.

:class:`StateDir` validates the folder once and hands out checked descriptors of it; what is
filed there is :mod:`powerlib.control.journal`'s and :mod:`powerlib.control.locks`' business.
Both depend on this module, which depends only on :mod:`powerlib.control.trust`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
import stat
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from powerlib.control.trust import (
    bounded_text,
    check_trusted,
    describe_owner,
    finite_number,
    is_int,
)
from powerlib.errors import ConfigError, PermissionDeniedError, UntrustedStateError
from powerlib.inputs import show_path

__all__ = ["Owner", "StateDir", "device_key"]

_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_START_TIME_TOLERANCE_S = 0.05
_MAX_PID = 2**31 - 1


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
            started_s: float = proc.create_time()  # psutil is untyped
            return abs(started_s - self.start_time_s) <= _START_TIME_TOLERANCE_S
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False

    def to_json(self) -> dict[str, object]:
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
