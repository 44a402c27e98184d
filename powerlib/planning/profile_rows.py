"""One profile row, its checks, and rows to and from CSV text.

A :class:`ProfileRow` is one profiled (stage, kind, frequency) point; the runtime's sweep builds
them one by one, and :class:`~powerlib.planning.profile.Profile` validates a whole set. The CSV
form (the format of Perseus, Zeus and Kareus) is a table of rows, read and written here:

- a header containing ``stage,instruction,frequency,time,energy`` in any order (other columns
  ignored), then one row per (stage, instruction, frequency);
- rank columns (``rank`` or any name ending in ``_rank``) may repeat a (stage, instruction,
  frequency) once per rank of the stage; those rows are merged the way Kareus aggregates the
  TP/CP ranks of a stage: **time = max** over the ranks and **energy = mean**;
- the optional columns :data:`SETTINGS` carry one value on every row (an empty cell: not
  carried).

Messages start with the source name and the line (``"p.csv: line 7: column time ..."``).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from powerlib.errors import PlanError
from powerlib.planning.pipeline import KINDS

__all__ = [
    "CSV_COLUMNS",
    "FIELD_NAMES",
    "SETTINGS",
    "CsvRows",
    "ProfileRow",
    "Where",
    "check_row",
    "check_setting",
    "fmt_freq",
    "rows_from_csv",
    "rows_to_csv",
]

CSV_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
"""The CSV columns a profile needs (any order; others are ignored)."""

SETTINGS = ("p_block_w", "unit_time_s")
"""The planner settings a profile may carry (JSON fields, optional CSV columns)."""

_NUMBER_FIELDS = (("freq_mhz", "MHz"), ("time_s", "s"), ("energy_j", "J"))
# How a message names a row's value: the attribute (rows, JSON fields) or the CSV column.
FIELD_NAMES = {name: name for name in ("stage", "freq_mhz", "time_s", "energy_j")}
"""How a message names a row's values given as rows or JSON fields (see :func:`check_row`)."""
_CSV_NAMES = {
    "stage": "column stage",
    "freq_mhz": "column frequency",
    "time_s": "column time",
    "energy_j": "column energy",
}

Where = str
"""Where a row came from, in messages: ``"line 7"`` (CSV) or ``"rows[3]"`` (JSON, rows)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileRow:
    """One profiled (stage, kind, frequency) point.

    Attributes:
        stage: Pipeline stage, from 0.
        instruction: One of :data:`~powerlib.planning.pipeline.KINDS` (forward, backward,
            backward_input, backward_weight).
        freq_mhz: The locked SM frequency, in MHz.
        time_s: Mean duration of one execution, in seconds.
        energy_j: Mean energy of one execution, in joules.
    """

    stage: int
    instruction: str
    freq_mhz: float
    time_s: float
    energy_j: float


def fmt_freq(freq_mhz: float) -> str:
    """A frequency as messages and CSV write it: ``1410`` for a whole number, else its repr."""
    return str(int(freq_mhz)) if float(freq_mhz).is_integer() else repr(float(freq_mhz))


def check_row(row: ProfileRow, source: str, loc: Where, names: Mapping[str, str]) -> ProfileRow:
    """Validate one row's values and return it with the instruction lower-cased.

    ``names`` says how a message names each value: the CSV column or the field
    (:data:`FIELD_NAMES`).

    Raises:
        PlanError: A stage that is not an integer >= 0, an unknown instruction, or a value
            that is not a finite number (frequency and time > 0, energy >= 0).
    """
    if not isinstance(row, ProfileRow):
        raise PlanError(f"{source}: {loc}: expected a ProfileRow, got {row!r}")
    if isinstance(row.stage, bool) or not isinstance(row.stage, int) or row.stage < 0:
        raise PlanError(
            f"{source}: {loc}: {names['stage']} must be an integer >= 0, got {row.stage!r}"
        )
    kind = row.instruction.strip().lower() if isinstance(row.instruction, str) else None
    if kind not in KINDS:
        raise PlanError(
            f"{source}: {loc}: unknown instruction {row.instruction!r}; expected {', '.join(KINDS)}"
        )
    numbers: list[float] = []
    for name, unit in _NUMBER_FIELDS:
        raw, label = getattr(row, name), names[name]
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise PlanError(f"{source}: {loc}: {label} must be a number, got {raw!r}")
        value = float(raw)
        if not math.isfinite(value):
            raise PlanError(f"{source}: {loc}: {label} must be finite, got {value!r} {unit}")
        # The planner divides time into quanta and needs a clock to lock: both positive.
        if name in ("freq_mhz", "time_s") and value <= 0:
            raise PlanError(f"{source}: {loc}: {label} must be > 0, got {value!r} {unit}")
        if value < 0:
            raise PlanError(f"{source}: {loc}: {label} must be >= 0, got {value!r} {unit}")
        numbers.append(value)
    freq_mhz, time_s, energy_j = numbers
    return ProfileRow(
        stage=row.stage, instruction=kind, freq_mhz=freq_mhz, time_s=time_s, energy_j=energy_j
    )


def check_setting(value: Any, name: str, prefix: str) -> float | None:
    """A carried planner setting (:data:`SETTINGS`), checked; ``None`` when absent.

    Messages start with ``prefix`` then ``name`` (e.g. ``"p.csv: line 3: column "``).

    Raises:
        PlanError: Not a finite number, negative, or a zero ``unit_time_s``.
    """
    if value is None:
        return None
    unit = "W" if name == "p_block_w" else "s"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"{prefix}{name} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise PlanError(f"{prefix}{name} must be finite, got {number!r} {unit}")
    if name == "unit_time_s" and number <= 0:
        raise PlanError(f"{prefix}{name} must be > 0, got {number!r} {unit}")
    if number < 0:
        raise PlanError(f"{prefix}{name} must be >= 0, got {number!r} {unit}")
    return number


# --- CSV -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CsvRows:
    """What a CSV profile holds, before the profile's own validation.

    Attributes:
        rows: One per (stage, instruction, frequency), rank rows merged, in file order.
        where: Each row's first line (``"line 7"``).
        settings: The carried :data:`SETTINGS` columns that have a value.
    """

    rows: list[ProfileRow]
    where: list[Where]
    settings: dict[str, float]


@dataclass(frozen=True, slots=True)
class _Header:
    """Where a CSV profile's header puts each column."""

    width: int
    column: dict[str, int]  # CSV_COLUMNS
    setting_column: dict[str, int]  # the SETTINGS present
    rank_columns: list[int]


