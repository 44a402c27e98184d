"""Where the agent listens: the socket's folder, a stale socket, systemd, the open-file limit.

The agent's socket lies alone in its folder (default ``/run/powerlib/agent/agent.sock``): pods
mount that folder, read-only, and a container's root is the host's, so the folder may hold none
of the agent's state, grants or allow list (docs/agent.md §4). The folder must be root's and
writable by nobody else (the socket's mode and group are set by path), and the folders between
root's state folder and it are made traversable for clients. Under systemd, the agent takes its
socket from socket activation (``LISTEN_FDS``) and reports through ``sd_notify``. The server
itself is :class:`powerlib.agent.transport.Agent`.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import resource
import socket
import stat
from pathlib import Path

from powerlib.agent.node import let_others_traverse
from powerlib.control import check_trusted
from powerlib.errors import ConfigError
from powerlib.inputs import show_path

__all__ = [
    "SD_LISTEN_FDS_START",
    "check_socket_folder",
    "group_id",
    "prepare_socket_folder",
    "raise_nofile_limit",
    "sd_notify",
    "systemd_listen_fd",
]

logger = logging.getLogger(__name__)

SD_LISTEN_FDS_START = 3
"""The first file descriptor systemd passes (``sd_listen_fds(3)``)."""


def sd_notify(message: str) -> bool:
    """Tell systemd (``NOTIFY_SOCKET``) something, e.g. ``READY=1``; False when not under it."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            s.sendto(message.encode(), address)
        except OSError as err:
            logger.warning("sd_notify(%s) failed: %s", message, err)
            return False
    return True


def systemd_listen_fd() -> int | None:
    """The first socket systemd passed (socket activation), or ``None``."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    try:
        count = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return None
    if count < 1:
        return None
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)  # not inherited by anything we start
    return SD_LISTEN_FDS_START


def group_id(group: int | str | None) -> int | None:
    """The gid of the socket's group (a gid, or a group's name); ``None`` stays ``None``.

    Raises:
        ConfigError: No such group.
    """
    if group is None or isinstance(group, int):
        return group
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"no such group {group!r} for the agent's socket") from None


def check_socket_folder(
    folder: Path, *, state_dir: Path, grants_dir: Path | None, allow_path: Path | None
) -> None:
    """Refuse a socket folder that holds the agent's state, grants or allow list.

    Pods mount the socket's folder (read-only, docs/agent.md §3), and a container's root is
    the host's: whatever lies in that folder a root pod could write, so the folder holds
    the socket and nothing of the agent's.

    Raises:
        ConfigError: One of them lies in (or is) the socket's folder.
    """
    where = Path(os.path.realpath(folder))
    state = Path(state_dir)
    for what, path in (
        ("state folder", state),
        ("grants folder", grants_dir),
        ("allow list", allow_path),
    ):
        if path is None:
            continue
        real = Path(os.path.realpath(path))
        if real == where or where in real.parents:
            raise ConfigError(
                f"refusing to serve: the {what} {show_path(path)} lies in the socket's folder "
                f"{show_path(folder)}, which pods mount; give the socket a folder of its own "
                "(the default is /run/powerlib/agent/agent.sock)"
            )


def prepare_socket_folder(
    socket_path: Path, *, state_dir: Path, grants_dir: Path | None, allow_path: Path | None
) -> None:
    """Make ``socket_path``'s folder ready for the agent to bind it (not socket activation).

    The folder is checked (:func:`check_socket_folder`), made (0755), must be root's (or this
    process's) and writable by nobody else, is made reachable from root's state folder, and a
    socket a dead agent left there is removed.

    Raises:
        ConfigError: The folder holds the agent's files, or something else than a socket lies
            at ``socket_path``.
        UntrustedStateError: Someone else owns or may write the folder.
    """
    folder = socket_path.parent
    check_socket_folder(folder, state_dir=state_dir, grants_dir=grants_dir, allow_path=allow_path)
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    # the agent's chmod and chown act on the path: nobody else may write its folder
    check_trusted(
        folder, os.lstat(folder), what="agent socket's folder", directory=True,
        trusted_uids={0, os.geteuid()},
    )  # fmt: skip
    _let_others_reach(folder, Path(state_dir))
    _clear_stale_socket(socket_path)


def _let_others_reach(folder: Path, state: Path) -> None:
    """Let clients reach a socket folder inside root's state folder.

    Each folder between gets ``x`` for group and others
    (:func:`~powerlib.agent.node.let_others_traverse`).
    """
    try:
        inside = folder.resolve().relative_to(state.resolve())
    except ValueError:
        return
    path = state
    for part in ("", *inside.parts[:-1]):
        path = path / part if part else path
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            let_others_traverse(fd)
        finally:
            os.close(fd)


def _clear_stale_socket(path: Path) -> None:
    """Remove a socket a dead agent left; refuse to remove anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{show_path(path)} exists and is not a socket; refusing to replace it")
    os.unlink(path)


def raise_nofile_limit() -> None:
    """Raise the soft open-file limit to the hard one (65536 if unlimited): each client holds two."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
