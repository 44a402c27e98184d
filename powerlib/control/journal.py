"""Crash-safe records of what powerlib changed on a device, filed in the state folder.

A journal (``journal/<key>.json`` in the state folder, :mod:`powerlib.control.state`) says what
a session changed on one device and the original values. It names its owner by pid *and*
process start time (psutil), so a reused pid is never mistaken for the owner. Journals are
written atomically (temporary file, fsync, rename, fsync of the directory) before the change they
describe; files are opened with ``O_NOFOLLOW`` relative to the state folder's checked
descriptors.

Trust (``powerlib restore`` runs as root on shared nodes): a journal is used only if it passes
:func:`~powerlib.control.trust.check_trusted` (owned by the euid, root or a uid named with
``--trust-owner``, not writable by group or others, a regular file). It is read through
:mod:`powerlib.inputs` (1 MiB cap, UTF-8, nesting limit) with ``O_NOFOLLOW``, and its owner and
mode are checked with ``fstat`` on the opened descriptor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from powerlib.control.state import Owner, StateDir, device_key
from powerlib.control.trust import (
    bounded_text,
    check_trusted,
    create_new,
    finite_number,
    is_int,
)
from powerlib.errors import ConfigError, PermissionDeniedError, PowerlibError, UntrustedStateError
from powerlib.inputs import decode_text, parse_json, read_bytes, show_path

__all__ = [
    "JOURNAL_SCHEMA",
    "UNKNOWN_LOCK",
    "Change",
    "JournalEntry",
    "JournalError",
    "has_journal",
    "iter_entries",
    "journal_names",
    "journal_path",
    "list_journals",
    "read_journal",
    "remove_journal",
    "write_journal",
]

logger = logging.getLogger(__name__)

JOURNAL_SCHEMA = "powerlib.journal.v1"
#: A journal is well under 4 KiB; anything over this cap is refused unread.
JOURNAL_MAX_BYTES = 1024 * 1024
#: A journal nests 4 levels deep (entry, changes, change, clock range).
JOURNAL_MAX_DEPTH = 16
_JOURNAL_NAME = re.compile(r"[A-Za-z0-9._-]+\.json")
_BACKEND_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_ITEMS = ("sm_clocks", "memory_clocks", "power_limit")
#: The original of SM clocks someone else locked to a range the driver does not report (NVML):
#: journaled only by a forced session (docs/real-gpu.md §1); restoring it means unlocking.
UNKNOWN_LOCK = "unknown-lock"


class JournalError(PowerlibError):
    """A journal is unreadable (truncated, corrupted, foreign schema); it is left in place."""

    exit_code = 11


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """One setting a session changed on a device.

    Attributes:
        item: ``"sm_clocks"``, ``"memory_clocks"`` or ``"power_limit"``.
        original: The value before the session touched it: ``[lo, hi]`` MHz or ``None`` (unlocked)
            for clocks, or :data:`UNKNOWN_LOCK` for SM clocks locked to a range the driver does
            not report (a restore unlocks them); watts for the power limit.
        target: The value the session set last, when it is one value (the power limit); ``None``
            for clocks, which a session may change many times per second.
        previous_target: The target before ``target``. The journal is written *before* the device,
            so a process killed in between leaves the device at ``previous_target``; a restore
            must not mistake that for someone else's change.
    """

    item: str
    original: Any
    target: Any = None
    previous_target: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class JournalEntry:
    """Everything needed to put one device back, from any process.

    Attributes:
        device_id: Stable id of the device.
        device_name: For humans.
        backend: Registry name of the backend to reopen.
        backend_settings: The settings needed to reopen the same backend (sysfs root, simulated
            model and count); visibility variables are not recorded: restores see every device.
        owner: The session's process.
        created_s: When the journal was first written (``time.time()``).
        changes: Changed items, in the order they were first touched.
    """

    device_id: str
    device_name: str
    backend: str
    backend_settings: Mapping[str, Any]
    owner: Owner
    created_s: float
    changes: tuple[Change, ...] = field(default_factory=tuple)

    @property
    def key(self) -> str:
        """The device key (file names)."""
        return device_key(self.backend, self.device_id)

    def with_change(self, change: Change) -> JournalEntry:
        """A copy with ``change`` recorded.

        The original of an item is captured once and never overwritten; a later change of the
        same item only updates its target.
        """
        existing = self.change(change.item)
        if existing is None:
            return dataclasses.replace(self, changes=(*self.changes, change))
        updated = Change(
            item=change.item,
            original=existing.original,
            target=change.target,
            previous_target=existing.target,
        )
        return dataclasses.replace(
            self, changes=tuple(updated if c.item == change.item else c for c in self.changes)
        )

    def change(self, item: str) -> Change | None:
        """The change of ``item``, if any."""
        return next((c for c in self.changes if c.item == item), None)

    def to_json(self) -> dict[str, object]:
        """JSON form (schema ``powerlib.journal.v1``)."""
        return {
            "schema": JOURNAL_SCHEMA,
            "device_id": self.device_id,
            "device_name": self.device_name,
            "backend": self.backend,
            "backend_settings": dict(self.backend_settings),
            "owner": self.owner.to_json(),
            "created_s": self.created_s,
            "changes": [
                {
                    "item": c.item,
                    "original": c.original,
                    "target": c.target,
                    "previous_target": c.previous_target,
                }
                for c in self.changes
            ],
        }

    @classmethod
    def from_json(cls, data: Any, source: str) -> JournalEntry:
        """Parse a journal; ``JournalError`` names ``source`` and what is wrong.

        Every field is checked for its type and range (finite numbers, ``[lo, hi]`` clock
        ranges, known items, one change per item), so a restore never acts on a guess.
        """
        try:
            if not isinstance(data, Mapping):
                raise TypeError(f"it is a JSON {type(data).__name__}, not an object")
            if data.get("schema") != JOURNAL_SCHEMA:
                raise ValueError(f"unknown schema {data.get('schema')!r}")
            raw_changes = data["changes"]
            if not isinstance(raw_changes, list):
                raise TypeError("changes is not a list")
            changes: list[Change] = []
            for raw in raw_changes:
                if not isinstance(raw, Mapping):
                    raise TypeError("a change is not an object")
                item = raw["item"]
                if item not in _ITEMS:
                    raise ValueError(f"unknown item {item!r}")
                if any(c.item == item for c in changes):
                    raise ValueError(f"item {item!r} appears twice")
                changes.append(
                    Change(
                        item=item,
                        original=_setting(item, raw["original"], "original"),
                        target=_setting(item, raw.get("target"), "target"),
                        previous_target=_setting(  # absent in older journals
                            item, raw.get("previous_target"), "previous_target"
                        ),
                    )
                )
            backend = data["backend"]
            if not isinstance(backend, str) or not _BACKEND_NAME.fullmatch(backend):
                raise ValueError(f"backend {backend!r} is not a backend name")
            backend_settings = data.get("backend_settings", {})
            if not isinstance(backend_settings, Mapping):
                raise TypeError("backend_settings is not an object")
            return cls(
                device_id=bounded_text(data["device_id"], "device_id", empty_ok=False),
                device_name=bounded_text(data.get("device_name", ""), "device_name"),
                backend=backend,
                backend_settings=_backend_settings(backend_settings),
                owner=Owner.from_json(data["owner"]),
                created_s=finite_number(data["created_s"], "created_s"),
                changes=tuple(changes),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            raise JournalError(
                f"journal {show_path(source)} is malformed ({err}); left in place"
            ) from err


def _setting(item: str, value: Any, name: str) -> Any:
    """A recorded value: ``None``, watts, a ``[lo, hi]`` MHz range, or :data:`UNKNOWN_LOCK`."""
    if value is None:
        if item == "power_limit" and name == "original":
            raise ValueError("the original power limit is missing")
        return None
    if item == "sm_clocks" and name == "original" and value == UNKNOWN_LOCK:
        return UNKNOWN_LOCK
    if item == "power_limit":
        watts = finite_number(value, f"power_limit {name}")
        if watts <= 0:
            raise ValueError(f"power_limit {name} {watts:g} W is not positive")
        return watts
    if not isinstance(value, list) or len(value) != 2:
        raise TypeError(f"{item} {name} is not a [lo, hi] MHz range")
    lo, hi = (finite_number(v, f"{item} {name}") for v in value)
    if not 0 < lo <= hi:
        raise ValueError(f"{item} {name} [{lo:g}, {hi:g}] is not a clock range")
    return [lo, hi]


def _backend_settings(saved: Mapping[str, Any]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in saved.items():
        if key == "sysfs_root":
            out[key] = bounded_text(value, f"backend_settings.{key}", limit=4096)
        elif key == "sim_model":
            if not isinstance(value, str) or not _BACKEND_NAME.fullmatch(value):
                raise ValueError(f"backend_settings.sim_model {value!r} is not a model name")
            out[key] = value
        elif key == "sim_gpus":
            if not is_int(value) or not 0 <= value <= 1024:
                raise ValueError(f"backend_settings.sim_gpus {value!r} is not a count of GPUs")
            out[key] = value
        # Other keys (a newer powerlib's) are ignored: they never reach a backend.
    return out


def journal_path(state: StateDir, key: str) -> Path:
    """Where the journal of device ``key`` lives."""
    return state.journal_dir / f"{key}.json"


def has_journal(state: StateDir, key: str) -> bool:
    """Whether ``journal/<key>.json`` exists (as anything: a symlink is reported too)."""
    try:
        with state.folder("journal") as fd:
            os.stat(f"{key}.json", dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def write_journal(state: StateDir, entry: JournalEntry) -> Path:
    """Write ``entry`` atomically and durably (temporary file, fsync, rename, fsync dir)."""
    path = journal_path(state, entry.key)
    tmp = f".{path.name}.{os.getpid()}.tmp"
    data = json.dumps(entry.to_json(), indent=1).encode()
    try:
        with state.folder("journal") as dir_fd:
            try:
                fd = create_new(tmp, dir_fd=dir_fd)
                try:
                    os.write(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                os.fsync(dir_fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise
    except OSError as err:
        raise PermissionDeniedError(
            f"cannot write the journal {path} ({err.strerror}); the device was not changed"
        ) from err
    return path


def read_journal(state: StateDir, path: Path) -> JournalEntry:
    """Read one journal, refusing it unless it is trusted, bounded and well-formed.

    The file is opened with ``O_NOFOLLOW`` relative to the checked descriptor of
    ``journal/`` and its owner, mode and type are checked with ``fstat`` on that
    descriptor (what is checked is what is read); at most :data:`JOURNAL_MAX_BYTES` are
    read, as UTF-8 JSON nested at most :data:`JOURNAL_MAX_DEPTH` deep. A journal must be
    filed under its own device's key.

    Raises:
        UntrustedStateError: A symlink, fifo or other non-regular file, a file owned by an
            untrusted user, or a group/world-writable one.
        JournalError: Unreadable, too large, not UTF-8, not JSON, too deep, malformed, or
            filed under another device's name.
    """
    path = state.journal_dir / Path(path).name
    shown = show_path(path)
    if not _JOURNAL_NAME.fullmatch(path.name):
        raise JournalError(
            f"journal {shown} is not named after a device key ([A-Za-z0-9._-]+.json); left in place"
        )

    def trusted(st: os.stat_result) -> None:
        check_trusted(path, st, what="journal", directory=False, trusted_uids=state.trusted_uids)

    try:
        with state.folder("journal") as dir_fd:
            try:
                trusted(os.lstat(path.name, dir_fd=dir_fd))  # symlinks, fifos: never opened
            except OSError as err:
                raise JournalError(f"journal {shown} cannot be read ({err.strerror})") from err
            try:
                raw = read_bytes(
                    path,
                    what="journal",
                    error=JournalError,
                    max_bytes=JOURNAL_MAX_BYTES,
                    follow_symlinks=False,
                    check=trusted,
                    dir_fd=dir_fd,
                )
                text = decode_text(raw, path=shown, what="journal", error=JournalError)
                data = parse_json(
                    text, path=shown, what="journal", error=JournalError,
                    max_depth=JOURNAL_MAX_DEPTH,
                )  # fmt: skip
            except JournalError as err:
                raise JournalError(f"{err}; the journal is left in place") from err.__cause__
    except FileNotFoundError as err:
        raise JournalError(f"journal {shown} cannot be read (its folder is gone)") from err
    entry = JournalEntry.from_json(data, str(path))
    if path.name != f"{entry.key}.json":
        raise JournalError(
            f"journal {shown} describes {entry.backend} device {show_path(entry.device_id)}, "
            f"whose journal is {entry.key}.json; left in place"
        )
    return entry


def list_journals(state: StateDir) -> list[Path]:
    """Every journal file (``*.json``, not hidden), oldest first.

    Raises:
        PermissionDeniedError: ``journal/`` exists but cannot be listed.
        UntrustedStateError: ``journal/`` is untrusted (or was swapped for a symlink).
    """
    names = journal_names(state)
    if not names:
        return []
    found = []
    try:
        with state.folder("journal") as fd:
            for name in names:
                try:
                    mtime = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    continue  # restored and removed meanwhile
                found.append((mtime, name, state.journal_dir / name))
    except (FileNotFoundError, ConfigError):
        return []
    return [path for _, _, path in sorted(found)]


def journal_names(state: StateDir) -> set[str]:
    """The names of the journal files (``*.json``, not hidden), without opening any.

    A hidden name is a journal being written (its temporary file).

    Raises:
        PermissionDeniedError: ``journal/`` exists but cannot be listed.
        UntrustedStateError: ``journal/`` is untrusted (or was swapped for a symlink).
    """
    try:
        with state.folder("journal") as fd, os.scandir(fd) as it:
            return {e.name for e in it if e.name.endswith(".json") and e.name[0] != "."}
    except (FileNotFoundError, ConfigError):
        return set()
    except PermissionDeniedError as err:  # the folder could not even be opened
        if not isinstance(err.__cause__, PermissionError):
            raise
        raise _cannot_list(state, err.__cause__) from err
    except OSError as err:
        raise _cannot_list(state, err) from err


def _cannot_list(state: StateDir, err: OSError) -> PermissionDeniedError:
    return PermissionDeniedError(
        f"cannot list the journals in {show_path(state.journal_dir)} ({err.strerror}); "
        "nothing was restored"
    )


def remove_journal(state: StateDir, path: Path) -> None:
    """Delete a journal once its device is restored (``unlinkat`` in ``journal/``)."""
    with contextlib.suppress(OSError, PowerlibError), state.folder("journal") as fd:
        os.unlink(Path(path).name, dir_fd=fd)


def iter_entries(state: StateDir) -> Iterator[tuple[Path, JournalEntry | PowerlibError]]:
    """Every journal with its parsed entry, or the error that refuses it.

    The error is a :class:`JournalError` (unreadable, malformed) or an
    :class:`~powerlib.errors.UntrustedStateError` (owner, mode, type). A journal removed after
    it was listed (its owner finished meanwhile) is skipped.
    """
    for path in list_journals(state):
        try:
            yield path, read_journal(state, path)
        except (JournalError, UntrustedStateError) as err:
            if not os.path.lexists(path):
                continue
            yield path, err


def now_s() -> float:
    """Wall-clock time for journal stamps."""
    return time.time()