@dataclass(slots=True)
class _Group:
    """The rows of one (stage, kind, frequency): one per rank."""

    first: Where
    times: list[float]
    energies: list[float]
    ranks: set[tuple[str, ...]]


def rows_from_csv(
    text: str, source: str, *, progress: Callable[[int, int], None] | None = None
) -> CsvRows:
    """Read the rows of a CSV profile (module docstring), one row per line checked.

    Args:
        text: The CSV text, header first (a byte-order mark is skipped).
        source: Names the text in error messages.
        progress: ``progress(lines_done, lines_total)`` every 65,536 lines.

    Raises:
        PlanError: A missing or repeated column, a malformed or invalid value, a duplicate
            row, or no rows; the message gives the line.
    """
    text = text.removeprefix("\ufeff")
    reader = csv.reader(io.StringIO(text))
    lines = _csv_lines(reader, source)
    header = _csv_header(lines, lambda: reader.line_num, source)
    settings: dict[str, tuple[float, Where]] = {}
    groups: dict[tuple[int, str, float], _Group] = {}
    total_lines = text.count("\n") + 1 if progress is not None else 0
    for fields in lines:
        if not any(field.strip() for field in fields):
            continue
        if progress is not None and reader.line_num % 65536 == 0:
            progress(reader.line_num, total_lines)
        loc = f"line {reader.line_num}"
        row = _csv_row(fields, header, source, loc)
        for name, i in header.setting_column.items():
            _csv_setting(settings, name, fields[i].strip(), source, loc)
        key = (row.stage, row.instruction, row.freq_mhz)
        ranks = tuple(fields[i].strip() for i in header.rank_columns)
        group = groups.get(key)
        if group is None:
            groups[key] = _Group(loc, [row.time_s], [row.energy_j], {ranks})
            continue
        if not header.rank_columns or ranks in group.ranks:
            raise PlanError(
                f"{source}: {loc}: duplicate row for stage {row.stage} "
                f"{row.instruction} at {fmt_freq(row.freq_mhz)} MHz (first at {group.first})"
            )
        group.times.append(row.time_s)
        group.energies.append(row.energy_j)
        group.ranks.add(ranks)
    if not groups:
        raise PlanError(f"{source}: the profile has a header but no rows")
    rows = [
        ProfileRow(
            stage=stage,
            instruction=kind,
            freq_mhz=freq_mhz,
            time_s=max(group.times),
            energy_j=math.fsum(group.energies) / len(group.energies),
        )
        for (stage, kind, freq_mhz), group in groups.items()
    ]
    return CsvRows(
        rows=rows,
        where=[group.first for group in groups.values()],
        settings={name: value for name, (value, _) in settings.items()},
    )


