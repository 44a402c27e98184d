"""The control plane: every change to a device journaled first and always undone.

This package is the only code that changes clocks and power limits. Its public names are
importable from here (``from powerlib.control import ControlSession``) and load on first use, so
``import powerlib.control`` costs nothing until a name is needed. The modules, from the bottom
up (each imports only those above it):

``trust``         owner/mode/type checks on descriptors, bounded field parsers (root reads these)
``state``         the state folder, device keys, owners (pid + start time)
``journal``       what a session changed and the originals, filed under ``journal/``
``locks``         one POSIX record lock per device under ``locks/``
``restore``       put a device back from a record, or every journal a dead owner left
``user_restore``  root acting for a user's job: reset to driver defaults, never user values
``guardian``      the watchdog process that restores when its owner dies, and how to start it
``exits``         atexit and SIGTERM/SIGHUP restore of the open sessions
``session``       :class:`ControlSession`, the one controller of some devices
``manual``        ``powerlib set`` / ``powerlib reset``

The control plane imports the device contract, the registry and the leaves (errors, config,
inputs), never the runtime, planning or measurement (tests/test_boundaries.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from powerlib.control.journal import (
        UNKNOWN_LOCK,
        Change,
        JournalEntry,
        JournalError,
        iter_entries,
    )
    from powerlib.control.locks import DeviceLock
    from powerlib.control.manual import (
        ResetOutcome,
        ResetResult,
        SetResult,
        reset_devices,
        set_device,
    )
    from powerlib.control.restore import (
        RestoreOutcome,
        restore_device,
        restore_failure,
        restore_journals,
    )
    from powerlib.control.session import ControlSession, ensure_not_controlled
    from powerlib.control.state import Owner, StateDir, device_key
    from powerlib.control.trust import check_trusted, describe_owner
    from powerlib.control.user_restore import restore_for_user

_HOMES = {
    "Change": "journal",
    "ControlSession": "session",
    "DeviceLock": "locks",
    "JournalEntry": "journal",
    "JournalError": "journal",
    "Owner": "state",
    "ResetOutcome": "manual",
    "ResetResult": "manual",
    "RestoreOutcome": "restore",
    "SetResult": "manual",
    "StateDir": "state",
    "UNKNOWN_LOCK": "journal",
    "check_trusted": "trust",
    "describe_owner": "trust",
    "device_key": "state",
    "ensure_not_controlled": "session",
    "iter_entries": "journal",
    "reset_devices": "manual",
    "restore_device": "restore",
    "restore_failure": "restore",
    "restore_for_user": "user_restore",
    "restore_journals": "restore",
    "set_device": "manual",
}

__all__ = [
    "UNKNOWN_LOCK",
    "Change",
    "ControlSession",
    "DeviceLock",
    "JournalEntry",
    "JournalError",
    "Owner",
    "ResetOutcome",
    "ResetResult",
    "RestoreOutcome",
    "SetResult",
    "StateDir",
    "check_trusted",
    "describe_owner",
    "device_key",
    "ensure_not_controlled",
    "iter_entries",
    "reset_devices",
    "restore_device",
    "restore_failure",
    "restore_for_user",
    "restore_journals",
    "set_device",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'powerlib.control' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"powerlib.control.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
