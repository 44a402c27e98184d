"""Whether this process may change device settings itself (docs/real-gpu.md §5).

NVML and amdsmi setters need root, and inside a container also ``CAP_SYS_ADMIN``; without them
every clock change is refused by the driver. A session asks before its ``with`` line returns, so
a job without the privilege fails there with one line naming the two ways out, instead of
warning in its first iteration and leaving a journal for a change that never happened.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CAP_SYS_ADMIN", "WAYS_OUT", "admin_refusal", "effective_capabilities"]

CAP_SYS_ADMIN = 21
"""Bit of ``CAP_SYS_ADMIN`` in ``CapEff`` (linux/capability.h)."""

WAYS_OUT = (
    "run the job as root, or start the node agent (`sudo powerlib agent serve`, docs/agent.md) "
    "and set POWERLIB_BACKEND=agent"
)
"""The two ways a job gets clock control, named in every refusal."""


def effective_capabilities(status_path: Path = Path("/proc/self/status")) -> int | None:
    """This process's effective capability mask, or ``None`` where it cannot be read."""
    try:
        text = status_path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("CapEff:"):
            try:
                return int(line.split(":", 1)[1].strip(), 16)
            except ValueError:
                return None
    return None


def admin_refusal(what: str, status_path: Path = Path("/proc/self/status")) -> str | None:
    """Why this process cannot change ``what`` through a root-only vendor library.

    Args:
        what: What would be changed, e.g. ``"NVIDIA GPU clocks"``.
        status_path: Where the capability mask is read (tests point it at a copy).

    Returns:
        ``None`` when the process is root with ``CAP_SYS_ADMIN`` (or the mask cannot be read),
        else one line: what is missing and the two ways out.
    """
    euid = os.geteuid()
    if euid != 0:
        return f"powerlib cannot change {what}: this process is not root (uid {euid}); {WAYS_OUT}"
    caps = effective_capabilities(status_path)
    if caps is not None and not caps >> CAP_SYS_ADMIN & 1:
        return (
            f"powerlib cannot change {what}: the process is root but lacks CAP_SYS_ADMIN (a "
            "container without --cap-add SYS_ADMIN?); add the capability, or start the node agent "
            "on the host and set POWERLIB_BACKEND=agent"
        )
    return None
