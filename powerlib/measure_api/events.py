"""The events file: how a measured command's own steps reach ``powerlib measure``.

``powerlib measure -- CMD`` (:func:`powerlib.measure_api.command.run_command`) names a file in
``POWERLIB_MEASURE_EVENTS`` for its child. A measurement in the child (``powerlib.measure``, a
trainer callback) appends its windows to it as JSON lines (:func:`write_events`, from its
sampler thread every half second and at its end); the parent reads them when the child ends
(:func:`read_events`) and records the lowest reporting rank's windows on its own measurement
(:func:`powerlib.measure_api.command.record_child_windows`), so the child's steps get the energy of every measured device.
``time.monotonic`` is the same in every process of a host, so the two clocks agree.

The file is written by a process powerlib does not control: a bad line is skipped with one
warning, and a number that is not finite counts as unreported (docs/measurement.md §6).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Protocol

from powerlib.inputs import json_depth


class WindowLike(Protocol):
    """What :func:`write_events` reads of a window (:class:`powerlib.measure_api.measure.Window`)."""

    kind: str
    name: str
    index: int
    start_s: float
    end_s: float | None
    tokens: float | None


__all__ = [
    "EVENTS_MAX_DEPTH",
    "WindowLike",
    "number",
    "read_events",
    "write_events",
]

logger = logging.getLogger(__name__)

EVENTS_MAX_DEPTH = 8
"""An events line is one flat object; deeper JSON is refused before the recursive decoder."""


def write_events(path: str | os.PathLike[str], windows: Sequence[WindowLike], rank: int) -> None:
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
) -> list[dict[str, object]]:
    """The windows a child appended to an events file (untrusted JSON objects).

    A malformed line (not JSON, not UTF-8, nested deeper than :data:`EVENTS_MAX_DEPTH`, a
    number out of range) is skipped, and one warning says how many were and why the first was:
    the child's bad line never costs the measurement (docs/measurement.md §6).

    Args:
        path: The events file (missing: no windows).
        warn: Called with that one warning line instead of logging it.
    """
    out: list[dict[str, object]] = []
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


def number(value: object) -> float | None:
    """A finite float from a child's JSON number, else ``None`` (``1e999``, a 400-digit int)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        found = float(value)
    except OverflowError:
        return None
    return found if math.isfinite(found) else None
