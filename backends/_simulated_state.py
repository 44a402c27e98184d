"""The simulated device's state and the file it persists in.

With a wall clock the simulated backend keeps each device's state in
``POWERLIB_STATE_DIR/simulated/<model>-<index>.json`` (a private 0700 folder), so ``powerlib set``
is seen by the next ``powerlib status`` (docs/architecture.md §4). Every access holds an ``flock``
on ``<model>-<index>.lock`` (:func:`state_lock`); a save writes a temporary file (never following a
link) and renames it over the state file. A file that is missing or unreadable starts the device
afresh: :func:`load_state` answers ``None`` for it (and logs why when unreadable).

The file is :class:`SimState` as JSON with a ``schema`` number; fields added later are optional,
so a file without them still loads (one from before clock-change latency has its lock landed and
nothing in flight).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from powerlib.errors import ConfigError, PermissionDeniedError

__all__ = [
    "SimState",
    "load_state",
    "lock_from_json",
    "prepare_state_dir",
    "save_state",
    "state_lock",
]

logger = logging.getLogger(__name__)

_STATE_SCHEMA = 1  # later fields are optional: a file without them still loads
_MAX_PENDING = 4096  # clock changes in flight that a state file may hold


@dataclass(slots=True, kw_only=True)
class SimState:
    """Mutable per-device state; what the state file holds (see the module docstring)."""

    locked_mhz: tuple[float, float] | None  # the setting (NVML's applied clocks)
    power_limit_w: float
    energy_j: float  # exact integral up to t_s
    counter_j: float  # value the counter last published
    t_s: float
    temperature_c: float
    running_mhz: tuple[float, float] | None = None  # the lock the clock runs at (landed)
    # clock changes requested but not landed yet: (landing time, lock), by landing time
    pending: list[tuple[float, tuple[float, float] | None]] = field(default_factory=list)
    switches: int = 0  # clock requests so far: each one's latency draw is keyed by it

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["schema"] = _STATE_SCHEMA
        return data

    @classmethod
    def from_json(cls, data: dict[str, object]) -> SimState:
        if data.get("schema") != _STATE_SCHEMA:
            raise ValueError(f"unknown schema {data.get('schema')!r}")
        locked = lock_from_json(data["locked_mhz"])
        # A file from before clock-change latency: its lock has landed, nothing is in flight.
        running = lock_from_json(data["running_mhz"]) if "running_mhz" in data else locked
        raw_pending = data.get("pending", [])
        if not isinstance(raw_pending, list) or len(raw_pending) > _MAX_PENDING:
            raise ValueError(f"pending must be a list of at most {_MAX_PENDING} clock changes")
        pending = []
        for land_t, lock in raw_pending:
            land_t = float(land_t)
            if not math.isfinite(land_t):
                raise ValueError(f"a clock change lands at {land_t}")
            pending.append((land_t, lock_from_json(lock)))
        switches = data.get("switches", 0)
        if not isinstance(switches, int) or isinstance(switches, bool) or switches < 0:
            raise ValueError(f"switches must be a count, got {switches!r}")
        return cls(
            locked_mhz=locked,
            power_limit_w=_float(data, "power_limit_w"),
            energy_j=_float(data, "energy_j"),
            counter_j=_float(data, "counter_j"),
            t_s=_float(data, "t_s"),
            temperature_c=_float(data, "temperature_c"),
            running_mhz=running,
            pending=sorted(pending, key=lambda change: change[0]),
            switches=switches,
        )


def _float(data: dict[str, object], key: str) -> float:
    """``float(data[key])``: what ``float`` takes from JSON (a number or its text)."""
    value = data[key]
    if not isinstance(value, int | float | str):
        raise TypeError(f"{key} must be a number, got {value!r}")
    return float(value)


def lock_from_json(value: object) -> tuple[float, float] | None:
    """A ``[min, max]`` clock lock from a state file (``None``: unlocked)."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"a clock lock is [min, max], got {value!r}")
    return float(value[0]), float(value[1])


@contextlib.contextmanager
def state_lock(state_path: Path) -> Iterator[None]:
    """Hold the exclusive ``flock`` on ``state_path``'s ``.lock`` file while the context is open."""
    with open(state_path.with_suffix(".lock"), "a+") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def load_state(state_path: Path) -> SimState | None:
    """The saved state; ``None`` when the file is missing or unreadable (the device starts afresh)."""
    try:
        with open(state_path, encoding="utf-8") as f:
            return SimState.from_json(json.load(f))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, IndexError) as err:
        logger.warning("simulated state %s is unreadable (%s); starting afresh", state_path, err)
        return None


def save_state(state_path: Path, state: SimState) -> None:
    """Write ``state`` to a temporary file (mode 0600, no link followed), then rename it over."""
    tmp = state_path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(state.to_json(), f)
    os.replace(tmp, state_path)


def prepare_state_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) if needed and check that it is a writable real directory."""
    try:
        # The state folder itself is created 0700 too, not with the umask (it would be if
        # mkdir(parents=True) made it on the way to simulated/).
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"cannot create the state directory {path}: {err.strerror}; set POWERLIB_STATE_DIR"
        ) from err
    if path.is_symlink() or not path.is_dir():
        raise ConfigError(f"state directory {path} is not a real directory; set POWERLIB_STATE_DIR")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionDeniedError(
            f"state directory {path} is not writable; set POWERLIB_STATE_DIR to a writable directory"
        )
    return path
