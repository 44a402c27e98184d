"""Who is on the other end of a Unix socket, and whether that exact process still lives.

The kernel vouches for the peer's pid, uid and gid (``SO_PEERCRED``, taken at ``connect``). A pid
alone can be reused, so a client is the pair (pid, start time in clock ticks since boot, field 22
of ``/proc/<pid>/stat``); its supplementary groups come from ``/proc/<pid>/status``. The agent
watches the process through a pidfd (``os.pidfd_open``), which becomes readable when that
process exits even if a child it forked keeps the socket open (docs/agent.md §4).
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

__all__ = ["Peer", "peer_of", "pidfd_of", "process_start_ticks"]

_CRED = struct.Struct("3i")


@dataclass(frozen=True, slots=True)
class Peer:
    """A client process, as the kernel identified it at ``connect``.

    Attributes:
        pid: Its pid.
        uid: Its uid (the effective uid at connect).
        gid: Its primary gid.
        groups: Its supplementary groups (from ``/proc``; empty if it already exited).
        start_ticks: Its start time in clock ticks since boot (``None`` if it already exited).
    """

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...]
    start_ticks: int | None

    @property
    def gids(self) -> tuple[int, ...]:
        """The primary gid and the supplementary groups."""
        return (self.gid, *self.groups)

    def describe(self) -> str:
        """``uid 1000 pid 4242`` for messages."""
        return f"uid {self.uid} pid {self.pid}"


def peer_of(sock: socket.socket) -> Peer:
    """Identify the peer of a connected Unix stream socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    pid, uid, gid = _CRED.unpack(raw)
    return Peer(
        pid=pid, uid=uid, gid=gid, groups=_groups(pid), start_ticks=process_start_ticks(pid)
    )


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


def _groups(pid: int) -> tuple[int, ...]:
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

    The pidfd is opened first and the start time checked after: if the pid was reused between
    ``connect`` and now, the start times differ and the peer counts as gone.
    """
    try:
        fd = os.pidfd_open(peer.pid)
    except (ProcessLookupError, OSError):
        return None
    if peer.start_ticks is None or process_start_ticks(peer.pid) != peer.start_ticks:
        os.close(fd)
        return None
    return fd
