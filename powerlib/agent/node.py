"""The node's layout for jobs without root: per-user state folders and Slurm's GPU numbers.

Root's state folder (``/run/powerlib``, :data:`~powerlib.config.NODE_STATE_DIR`) holds, besides
root's journals and locks, the agent's job grants (``grants/``), the socket's own folder
(``agent/``) and one state folder per user (``users/<uid>``), made by the Slurm prolog
(``powerlib agent grant``). A user's sessions journal there by default
(:func:`~powerlib.config.default_state_dir`), never in ``/tmp``, where anyone could plant a
folder of that name first (docs/agent.md §4).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import stat
from collections.abc import Sequence
from pathlib import Path

from powerlib.backend import Backend
from powerlib.control import check_trusted, describe_owner
from powerlib.errors import ConfigError, DeviceNotFoundError, UntrustedStateError
from powerlib.inputs import show_path

__all__ = ["let_others_traverse", "make_user_state_dir", "open_root_dir", "uuids_of_minors"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_root_dir(
    name: str | Path, parent_fd: int | None, path: Path, what: str, mode: int | None = None
) -> int:
    """Open a folder of root's without following a link, checked through its descriptor.

    With ``mode``, the folder is made first if missing, with exactly that mode (the umask
    must not change who may reach it). A link or a non-folder at ``name`` is refused in one
    line (``UntrustedStateError``), as is a folder that is not root's alone.

    Args:
        name: The folder, relative to ``parent_fd`` (or a path when ``parent_fd`` is None).
        parent_fd: The folder it is in, as a descriptor, or None.
        path: Its full path, for messages.
        what: What it is, for messages ("state folder").
        mode: Create it with this mode when missing; None: never create.
    """
    created = False
    if mode is not None:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, mode, dir_fd=parent_fd)
            created = True
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        check_trusted(
            path, os.lstat(name, dir_fd=parent_fd), what=what, directory=True, trusted_uids={0}
        )
        raise  # pragma: no cover - check_trusted refuses what O_NOFOLLOW|O_DIRECTORY refused
    try:
        if created and mode is not None:
            os.fchmod(fd, mode)
        check_trusted(path, os.fstat(fd), what=what, directory=True, trusted_uids={0})
    except BaseException:
        os.close(fd)
        raise
    return fd


def let_others_traverse(fd: int) -> None:
    """Add ``x`` for group and others to a folder of this process's, by descriptor.

    Never ``r`` or ``w``: others may reach what lies below (a user's folder, the socket), not
    list it.
    """
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o011 != 0o011:
        os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o011)


def make_user_state_dir(node_state_dir: Path, uid: int) -> Path:
    """Create ``<node>/users/<uid>`` (0700, owned by ``uid``) for that user's sessions.

    ``<node>`` and ``users/`` are root's and reachable (``x``) by everyone; every step goes
    through folder descriptors opened without following links. An existing folder of
    ``uid``'s is kept, made private again (0700) if the user opened it up.

    Raises:
        UntrustedStateError: A folder on the way is not root's, is a symlink or is writable by
            others, or the user's folder exists but is someone else's.
    """
    node = Path(node_state_dir)
    node.parent.mkdir(parents=True, exist_ok=True)
    root_fd = open_root_dir(node, None, node, "state folder", 0o755)
    try:
        let_others_traverse(root_fd)  # users must reach users/<uid> (and agent/agent.sock)
        users_fd = open_root_dir("users", root_fd, node / "users", "state folder", 0o755)
        try:
            name = str(uid)
            created = True
            try:
                os.mkdir(name, 0o700, dir_fd=users_fd)
            except FileExistsError:
                created = False
            fd = os.open(name, _DIR_FLAGS, dir_fd=users_fd)
            try:
                if created:
                    try:
                        gid = pwd.getpwuid(uid).pw_gid
                    except KeyError:
                        gid = uid
                    os.fchown(fd, uid, gid)
                st = os.fstat(fd)
                if st.st_uid != uid:  # nobody but root can make a folder in users/
                    raise UntrustedStateError(
                        f"refusing the user state folder {show_path(node / 'users' / name)} "
                        f"(owner {describe_owner(st.st_uid)}, mode "
                        f"{stat.S_IMODE(st.st_mode):04o}): it must be {describe_owner(uid)}'s; "
                        "remove it and run the prolog again"
                    )
                if stat.S_IMODE(st.st_mode) != 0o700:
                    # the user may have opened it up after a job: theirs, so closed again here
                    # (through the descriptor) rather than failing the prolog and draining
                    os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
        finally:
            os.close(users_fd)
    finally:
        os.close(root_fd)
    return node / "users" / str(uid)


def uuids_of_minors(backend: Backend, minors: Sequence[str]) -> list[str]:
    """The stable ids of the devices with these minor numbers (``/dev/nvidia<N>``).

    Slurm's ``SLURM_JOB_GPUS`` lists GPUs by the numbers in ``gres.conf``'s ``File=``, which
    need not follow the PCI (NVML) order the agent indexes by; a grant names UUIDs instead.

    Raises:
        ConfigError: A number is not a non-negative integer.
        DeviceNotFoundError: No device has that minor number, or the backend reports none.
    """
    by_minor: dict[int, str] = {}
    for dev in backend.devices():
        minor = dev.details().get("minor_number")
        if isinstance(minor, int) and not isinstance(minor, bool):
            by_minor[minor] = dev.device_id
    out = []
    for text in minors:
        if not text.isdigit():
            raise ConfigError(f"--slurm-gpus: {text!r} is not a device minor number")
        if not by_minor:
            raise DeviceNotFoundError(
                f"the {backend.name} backend reports no device minor numbers; grant by UUID "
                "with --devices"
            )
        uuid = by_minor.get(int(text))
        if uuid is None:
            raise DeviceNotFoundError(
                f"no {backend.name} device has minor number {int(text)} (this node has "
                f"{', '.join(str(m) for m in sorted(by_minor)) or 'none'})"
            )
        out.append(uuid)
    return out
