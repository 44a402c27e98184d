"""The events file: how a measured command's own steps reach ``powerlib measure``.

``powerlib measure -- CMD`` (:func:`powerlib.measurement.command.run_command`) names a file in
``POWERLIB_MEASURE_EVENTS`` for its child. A measurement in the child (``powerlib.measure``, a
trainer callback) appends its windows to it as JSON lines (:func:`write_events`, from its
sampler thread every half second and at its end); the parent reads them when the child ends
(:func:`read_events`) and records the lowest reporting rank's windows on its own measurement
(:func:`record_child_windows`), so the child's steps get the energy of every measured device.
``time.monotonic`` is the same in every process of a host, so the two clocks agree.

The file is written by a process powerlib does not control: a bad line is skipped with one
warning, and a number that is not finite counts as unreported (docs/measurement.md §6).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from powerlib.errors import InvalidArgumentError
from powerlib.inputs import json_depth

if TYPE_CHECKING:
    from powerlib.measurement.measure import Measurement, Window

__all__ = [
    "EVENTS_ENV",
    "EVENTS_MAX_DEPTH",
    "read_events",
    "record_child_windows",
    "write_events",
]

logger = logging.getLogger(__name__)

EVENTS_ENV = "POWERLIB_MEASURE_EVENTS"
"""When set (``powerlib measure`` sets it for its child), measurements append their windows to
this file as JSON lines, so the parent can mark and attribute the child's steps."""

EVENTS_MAX_DEPTH = 8
"""An events line is one flat object; deeper JSON is refused before the recursive decoder."""


def write_events(path: str | os.PathLike[str], windows: Sequence[Window], rank: int) -> None:
    """Append ``windows`` to ``path``, one JSON line each.

    Raises:
        OSError: The file cannot be opened or written.
    """
    with open(path, "a", encoding="utf-8") as f:
        for w in windows:
            f.write(
                json.dumps(
                    {
                        "kind": w.kind,
                        "name": w.name,
                        "index": w.index,
                        "rank": rank,
                        "pid": os.getpid(),
                        "start_s": w.start_s,
                        "end_s": w.end_s,
                        "tokens": w.tokens,
                    }
                )
                + "\n"
            )


def read_events(
    path: str | os.PathLike[str], *, warn: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """The windows a child appended to an events file.

    A malformed line (not JSON, not UTF-8, nested deeper than :data:`EVENTS_MAX_DEPTH`, a
    number out of range) is skipped, and one warning says how many were and why the first was:
    the child's bad line never costs the measurement (docs/measurement.md §6).

    Args:
        path: The events file (missing: no windows).
        warn: Called with that one warning line instead of logging it.
    """
    out = []
    skipped = 0
    first = ""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    if (
                        line.count("{") + line.count("[") > EVENTS_MAX_DEPTH
                        and json_depth(line, EVENTS_MAX_DEPTH) > EVENTS_MAX_DEPTH
                    ):
                        raise ValueError(f"JSON nested more than {EVENTS_MAX_DEPTH} levels deep")
                    item = json.loads(line)
                except (ValueError, RecursionError) as err:
                    skipped += 1
                    first = first or f"line {number}: {str(err)[:200]}"
                    continue
                if isinstance(item, dict) and isinstance(item.get("start_s"), (int, float)):
                    out.append(item)
    except FileNotFoundError:
        return []
    if skipped:
        message = f"skipped {skipped} malformed line(s) of the events file {path} (first: {first})"
        if warn is not None:
            warn(message)
        else:
            logger.warning("measure: %s", message)
    return out


def _number(value: Any) -> float | None:
    """A finite float from a child's JSON number, else ``None`` (``1e999``, a 400-digit int)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def record_child_windows(m: Measurement, events: list[dict[str, Any]]) -> None:
    """Record on ``m`` the steps and windows the child reported: the lowest reporting rank's.

    The child's numbers are checked: a window without finite start and end is dropped, and
    tokens that are not a finite number count as unreported (docs/measurement.md §6).
    """
    ranks = [e.get("rank", 0) for e in events if isinstance(e.get("rank", 0), int)]
    if not ranks:
        return
    first = min(ranks)
    for e in events:
        start_s, end_s = _number(e.get("start_s")), _number(e.get("end_s"))
        if e.get("rank", 0) != first or start_s is None or end_s is None:
            continue
        kind = e.get("kind")
        if kind not in ("step", "window"):
            continue
        with contextlib.suppress(InvalidArgumentError):
            m.record(
                kind,
                str(e.get("name", kind)),
                start_s,
                end_s,
                tokens=_number(e.get("tokens")),
                index=e.get("index") if isinstance(e.get("index"), int) else None,
            )
