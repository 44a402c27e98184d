"""Whether state that root may act on can be trusted: owner, mode and type, checked on descriptors.

Trust (``powerlib restore`` runs as root on shared nodes): a state folder (the root, ``journal/``,
``locks/``), a journal or a lock file is used only if it is owned by the invoking user (euid),
root, or a uid the caller names explicitly (``powerlib restore --trust-owner UID``), is not
writable by group or others, and is a real folder or a regular file (never a symlink, fifo or
device). Anything else raises :class:`~powerlib.errors.UntrustedStateError` with one line naming
the path, its owner and its mode (:func:`check_trusted`). The node agent uses the same checks for
its own folders (docs/agent.md §4).

Also here: the bounded field parsers every hostile file in the state folder is read through
(:func:`is_int`, :func:`finite_number`, :func:`bounded_text`) and :func:`create_new`, the one way
a file is created there. This module imports nothing of powerlib but its errors: every other part
of the control plane depends on it, never the reverse.
"""

from __future__ import annotations

import contextlib
import math
import os
import pwd
import stat
from collections.abc import Iterable
from typing import Any

from powerlib.errors import UntrustedStateError
from powerlib.inputs import show_path

__all__ = [
    "bounded_text",
    "check_trusted",
    "create_new",
    "describe_owner",
    "finite_number",
    "is_int",
]

_MAX_TEXT = 512


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
