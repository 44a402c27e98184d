"""Who controls a device: one POSIX record lock per device in the state folder.

``<key>`` (:func:`~powerlib.control.state.device_key`) is the backend name and the device's stable id (UUID, sysfs zone),
never an index. ``locks/<key>.lock`` in the state folder is a POSIX record lock held by the one
session controlling the device; ``locks/<key>.owner`` says who holds it (pid, start time, host),
for "device busy" messages.

Why POSIX record locks (``lockf``) and not ``flock``: a record lock belongs to the process, so it
is released when the process dies and is *not* inherited by ``fork`` children (a DataLoader worker
that outlives a killed trainer would otherwise keep the device "busy"). The price is that closing
any descriptor of the lock file in the owning process drops the lock, so this module never opens a
lock file twice in one process (see :data:`_HELD`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import threading

from powerlib.control.state import Owner, StateDir
from powerlib.control.trust import check_trusted, create_new, describe_owner
from powerlib.errors import (
    DeviceBusyError,
    PermissionDeniedError,
    PowerlibError,
    UntrustedStateError,
)
from powerlib.inputs import decode_text, parse_json, read_bytes, show_path

__all__ = ["DeviceLock"]

logger = logging.getLogger(__name__)

# Lock files this process holds, by path: opening one again would drop the POSIX lock.
_HELD: dict[str, DeviceLock] = {}
_HELD_GUARD = threading.Lock()


class _OwnerFileError(PowerlibError):
    """A lock's owner file is unreadable; the owner is then unknown (never raised further)."""


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
