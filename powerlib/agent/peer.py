"""Who is on the other end of a Unix socket, and whether that exact process still lives.

The kernel vouches for the peer's pid, uid and gid (``SO_PEERCRED``, taken at ``connect``). A pid
alone can be reused, so a client is the pair (pid, start time in clock ticks since boot, field 22
of ``/proc/<pid>/stat``); its supplementary groups come from ``/proc/<pid>/status``. The agent
watches the process through a pidfd (``os.pidfd_open``), which becomes readable when that
process exits even if a child it forked keeps the socket open (docs/agent.md §4).
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import struct
from dataclasses import dataclass

__all__ = ["Peer", "peer_of", "pidfd_of", "process_start_ticks"]

_CRED = struct.Struct("3i")
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13+
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5+


@dataclass(frozen=True, slots=True)
class Peer:
    """A client process, as the kernel identified it at ``connect``.

    Attributes:
        pid: Its pid.
        uid: Its uid (the effective uid at connect).
        gid: Its primary gid.
        groups: Its supplementary groups (``SO_PEERGROUPS``, taken at connect; from ``/proc`` on
            kernels before 4.13).
        start_ticks: Its start time in clock ticks since boot (``None`` if it already exited,
            or if the pid now names another process).
        pidfd: A pidfd the kernel made for exactly the connecting process (``SO_PEERPIDFD``,
            Linux 6.5+), or ``None``; :func:`pidfd_of` hands it over.
    """

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...]
    start_ticks: int | None
    pidfd: int | None = None

    @property
    def gids(self) -> tuple[int, ...]:
        """The primary gid and the supplementary groups."""
        return (self.gid, *self.groups)

    def describe(self) -> str:
        """``uid 1000 pid 4242`` for messages."""
        return f"uid {self.uid} pid {self.pid}"


def peer_of(sock: socket.socket) -> Peer:
    """Identify the peer of a connected Unix stream socket.

    What ``/proc/<pid>`` says (start time, and groups on old kernels) is trusted only if that pid
    still names the connecting process afterwards: checked through the kernel's own pidfd for
    it where there is one (a live process's pid cannot be reused), else by the effective uid
    that ``/proc`` shows matching the one ``SO_PEERCRED`` took at ``connect``.
    """
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    pid, uid, gid = _CRED.unpack(raw)
    pidfd = _peer_pidfd(sock)
    groups = _peer_groups(sock)
    start = process_start_ticks(pid)
    if groups is None:
        groups = _proc_groups(pid)
    if pidfd is not None:
        if not _alive(pidfd):
            start = None  # gone: whatever /proc showed may be another process
    elif _proc_euid(pid) != uid:
        start = None  # the pid names another user's process now: not our peer
    return Peer(pid=pid, uid=uid, gid=gid, groups=groups, start_ticks=start, pidfd=pidfd)


def _peer_pidfd(sock: socket.socket) -> int | None:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD, 4)
    except OSError:
        return None  # before Linux 6.5
    fd = struct.unpack("i", raw)[0]
    return fd if fd >= 0 else None


def _peer_groups(sock: socket.socket) -> tuple[int, ...] | None:
    size = 4 * 64
    for _ in range(3):
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size)
        except OSError as err:
            if err.errno == errno.ERANGE:
                size *= 16
                continue
            return None  # before Linux 4.13
        return tuple(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    return None


def _alive(pidfd: int) -> bool:
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return False
    return True


def _proc_euid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[2])
    except (OSError, ValueError, IndexError):
        pass
    return None


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (``None`` when the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces or parentheses itself
    rest = raw[raw.rfind(b")") + 2 :].split()
    try:
        return int(rest[19])  # fields 3.. start at rest[0]; field 22 is rest[19]
    except (IndexError, ValueError):
        return None


def _proc_groups(pid: int) -> tuple[int, ...]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return tuple(int(g) for g in line.split()[1:] if g.isdigit())
    except OSError:
        pass
    return ()


def pidfd_of(peer: Peer) -> int | None:
    """A pidfd for exactly this peer process, or ``None`` when it is already gone.

    The kernel's own (``SO_PEERPIDFD``) when it gave one. Else one is opened now and the start
    time checked after: if the pid was reused between ``connect`` and now, the start times
    differ and the peer counts as gone.
    """
    if peer.pidfd is not None:
        if peer.start_ticks is not None:
            return peer.pidfd
        os.close(peer.pidfd)
        return None
    try:
        fd = os.pidfd_open(peer.pid)
    except (ProcessLookupError, OSError):
        return None
    if peer.start_ticks is None or process_start_ticks(peer.pid) != peer.start_ticks:
        os.close(fd)
        return None
    return fd
