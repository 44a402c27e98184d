"""The events file: how a measured command's own steps reach ``powerlib measure``.

``powerlib measure -- CMD`` (:func:`powerlib.measure_api.command.run_command`) names a file in
``POWERLIB_MEASURE_EVENTS`` for its child. A measurement in the child (``powerlib.measure``, a
trainer callback) appends its windows to it as JSON lines (:func:`write_events`, from its
sampler thread every half second and at its end); the parent reads them when the child ends
(:func:`read_events`) and records the lowest reporting rank's windows on its own measurement
(:func:`powerlib.measure_api.command.record_child_windows`), so the child's steps get the energy of every measured device.
``time.monotonic`` is the same in every process of a host, so the two clocks agree.

The file is written by a process powerlib does not control: a bad line is skipped with one
warning, and a number that is not finite counts as unreported (docs/measurement.md §6). Whatever
sits at its path may have been put there by another uid where the folder is shared: it is opened
without following a symbolic link and without blocking (a FIFO), only a regular file is read,
and only its first :data:`EVENTS_MAX_BYTES`, in lines of at most :data:`EVENTS_MAX_LINE_BYTES`
(issue 46: a FIFO hung ``powerlib measure`` forever, a link to ``/dev/zero`` took gigabytes).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
from collections.abc import Callable, Iterator, Sequence
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
    "EVENTS_MAX_BYTES",
    "EVENTS_MAX_DEPTH",
    "EVENTS_MAX_LINE_BYTES",
    "WindowLike",
    "number",
    "read_events",
    "write_events",
]

logger = logging.getLogger(__name__)

EVENTS_MAX_DEPTH = 8
"""An events line is one flat object; deeper JSON is refused before the recursive decoder."""

EVENTS_MAX_BYTES = 32 * 1024 * 1024
"""How much of an events file is read: some 200,000 windows (a line is 120 to 200 bytes); the
rest is ignored with a warning, so a huge or growing file costs bounded memory and time (the
cap full of windows: about 2 s and 250 MiB of parsed lines)."""

EVENTS_MAX_LINE_BYTES = 1024 * 1024
"""A longer line is malformed (skipped, never buffered whole): a window's line is ~200 bytes."""

_CHUNK_BYTES = 64 * 1024

_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""No link followed, no wait for a FIFO's other end (docs/measurement.md §6)."""


def write_events(path: str | os.PathLike[str], windows: Sequence[WindowLike], rank: int) -> None:
    """Append ``windows`` to ``path``, one JSON line each.

    ``path`` is created if missing; a symbolic link, a FIFO or anything else that is not a
    regular file is refused at once rather than followed or waited on.

    Raises:
        OSError: The file cannot be opened or written, or is not a regular file.
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _OPEN_FLAGS, 0o666)
    try:
        _regular(fd, path)
    except OSError:
        os.close(fd)
        raise
    with open(fd, "a", encoding="utf-8") as f:
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
    path: str | os.PathLike[str],
    *,
    warn: Callable[[str], None] | None = None,
    dir_fd: int | None = None,
) -> list[dict[str, object]]:
    """The windows a child appended to an events file (untrusted JSON objects).

    A malformed line (not JSON, not UTF-8, nested deeper than :data:`EVENTS_MAX_DEPTH`, longer
    than :data:`EVENTS_MAX_LINE_BYTES`, a number out of range) is skipped, and one warning says
    how many were and why the first was: the child's bad line never costs the measurement
    (docs/measurement.md §6). Whatever another uid may have put at ``path`` costs one warning
    too, never a hang or unbounded memory: a symbolic link is not followed, a FIFO or device is
    not read (no windows), and reading stops after :data:`EVENTS_MAX_BYTES`.

    Args:
        path: The events file (missing: no windows).
        warn: Called with that one warning line instead of logging it.
        dir_fd: An open descriptor of the folder that holds ``path``: then only its last
            component is opened, in that folder, so a folder swapped since does not matter.
    """
    try:
        fd = _open_regular(path, dir_fd)
    except FileNotFoundError:
        return []
    except OSError as err:
        _warn(f"the events file {path} was not read: {_why(err)}", warn)
        return []
    out: list[dict[str, object]] = []
    skipped = 0
    first = ""
    truncated: list[bool] = []
    try:
        for number, line in enumerate(_lines(fd, truncated), 1):
            try:
                item = _decode(line)
            except (ValueError, RecursionError) as err:
                skipped += 1
                first = first or f"line {number}: {str(err)[:200]}"
                continue
            if isinstance(item, dict) and isinstance(item.get("start_s"), (int, float)):
                out.append(item)
    except OSError as err:  # a read error after the open: keep what was read
        _warn(f"the events file {path} was not read to its end: {_why(err)}", warn)
    finally:
        os.close(fd)
    notes = []
    if skipped:
        notes.append(
            f"skipped {skipped} malformed line(s) of the events file {path} (first: {first})"
        )
    if truncated:
        notes.append(
            f"only its first {EVENTS_MAX_BYTES >> 20} MiB read, the rest ignored"
            if skipped
            else f"the events file {path} is larger than {EVENTS_MAX_BYTES >> 20} MiB: "
            f"only its first {EVENTS_MAX_BYTES >> 20} MiB read, the rest ignored"
        )
    if notes:
        _warn("; ".join(notes), warn)
    return out


def _open_regular(path: str | os.PathLike[str], dir_fd: int | None) -> int:
    """A read descriptor of ``path``, a regular file reached through no symbolic link.

    Raises:
        OSError: It cannot be opened, is a link (``ELOOP``), or is not a regular file.
    """
    name = os.path.basename(path) if dir_fd is not None else path
    fd = os.open(name, os.O_RDONLY | _OPEN_FLAGS, dir_fd=dir_fd)
    try:
        _regular(fd, path)
    except OSError:
        os.close(fd)
        raise
    return fd


def _regular(fd: int, path: str | os.PathLike[str]) -> None:
    """Raise unless ``fd`` is a regular file (fstat after the open: nothing can swap it)."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "something else")
        raise OSError(errno.EINVAL, f"not a regular file ({kind})", os.fspath(path))


