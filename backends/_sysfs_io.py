"""File access for the sysfs backend: one root, one errno translation point.

Every read and write of :mod:`powerlib.backends.sysfs` goes through a :class:`SysfsIO`. Paths are
relative to an injected root (``Settings.sysfs_root``; the real sysfs mount by default), so a test
or a container bind mount only changes the root, and nothing here hard-codes an absolute path.

Two private hooks, :meth:`SysfsIO._raw_read` and :meth:`SysfsIO._raw_write`, do the actual system
calls. A subclass can override them to add kernel semantics to a plain directory of files
(:class:`powerlib.testing.sysfs.FakeKernel` does); the ``OSError`` it raises then passes through the
same translation as a real kernel's, in :func:`translate_oserror`.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from powerlib.errors import (
    DeviceError,
    InvalidArgumentError,
    NotSupportedError,
    PermissionDeniedError,
    PowerlibError,
)

__all__ = ["SysfsIO", "soft", "translate_oserror"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_PERMISSION_ERRNOS = frozenset({errno.EACCES, errno.EPERM})
_UNSUPPORTED_ERRNOS = frozenset({errno.ENODATA, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})
_INVALID_ERRNOS = frozenset({errno.EINVAL, errno.ERANGE})


def translate_oserror(
    err: OSError, rel: str, operation: str, value: str | None = None
) -> PowerlibError:
    """Map an ``OSError`` from a sysfs file to the matching powerlib error.

    This is the only place where errno values become powerlib errors. The errno name (e.g.
    ``"EACCES"``) is kept as ``vendor_code``; callers chain the original with ``from err``.

    Args:
        err: The error raised by the system call.
        rel: The file as shown to the user (the root joined with the relative path).
        operation: ``"read"`` or ``"write"``.
        value: The value being written, if any.

    Returns:
        The error to raise (not raised here).
    """
    code = err.errno
    name = errno.errorcode.get(code, str(code)) if code is not None else None
    if code in _PERMISSION_ERRNOS:
        verb = "writing" if operation == "write" else "reading"
        message = f"permission denied {verb} {rel}: needs root or CAP_SYS_ADMIN"
        if rel.endswith("energy_uj"):
            message += " (energy_uj is root-only since Linux 5.10; a udev rule can relax its mode)"
        elif operation == "write" and "constraint_" in rel:
            message += "; a RAPL power limit may also be locked by the BIOS"
        return PermissionDeniedError(message, operation=operation, vendor_code=name)
    if code == errno.EROFS:
        return PermissionDeniedError(
            f"cannot write {rel}: sysfs is mounted read-only (containers mount it read-only "
            "unless configured otherwise)",
            operation=operation,
            vendor_code=name,
        )
    if code == errno.ENOENT:
        return NotSupportedError(
            f"{rel} does not exist: the kernel does not expose this feature here",
            operation=operation,
            vendor_code=name,
        )
    if code in _UNSUPPORTED_ERRNOS:
        return NotSupportedError(
            f"the kernel does not support {operation} of {rel}",
            operation=operation,
            vendor_code=name,
        )
    if code in _INVALID_ERRNOS:
        shown = f"{value!r} " if value is not None else ""
        return InvalidArgumentError(
            f"the kernel rejected {operation} {shown}of {rel} as invalid",
            operation=operation,
            vendor_code=name,
        )
    return DeviceError(
        f"{operation} of {rel} failed: {err.strerror or err}", operation=operation, vendor_code=name
    )


class SysfsIO:
    """Reads and writes files under one sysfs root.

    Args:
        root: The directory that stands for the sysfs mount point.

    Every method takes a path relative to ``root`` (e.g. ``"class/powercap/intel-rapl:0/name"``).
    A path that is absolute, or that resolves (after following symlinks) outside the root, is
    refused with ``PermissionDeniedError``.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self._real_root = os.path.realpath(self.root)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"

    # -- public API ------------------------------------------------------------------------------

    def resolve(self, rel: str) -> Path:
        """The absolute path of ``rel``, with symlinks resolved.

        Raises:
            PermissionDeniedError: ``rel`` is absolute or resolves outside the root.
        """
        norm = posixpath.normpath(rel)
        if posixpath.isabs(norm) or norm == ".." or norm.startswith("../"):
            raise PermissionDeniedError(
                f"refusing to access {rel!r}: sysfs paths must stay under the root {self.root}"
            )
        real = os.path.realpath(os.path.join(self._real_root, norm))
        if real != self._real_root and not real.startswith(self._real_root.rstrip(os.sep) + os.sep):
            raise PermissionDeniedError(
                f"refusing to access {rel!r}: it resolves to {real}, outside the sysfs root "
                f"{self.root}"
            )
        return Path(real)

    def read_text(self, rel: str) -> str:
        """Read a file and strip surrounding whitespace.

        Raises:
            PowerlibError: The subclass matching the errno (see :func:`translate_oserror`).
        """
        path = self.resolve(rel)
        try:
            return self._raw_read(rel, path).strip()
        except OSError as err:
            raise translate_oserror(err, str(self.root / rel), "read") from err

    def read_int(self, rel: str) -> int:
        """Read a file holding one integer (µJ, µW, kHz, ...).

        Raises:
            DeviceError: The file does not hold an integer.
            PowerlibError: As :meth:`read_text`.
        """
        text = self.read_text(rel)
        try:
            return int(text)
        except ValueError as err:
            raise DeviceError(f"{rel} holds {text!r}, not an integer", operation="read") from err

    def write_text(self, rel: str, value: str) -> None:
        """Write ``value`` to a file in one system call (the way sysfs attributes expect).

        Raises:
            PowerlibError: The subclass matching the errno (see :func:`translate_oserror`).
        """
        path = self.resolve(rel)
        try:
            self._raw_write(rel, path, value)
        except OSError as err:
            raise translate_oserror(err, str(self.root / rel), "write", value) from err
        logger.debug("wrote %r to %s", value, rel)

    def exists(self, rel: str) -> bool:
        """Whether the file or directory exists (symlinks followed)."""
        return self.resolve(rel).exists()

    def is_dir(self, rel: str) -> bool:
        """Whether ``rel`` is a directory (symlinks followed)."""
        return self.resolve(rel).is_dir()

    def listdir(self, rel: str) -> list[str]:
        """The entries of a directory, sorted; ``[]`` if it does not exist.

        Raises:
            PowerlibError: The directory exists but cannot be listed.
        """
        path = self.resolve(rel)
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as err:
            raise translate_oserror(err, str(self.root / rel), "read") from err

    # -- hooks for subclasses ------------------------------------------------------------------

    def _raw_read(self, rel: str, path: Path) -> str:
        """Read ``path`` (``rel`` resolved). Raises ``OSError`` as the kernel reports it."""
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()

    def _raw_write(self, rel: str, path: Path, value: str) -> None:
        """Write ``value`` to ``path`` (``rel`` resolved). Raises ``OSError`` as the kernel does.

        The file is never created: a sysfs attribute that does not exist is a feature that does
        not exist (``ENOENT``).
        """
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)


def soft(read: Callable[[str], _T], rel: str) -> _T | None:
    """``read(rel)``, or ``None`` when the file is absent, unsupported or not readable."""
    try:
        return read(rel)
    except (NotSupportedError, PermissionDeniedError) as err:
        logger.debug("treating %s as absent: %s", rel, err)
        return None
