"""Whether state that root may act on can be trusted: owner, mode and type, checked on descriptors.

Trust (``powerlib restore`` runs as root on shared nodes): a state folder (the root, ``journal/``,
``locks/``), a journal or a lock file is used only if it is owned by the invoking user (euid),
root, or a uid the caller names explicitly (``powerlib restore --trust-owner UID``), is not
writable by group or others, and is a real folder or a regular file (never a symlink, fifo or
device). Anything else raises :class:`~powerlib.errors.UntrustedStateError` with one line naming
the path, its owner and its mode (:func:`check_trusted`). The node agent uses the same checks for
its own folders (docs/agent.md §4).

A restore acting for a user (root in an epilog) opens that user's state folder with
:func:`open_user_folder`: from ``/``, one component at a time, following no link, with every
owner checked, and never onto a file system its user's own daemon serves (FUSE).

Also here: the bounded field parsers every hostile file in the state folder is read through
(:func:`is_int`, :func:`finite_number`, :func:`bounded_text`) and :func:`create_new`, the one way
a file is created there. This module imports nothing of powerlib but its errors: every other part
of the control plane depends on it, never the reverse.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import pwd
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from powerlib.errors import UntrustedStateError
from powerlib.inputs import show_path

__all__ = [
    "Mount",
    "bounded_text",
    "check_trusted",
    "create_new",
    "describe_owner",
    "finite_number",
    "is_int",
    "open_user_folder",
    "read_mounts",
]

_MAX_TEXT = 512
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MOUNTINFO = "/proc/self/mountinfo"
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


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
            "root's state is never a user's: `powerlib restore` without --for-user restores it"
            if st.st_uid == 0  # only a restore for a user leaves root out of the trusted owners
            else f"a restore for that user's job is `powerlib restore --for-user {st.st_uid} "
            "--job JOB`, which resets the job's devices to their defaults"
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


@dataclass(frozen=True, slots=True)
class Mount:
    """One line of ``/proc/self/mountinfo``: its id, where it is mounted and its type."""

    mount_id: int
    point: str
    fs_type: str


def read_mounts() -> list[Mount]:
    """This process's mount table (``/proc/self/mountinfo``); empty where there is none.

    Read from the kernel's table, never by asking a file system: a ``stat`` of a FUSE mount is
    answered by its daemon, which may never answer.
    """
    try:
        with open(_MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    mounts = []
    for line in lines:
        fields, sep, rest = line.partition(" - ")
        parts = fields.split(" ")
        if not sep or len(parts) < 5 or not parts[0].isdigit() or not rest:
            continue
        point = _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), parts[4])
        mounts.append(Mount(mount_id=int(parts[0]), point=point, fs_type=rest.split(" ")[0]))
    return mounts


def _user_served(fs_type: str) -> bool:
    """A file system a user's own process serves (FUSE: any user may mount one, fusermount)."""
    return fs_type in ("fuse", "fuseblk") or fs_type.startswith("fuse.")


def _open_component(parent_fd: int, name: str) -> int:
    """``openat(parent_fd, name, O_DIRECTORY | O_NOFOLLOW)``: one component of a user's path."""
    return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)


