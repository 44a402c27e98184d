"""Bounded reading of files that powerlib does not trust: profiles, plans, studies, journals.

Every file a user (or another user) can hand powerlib goes through here, so that a hostile or
broken file ends in one error line naming the file and the problem, never in a traceback, a
RecursionError, a UnicodeDecodeError, an unbounded allocation or an hour of parsing:

- :func:`read_bytes` caps what is read *before* anything is parsed (``max_bytes``, reading one
  byte past the cap to tell "exactly at the limit" from "larger");
- :func:`decode_text` refuses binary and non-UTF-8 content;
- :func:`parse_json` refuses JSON nested deeper than ``max_depth`` (checked by a linear scan
  before :func:`json.loads`, whose C scanner would otherwise recurse) and malformed JSON;
- :data:`CSV_FIELD_LIMIT` is the field-size limit CSV readers use; ``csv.Error`` becomes one line.

The error type is the caller's (``PlanError`` for profiles and plans, ``JournalError`` for
journals), so exit codes stay those of docs/json-and-exit-codes.md. This module imports nothing from
powerlib but the error base class, so planning code may use it.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from powerlib.config import MAX_INPUT_BYTES_ENV, max_input_bytes
from powerlib.errors import PowerlibError

__all__ = [
    "show_path",
    "CSV_FIELD_LIMIT",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_DEPTH",
    "decode_text",
    "human_bytes",
    "json_depth",
    "load_json_file",
    "parse_json",
    "read_bytes",
    "read_text",
]

#: Largest file read by default (profiles, plans, studies): 64 MiB. A GPT-3 M=96 profile is
#: 7 KiB and its plan 150 KiB, so this is generous; ``POWERLIB_MAX_INPUT_BYTES`` raises it.
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
#: No powerlib format nests deeper than 6 levels; 64 leaves room for extensions.
DEFAULT_MAX_DEPTH = 64
#: No field of a powerlib CSV is longer than a number or an instruction name.
CSV_FIELD_LIMIT = 4096


def human_bytes(n: int) -> str:
    """``n`` bytes in a short human form (``64.0 MiB``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def default_max_bytes() -> int:
    """The input cap: ``POWERLIB_MAX_INPUT_BYTES`` when set to a positive integer, else 64 MiB."""
    cap = max_input_bytes()
    return DEFAULT_MAX_BYTES if cap is None else cap


def read_bytes(
    path: str | Path,
    *,
    what: str,
    error: type[PowerlibError],
    max_bytes: int | None = None,
    follow_symlinks: bool = True,
    check: Callable[[os.stat_result], None] | None = None,
    dir_fd: int | None = None,
) -> bytes:
    """Read at most ``max_bytes`` of a regular file, refusing anything larger.

    Args:
        path: The file.
        what: What the file is, for messages ("profile", "plan", "journal").
        error: The error class to raise.
        max_bytes: The cap (default :func:`default_max_bytes`).
        follow_symlinks: ``False`` opens with ``O_NOFOLLOW`` (journals).
        check: Called with ``fstat`` of the opened descriptor before anything is read (so the
            file checked is the file read: no race with a rename); it raises to refuse the file
            (journals: owner and mode). It runs before the regular-file test, so it sees fifos
            and devices too.
        dir_fd: Open ``path``'s last component relative to this folder descriptor (root reading
            a user's folder: a folder swapped for a symlink after it was checked is never
            followed); ``path`` still names the file in messages.

    Raises:
        error: The file is missing, unreadable, not a regular file, or larger than the cap.
    """
    cap = default_max_bytes() if max_bytes is None else max_bytes
    flags = os.O_RDONLY | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        if dir_fd is None:
            fd = os.open(path, flags | os.O_NONBLOCK)
        else:
            fd = os.open(Path(path).name, flags | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as err:
        reason = (
            "it is a symlink" if not follow_symlinks and err.errno == errno.ELOOP else err.strerror
        )
        raise error(f"{path}: cannot read the {what}: {reason}") from err
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if check is not None:
            check(st)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: the {what} is not a regular file")
        if st.st_size > cap:
            raise error(_too_large(path, what, st.st_size, cap, max_bytes is None))
        try:
            raw = f.read(cap + 1)
        except OSError as err:
            raise error(f"{path}: cannot read the {what}: {err.strerror}") from err
    if len(raw) > cap:  # grew while we read it
        raise error(_too_large(path, what, len(raw), cap, max_bytes is None))
    return raw


def _too_large(path: str | Path, what: str, size: int, cap: int, env_cap: bool) -> str:
    # Only the default cap comes from the environment; a caller's own cap (journals) is fixed.
    hint = f" (set {MAX_INPUT_BYTES_ENV} to raise it)" if env_cap else ""
    return (
        f"{path}: the {what} is {'at least ' if size == cap + 1 else ''}{human_bytes(size)}, "
        f"over the {human_bytes(cap)} input limit; nothing was read{hint}"
    )


def decode_text(raw: bytes, *, path: str | Path, what: str, error: type[PowerlibError]) -> str:
    """UTF-8 text (a BOM is dropped); binary content is refused with one line."""
    if b"\x00" in raw:
        raise error(f"{path}: the {what} is binary (it contains NUL bytes), not UTF-8 text")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise error(
            f"{path}: the {what} is not UTF-8 text (invalid byte 0x{raw[err.start]:02x} at "
            f"offset {err.start})"
        ) from None


def read_text(
    path: str | Path,
    *,
    what: str,
    error: type[PowerlibError],
    max_bytes: int | None = None,
    follow_symlinks: bool = True,
    check: Callable[[os.stat_result], None] | None = None,
) -> str:
    """:func:`read_bytes` then :func:`decode_text`."""
    raw = read_bytes(
        path,
        what=what,
        error=error,
        max_bytes=max_bytes,
        follow_symlinks=follow_symlinks,
        check=check,
    )
    return decode_text(raw, path=path, what=what, error=error)


def json_depth(text: str, limit: int) -> int:
    """The nesting depth of JSON ``text``, counted up to ``limit + 1`` (strings skipped).

    Linear in the text and recursion-free; it does not validate: :func:`json.loads` does that.
    """
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_json(
    text: str,
    *,
    path: str | Path,
    what: str,
    error: type[PowerlibError],
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> Any:
    """Decode JSON, refusing malformed input and nesting deeper than ``max_depth``."""
    # The scan costs a pass over the text; only texts that could be deep need it.
    if text.count("[") + text.count("{") > max_depth and json_depth(text, max_depth) > max_depth:
        raise error(
            f"{path}: the {what} is JSON nested more than {max_depth} levels deep; "
            "no powerlib file is, refusing it"
        )
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        where = f"line {err.lineno}: " if "\n" in text.rstrip("\n") else ""
        raise error(f"{path}: {where}invalid JSON: {err.msg}") from None
    except (ValueError, RecursionError) as err:  # e.g. an integer with too many digits
        raise error(f"{path}: invalid JSON: {err}") from None


def load_json_file(
    path: str | Path,
    *,
    what: str,
    error: type[PowerlibError],
    max_bytes: int | None = None,
    follow_symlinks: bool = True,
    check: Callable[[os.stat_result], None] | None = None,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> Any:
    """Read, decode and parse one JSON file under every bound above."""
    text = read_text(
        path,
        what=what,
        error=error,
        max_bytes=max_bytes,
        follow_symlinks=follow_symlinks,
        check=check,
    )
    return parse_json(text, path=path, what=what, error=error, max_depth=max_depth)


def show_path(path: str | os.PathLike[str]) -> str:
    """A path for a one-line message: as is, or quoted with escapes if it holds control chars."""
    text = os.fspath(path)
    return text if text.isprintable() else ascii(text)