def rows_to_csv(rows: Iterable[ProfileRow], settings: Mapping[str, float]) -> str:
    """Rows as CSV text, header ``stage,instruction,frequency,time,energy``.

    ``settings`` follow as columns (the same value on every row; tools that read only the five
    columns ignore them). Floats are written with :func:`repr`, so the round trip is lossless.
    """
    extra = [repr(float(value)) for value in settings.values()]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*CSV_COLUMNS, *settings])
    for row in rows:
        writer.writerow(
            [
                row.stage,
                row.instruction,
                fmt_freq(row.freq_mhz),
                repr(row.time_s),
                repr(row.energy_j),
                *extra,
            ]
        )
    return out.getvalue()


def _csv_header(lines: Iterator[list[str]], line_num: Callable[[], int], source: str) -> _Header:
    """The first non-blank line as the header: the columns it must have, and where.

    Raises:
        PlanError: No header, a missing column, or a column named twice.
    """
    header: list[str] | None = None
    for fields in lines:
        if any(field.strip() for field in fields):
            header = [field.strip().lower() for field in fields]
            break
    if header is None:
        raise PlanError(
            f"{source}: the profile is empty; expected a header {','.join(CSV_COLUMNS)}"
        )
    header_line = line_num()
    missing = [name for name in CSV_COLUMNS if name not in header]
    if missing:
        raise PlanError(
            f"{source}: line {header_line}: missing column(s) {', '.join(missing)}; the "
            f"header needs {','.join(CSV_COLUMNS)}"
        )
    for name in (*CSV_COLUMNS, *SETTINGS):
        if header.count(name) > 1:
            raise PlanError(f"{source}: line {header_line}: column {name!r} appears twice")
    return _Header(
        width=len(header),
        column={name: header.index(name) for name in CSV_COLUMNS},
        setting_column={name: header.index(name) for name in SETTINGS if name in header},
        rank_columns=[
            i for i, name in enumerate(header) if name == "rank" or name.endswith("_rank")
        ],
    )


def _csv_row(fields: Sequence[str], header: _Header, source: str, loc: Where) -> ProfileRow:
    """One CSV line's row, checked (:func:`check_row`).

    Raises:
        PlanError: A field count unlike the header's, or a malformed or invalid value.
    """
    if len(fields) != header.width:
        raise PlanError(
            f"{source}: {loc}: expected {header.width} fields as in the header, got {len(fields)}"
        )
    values = {name: fields[i].strip() for name, i in header.column.items()}
    row = ProfileRow(
        stage=_parse_stage(values["stage"], source, loc),
        instruction=values["instruction"],
        freq_mhz=_parse_number(values["frequency"], "frequency", source, loc),
        time_s=_parse_number(values["time"], "time", source, loc),
        energy_j=_parse_number(values["energy"], "energy", source, loc),
    )
    return check_row(row, source, loc, _CSV_NAMES)


def _parse_number(text: str, column: str, source: str, loc: Where) -> float:
    try:
        return float(text)
    except ValueError:
        raise PlanError(f"{source}: {loc}: column {column} is not a number: {text!r}") from None


def _parse_stage(text: str, source: str, loc: Where) -> int:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if value.is_integer():
        return int(value)
    raise PlanError(f"{source}: {loc}: column stage must be an integer, got {text!r}")


def _csv_setting(
    seen: dict[str, tuple[float, Where]], name: str, text: str, source: str, loc: Where
) -> None:
    """Record a CSV row's ``name`` cell: a number, the same on every row (empty: not given)."""
    if not text:
        return
    value = _parse_number(text, name, source, loc)
    check_setting(value, name, f"{source}: {loc}: column ")
    first = seen.get(name)
    if first is None:
        seen[name] = (value, loc)
    elif value != first[0]:
        raise PlanError(
            f"{source}: {loc}: column {name} is {text} here but {first[0]!r} at {first[1]}; "
            "a profile carries one value"
        )


def _csv_lines(reader: Any, source: str) -> Iterator[list[str]]:
    """The reader's rows; a malformed row (e.g. a field over csv's 128 KiB limit) is one line."""
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as err:
            raise PlanError(f"{source}: line {reader.line_num}: malformed CSV: {err}") from None
        yield fields