_KINDS: tuple[tuple[Callable[[int], bool], str], ...] = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISSOCK, "a socket"),
)


def _why(err: OSError) -> str:
    if err.errno == errno.ELOOP:
        return "it is a symbolic link (not followed)"
    return err.strerror or str(err)


def _warn(message: str, warn: Callable[[str], None] | None) -> None:
    if warn is not None:
        warn(message)
    else:
        logger.warning("measure: %s", message)


def _lines(fd: int, truncated: list[bool]) -> Iterator[bytes | None]:
    """The lines of ``fd`` within :data:`EVENTS_MAX_BYTES`, blank ones too (for the numbering).

    ``None`` stands for a line longer than :data:`EVENTS_MAX_LINE_BYTES`, dropped as it is
    read; ``truncated`` gets ``True`` when the file goes on past the cap (its cut line dropped).
    """
    buf = b""
    dropping = False  # inside an over-long line: skip to its newline
    left = EVENTS_MAX_BYTES
    while left > 0:
        chunk = os.read(fd, min(_CHUNK_BYTES, left))
        if not chunk:
            break
        left -= len(chunk)
        *ended, tail = chunk.split(b"\n")
        for part in ended:
            long = dropping or len(buf) + len(part) > EVENTS_MAX_LINE_BYTES
            yield None if long else buf + part
            buf, dropping = b"", False
        if dropping or len(buf) + len(tail) > EVENTS_MAX_LINE_BYTES:
            buf, dropping = b"", True
        else:
            buf += tail
    if left == 0 and os.read(fd, 1):
        truncated.append(True)
        return
    if dropping:
        yield None
    elif buf:
        yield buf


def _decode(line: bytes | None) -> object:
    """One events line as JSON (``None`` for a blank line).

    Raises:
        ValueError: Too long, too deep, or not JSON.
        RecursionError: The decoder's own limit.
    """
    if line is None:
        raise ValueError(f"longer than {EVENTS_MAX_LINE_BYTES} bytes")
    text = line.decode("utf-8", errors="replace")
    if not text.strip():
        return None
    if (
        text.count("{") + text.count("[") > EVENTS_MAX_DEPTH
        and json_depth(text, EVENTS_MAX_DEPTH) > EVENTS_MAX_DEPTH
    ):
        raise ValueError(f"JSON nested more than {EVENTS_MAX_DEPTH} levels deep")
    return json.loads(text)


def number(value: object) -> float | None:
    """A finite float from a child's JSON number, else ``None`` (``1e999``, a 400-digit int)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        found = float(value)
    except OverflowError:
        return None
    return found if math.isfinite(found) else None