def open_user_folder(path: Path, uid: int) -> int | None:
    """Open ``uid``'s state folder for root, following no link: a descriptor, or None if missing.

    The rules (docs/agent.md §4), for ``/scratch/U/powerlib`` say:

    * **No link anywhere.** ``path`` (absolute, no ``..``) is walked from ``/`` one component
      at a time with ``openat(O_DIRECTORY | O_NOFOLLOW)``, each relative to the descriptor of
      the one above, so a component that its owner swaps for a symlink (``/scratch/U`` -> ``/run``)
      is refused, never followed; the descriptor returned is the folder that was checked.
    * **Root's above, the user's below.** The user's part starts at the first component owned
      by ``uid`` (``/scratch/U``). Every component above it (``/``, ``/scratch``) must be root's
      and writable by no one else, unless sticky (``/tmp``, a 1777 ``/scratch``): nobody but root
      can then rename what it holds. Every component from the user's part down, the state folder
      itself included, must be owned by exactly ``uid``, not root (root's own folders are never
      a user's) and not writable by group or others (the state folder not even if sticky).
    * **No file system the user serves.** A component, or anything below the state folder, that
      is a FUSE mount in this process's mount table is refused before it is opened: its daemon
      is the user's, and could block root's open or read for ever. (A FUSE mount is closed to
      every other uid, root included, unless ``user_allow_other`` is set in ``/etc/fuse.conf``;
      the kernel then refuses root's access without asking the daemon.)

    Args:
        path: The folder (``--user-state-dir`` or a default one).
        uid: Its user.

    Returns:
        The folder's descriptor (the caller closes it), or None when a component is missing.

    Raises:
        UntrustedStateError: One line naming the component and the rule it breaks.
    """
    path = Path(path)
    if not path.is_absolute() or ".." in path.parts:
        raise UntrustedStateError(
            f"refusing the state folder {show_path(path)}: a user's state folder is named by an "
            "absolute path without '..'"
        )
    served = {m.point: m.fs_type for m in read_mounts() if _user_served(m.fs_type)}
    fd = os.open("/", _DIR_FLAGS)
    try:
        last = len(path.parts) == 1
        users = _check_component(path, Path("/"), os.fstat(fd), uid, users=False, last=last)
        here = Path("/")
        for i, name in enumerate(path.parts[1:], start=2):
            here = here / name
            if str(here) in served:
                raise _served_error(path, here, served[str(here)])
            try:
                next_fd = _open_component(fd, name)
            except FileNotFoundError:
                os.close(fd)
                return None
            except OSError as err:
                raise _cannot_walk(path, here, fd, name, err) from err
            os.close(fd)
            fd = next_fd
            last = i == len(path.parts)
            users = _check_component(path, here, os.fstat(fd), uid, users=users, last=last)
        below = next((p for p in served if p.startswith(f"{str(path).rstrip('/')}/")), None)
        if below is not None:
            raise _served_error(path, Path(below), served[below])
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_component(
    path: Path, here: Path, st: os.stat_result, uid: int, *, users: bool, last: bool
) -> bool:
    """One component of a user's state folder (:func:`open_user_folder`'s rules).

    Args:
        path: The state folder (for the message).
        here: This component.
        st: Its ``fstat``.
        uid: The user.
        users: Whether a component above was the user's already.
        last: Whether it is the state folder itself.

    Returns:
        Whether the user's part of the path has begun (this component or one above is theirs).

    Raises:
        UntrustedStateError: The component breaks a rule.
    """
    if last:  # the state folder: exactly the user's, a real folder nobody else can write
        check_trusted(here, st, what="state folder", directory=True, trusted_uids=(uid,))
        return True
    users = users or st.st_uid == uid
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX
    if st.st_uid == (uid if users else 0) and not writable:
        return users
    raise UntrustedStateError(
        f"refusing the state folder {show_path(path)}: {show_path(here)} (owner "
        f"{describe_owner(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o} "
        f"{stat.filemode(st.st_mode)}) could let others replace what it holds; the folders "
        "above a user's are root's and writable by no one else unless sticky (like /tmp), and "
        f"those from the user's own down are {describe_owner(uid)}'s alone"
    )


def _served_error(path: Path, here: Path, fs_type: str) -> UntrustedStateError:
    return UntrustedStateError(
        f"refusing the state folder {show_path(path)}: {show_path(here)} is a {fs_type} mount, "
        "whose daemon a user runs and which could hang root's restore; a user's state folder "
        "must be on a file system the kernel or the admin serves"
    )


def _cannot_walk(path: Path, here: Path, parent_fd: int, name: str, err: OSError) -> Exception:
    """Why ``openat`` of one component failed, as one line (a symlink above all)."""
    try:
        st: os.stat_result | None = os.lstat(name, dir_fd=parent_fd)
    except OSError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        return UntrustedStateError(
            f"refusing the state folder {show_path(path)}: {show_path(here)} is a symbolic link "
            f"(owner {describe_owner(st.st_uid)}); no component of a user's state folder may be "
            "one, since it could lead anywhere, root's own folders included"
        )
    if (st is not None and not stat.S_ISDIR(st.st_mode)) or err.errno == errno.ENOTDIR:
        return UntrustedStateError(
            f"refusing the state folder {show_path(path)}: {show_path(here)} is "
            f"{'not a folder' if st is None else _file_kind(st.st_mode)}, not a folder"
        )
    return UntrustedStateError(
        f"refusing the state folder {show_path(path)}: cannot open {show_path(here)} "
        f"({err.strerror})"
    )
