"""Per-instruction time and energy profiles: the frequency planner's input.

A profile says, for every pipeline stage, every computation kind (forward, backward) and every
profiled SM frequency, how long one execution takes (mean seconds) and how much energy it uses
(mean joules). All microbatches of one (stage, kind) share these numbers.

Two file formats are read and written:

- **CSV** (the format of Perseus, Zeus and Kareus): a header containing
  ``stage,instruction,frequency,time,energy`` in any order, then one row per
  (stage, instruction, frequency). ``instruction`` is ``forward`` or ``backward`` (any case),
  ``frequency`` is in MHz, ``time`` in seconds and ``energy`` in joules. Other columns are
  ignored. Rank columns (``rank`` or any name ending in ``_rank``, as in Zeus's
  ``rank,dp_rank,pp_rank,tp_rank,...``) may repeat a (stage, instruction, frequency) once per
  rank of the stage; those rows are merged the way Kareus aggregates the TP/CP ranks of a
  stage: **time = max** over the ranks (the stage waits for its slowest rank) and **energy =
  mean** (energy per GPU). Without rank columns a repeated row is an error.
- **JSON**: ``{"schema": "powerlib.profile.v1", "rows": [{"stage": 0, "instruction":
  "forward", "freq_mhz": 1410, "time_s": 0.03, "energy_j": 9.0}, ...]}``.

A profile may also carry what the planner needs besides the rows (:data:`SETTINGS`): the
blocking power ``p_block_w`` (W) and the time quantum ``unit_time_s`` (s) it was planned with.
JSON has them as top-level numbers; CSV as optional columns of those names, the same value on
every row (an empty cell: not carried). ``powerlib plan`` uses them when no option overrides.

Every validation error is a :class:`~powerlib.errors.PlanError` with a one-line message that
starts with the file name and, where one row is at fault, its line (CSV) or row index (JSON)
and the column (CSV) or field (JSON) at fault.

This module is pure: it imports only the standard library.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from powerlib.errors import PlanError
from powerlib.inputs import parse_json, read_text
from powerlib.planning.pipeline import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    KINDS,
)

__all__ = ["CSV_COLUMNS", "PROFILE_SCHEMA", "SETTINGS", "Profile", "ProfileRow"]

PROFILE_SCHEMA = "powerlib.profile.v1"
"""The ``schema`` value of a JSON profile."""

CSV_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
"""The CSV columns a profile needs (any order; others are ignored)."""

SETTINGS = ("p_block_w", "unit_time_s")
"""The planner settings a profile may carry (JSON fields, optional CSV columns)."""

_JSON_FIELDS = ("stage", "instruction", "freq_mhz", "time_s", "energy_j")
_NUMBER_FIELDS = (("freq_mhz", "MHz"), ("time_s", "s"), ("energy_j", "J"))
# How a message names a row's value: the attribute (rows, JSON fields) or the CSV column.
_FIELD_NAMES = {name: name for name in ("stage", "freq_mhz", "time_s", "energy_j")}
_CSV_NAMES = {
    "stage": "column stage",
    "freq_mhz": "column frequency",
    "time_s": "column time",
    "energy_j": "column energy",
}


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


_Where = str  # "line 7" (CSV) or "rows[3]" (JSON, constructor)


class Profile:
    """A validated profile: for each stage and kind, at least two (frequency, time, energy) options.

    Validation (each failure is one :class:`~powerlib.errors.PlanError` line naming the source
    and, where it applies, the row and its field): instruction is forward or backward (any
    case); stage is an integer >= 0; frequency and time are finite and > 0; energy is finite
    and >= 0; no two rows share (stage, instruction, frequency); every stage from 0 to the
    largest has both kinds, each with at least two frequencies; ``p_block_w`` is finite and
    >= 0 and ``unit_time_s`` finite and > 0 where given.

    Args:
        rows: The profile rows, in any order.
        source: Names the data in error messages (a file name, or ``"<rows>"``).
        p_block_w: The blocking power the profile carries (W), or ``None``.
        unit_time_s: The time quantum τ the profile carries (s), or ``None``.

    Attributes:
        rows: The rows, sorted by stage, kind (forward first), then frequency from high to low.
        stages: The stages, sorted (always ``0 .. N-1``).
        source: The name used in error messages.
        p_block_w: Power while blocked on communication (W), or ``None`` when not carried.
        unit_time_s: The planner's time quantum τ (s), or ``None`` when not carried.

    Raises:
        PlanError: The rows fail validation.
    """

    __slots__ = ("_options", "p_block_w", "rows", "source", "stages", "unit_time_s")

    rows: tuple[ProfileRow, ...]
    stages: tuple[int, ...]
    source: str
    p_block_w: float | None
    unit_time_s: float | None
    _options: dict[tuple[int, str], list[tuple[float, float, float]]]

    def __init__(
        self,
        rows: Iterable[ProfileRow],
        *,
        source: str = "<rows>",
        p_block_w: float | None = None,
        unit_time_s: float | None = None,
    ) -> None:
        rows = list(rows)
        self._setup(
            rows,
            source,
            [f"rows[{i}]" for i in range(len(rows))],
            {"p_block_w": p_block_w, "unit_time_s": unit_time_s},
        )

    def _setup(
        self,
        rows: list[ProfileRow],
        source: str,
        where: list[_Where],
        settings: Mapping[str, Any],
    ) -> None:
        if not rows:
            raise PlanError(f"{source}: the profile has no rows")
        p_block_w = _check_setting(settings.get("p_block_w"), "p_block_w", f"{source}: ")
        unit_time_s = _check_setting(settings.get("unit_time_s"), "unit_time_s", f"{source}: ")
        clean: list[ProfileRow] = []
        first: dict[tuple[int, str, float], _Where] = {}
        for row, loc in zip(rows, where):
            row = _check_row(row, source, loc, _FIELD_NAMES)
            key = (row.stage, row.instruction, row.freq_mhz)
            if key in first:
                raise PlanError(
                    f"{source}: {loc}: duplicate row for stage {row.stage} {row.instruction} at "
                    f"{_fmt_freq(row.freq_mhz)} MHz (first at {first[key]})"
                )
            first[key] = loc
            clean.append(row)
        options: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
        location: dict[tuple[int, str], _Where] = {}
        for row, loc in zip(clean, where):
            options.setdefault((row.stage, row.instruction), []).append(
                (row.freq_mhz, row.time_s, row.energy_j)
            )
            location.setdefault((row.stage, row.instruction), loc)
        stages = sorted({stage for stage, _ in options})
        for expected, stage in enumerate(stages):
            if stage != expected:
                raise PlanError(
                    f"{source}: stage {expected} is missing (stages present: "
                    f"{', '.join(map(str, stages))}); stages must be numbered 0..N-1 without gaps"
                )
        for stage in stages:
            present = [k for k in KINDS if (stage, k) in options]
            need = [FORWARD]  # and a full backward, or both of its parts, or both forms
            if BACKWARD_INPUT in present or BACKWARD_WEIGHT in present:
                need += [BACKWARD_INPUT, BACKWARD_WEIGHT]
            else:
                need.append(BACKWARD)
            for kind in need:
                if kind not in present:
                    other = present[0]
                    raise PlanError(
                        f"{source}: stage {stage} has {other} rows (first at "
                        f"{location[stage, other]}) but no {kind} rows"
                    )
        for (stage, kind), points in options.items():
            points.sort(key=lambda point: -point[0])
            if len(points) < 2:
                raise PlanError(
                    f"{source}: {location[stage, kind]}: stage {stage} {kind} has only one "
                    f"frequency ({_fmt_freq(points[0][0])} MHz); the planner needs at least two"
                )
        self.rows = tuple(sorted(clean, key=_row_order))
        self.stages = tuple(stages)
        self.source = source
        self.p_block_w = p_block_w
        self.unit_time_s = unit_time_s
        self._options = options

    @classmethod
    def _create(
        cls,
        rows: list[ProfileRow],
        source: str,
        where: list[_Where],
        settings: Mapping[str, Any],
    ) -> Profile:
        profile = cls.__new__(cls)
        profile._setup(rows, source, where, settings)
        return profile

    @property
    def num_stages(self) -> int:
        """The number of pipeline stages the profile covers."""
        return len(self.stages)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Profile):
            return NotImplemented
        return (self.rows, self.p_block_w, self.unit_time_s) == (
            other.rows,
            other.p_block_w,
            other.unit_time_s,
        )

    def __hash__(self) -> int:
        return hash((self.rows, self.p_block_w, self.unit_time_s))

    def __repr__(self) -> str:
        return f"Profile({len(self.stages)} stages, {len(self.rows)} rows, source={self.source!r})"

    def _points(self, stage: int, kind: str) -> list[tuple[float, float, float]]:
        try:
            return self._options[stage, kind]
        except (KeyError, TypeError):
            raise PlanError(
                f"{self.source}: no profile for stage {stage!r} {kind!r}; it has stages "
                f"0..{len(self.stages) - 1} and kinds {', '.join(KINDS)}"
            ) from None

    def options(self, stage: int, kind: str) -> list[tuple[float, float, float]]:
        """The profiled options of one (stage, kind).

        Args:
            stage: The pipeline stage.
            kind: One of :data:`~powerlib.planning.pipeline.KINDS`.

        Returns:
            ``(freq_mhz, time_s, energy_j)`` tuples, highest (fastest) frequency first. The list
            is a copy; at least two entries.

        Raises:
            PlanError: The profile has no such stage or kind.
        """
        return list(self._points(stage, kind))

    def option_points(self) -> dict[tuple[int, str], list[tuple[float, float]]]:
        """Per ``(stage, kind)``, its measured ``(time_s, energy_j)`` options (fastest first)."""
        return {key: [(t, e) for _, t, e in points] for key, points in self._options.items()}

    def max_freq_mhz(self, stage: int, kind: str) -> float:
        """The highest profiled frequency of one (stage, kind), in MHz.

        Args:
            stage: The pipeline stage.
            kind: One of :data:`~powerlib.planning.pipeline.KINDS`.

        Returns:
            The frequency in MHz.

        Raises:
            PlanError: The profile has no such stage or kind.
        """
        return self._points(stage, kind)[0][0]

    def validate_for(self, num_stages: int, kinds: Sequence[str] = (FORWARD, BACKWARD)) -> None:
        """Check that the profile fits a pipeline of ``num_stages`` stages.

        Args:
            num_stages: The pipeline's number of stages; the profile must cover exactly
                stages ``0 .. num_stages-1``.
            kinds: The computation kinds the schedule uses.

        Raises:
            PlanError: The stage count differs, or a (stage, kind) is missing or has fewer than
                two frequencies.
        """
        if len(self.stages) != num_stages:
            raise PlanError(
                f"{self.source}: the profile covers {len(self.stages)} stages but the pipeline "
                f"has {num_stages}"
            )
        for stage in range(num_stages):
            for kind in kinds:
                if len(self._points(stage, kind)) < 2:  # pragma: no cover - enforced at build
                    raise PlanError(f"{self.source}: stage {stage} {kind} has one frequency")

    # --- reading -------------------------------------------------------------------------------

    @classmethod
    def read(
        cls, path: str | Path, *, progress: Callable[[int, int], None] | None = None
    ) -> Profile:
        """Read a profile file; the format follows the suffix (``.csv`` or ``.json``).

        The file is capped before it is parsed (:mod:`powerlib.inputs`: 64 MiB by default).

        Args:
            path: The file.
            progress: For CSV, ``progress(lines_done, lines_total)`` every 65,536 lines.

        Returns:
            The validated profile; error messages name ``path``.

        Raises:
            PlanError: Unknown suffix, unreadable file, or invalid content.
        """
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in (".csv", ".json"):
            raise PlanError(f"{path}: unknown profile format {suffix!r}; use .csv or .json")
        text = read_text(path, what="profile", error=PlanError)
        if suffix == ".csv":
            return cls.from_csv_text(text, source=str(path), progress=progress)
        data = parse_json(text, path=path, what="profile", error=PlanError)
        return cls.from_json(data, source=str(path))

    @classmethod
    def from_csv_text(
        cls,
        text: str,
        source: str = "<string>",
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> Profile:
        """Parse a CSV profile.

        Args:
            text: The CSV text, header first.
            source: Names the text in error messages.
            progress: ``progress(lines_done, lines_total)`` every 65,536 lines.

        Returns:
            The validated profile. Rows repeated once per rank are merged (time = max,
            energy = mean); see the module docstring.

        Raises:
            PlanError: A missing column, a malformed or invalid value, a duplicate row, or a
                profile that fails :class:`Profile` validation; the message gives the line.
        """
        text = text.removeprefix("\ufeff")
        reader = csv.reader(io.StringIO(text))
        rows_in = _csv_rows(reader, source)
        header: list[str] | None = None
        for fields in rows_in:
            if any(field.strip() for field in fields):
                header = [field.strip().lower() for field in fields]
                break
        if header is None:
            raise PlanError(
                f"{source}: the profile is empty; expected a header {','.join(CSV_COLUMNS)}"
            )
        header_line = reader.line_num
        missing = [name for name in CSV_COLUMNS if name not in header]
        if missing:
            raise PlanError(
                f"{source}: line {header_line}: missing column(s) {', '.join(missing)}; the "
                f"header needs {','.join(CSV_COLUMNS)}"
            )
        for name in (*CSV_COLUMNS, *SETTINGS):
            if header.count(name) > 1:
                raise PlanError(f"{source}: line {header_line}: column {name!r} appears twice")
        column = {name: header.index(name) for name in CSV_COLUMNS}
        setting_column = {name: header.index(name) for name in SETTINGS if name in header}
        settings: dict[str, tuple[float, _Where]] = {}
        rank_columns = [
            i for i, name in enumerate(header) if name == "rank" or name.endswith("_rank")
        ]

        # (stage, kind, freq) -> (line of first row, times, energies, rank tuples seen)
        groups: dict[
            tuple[int, str, float], tuple[_Where, list[float], list[float], set[tuple[str, ...]]]
        ] = {}
        total_lines = text.count("\n") + 1 if progress is not None else 0
        for fields in rows_in:
            if not any(field.strip() for field in fields):
                continue
            if progress is not None and reader.line_num % 65536 == 0:
                progress(reader.line_num, total_lines)
            loc = f"line {reader.line_num}"
            if len(fields) != len(header):
                raise PlanError(
                    f"{source}: {loc}: expected {len(header)} fields as in the header, "
                    f"got {len(fields)}"
                )
            values = {name: fields[i].strip() for name, i in column.items()}
            row = ProfileRow(
                stage=_parse_stage(values["stage"], source, loc),
                instruction=values["instruction"],
                freq_mhz=_parse_number(values["frequency"], "frequency", source, loc),
                time_s=_parse_number(values["time"], "time", source, loc),
                energy_j=_parse_number(values["energy"], "energy", source, loc),
            )
            row = _check_row(row, source, loc, _CSV_NAMES)
            for name, i in setting_column.items():
                _csv_setting(settings, name, fields[i].strip(), source, loc)
            key = (row.stage, row.instruction, row.freq_mhz)
            ranks = tuple(fields[i].strip() for i in rank_columns)
            if key in groups:
                first, times, energies, seen_ranks = groups[key]
                if not rank_columns or ranks in seen_ranks:
                    raise PlanError(
                        f"{source}: {loc}: duplicate row for stage {row.stage} "
                        f"{row.instruction} at {_fmt_freq(row.freq_mhz)} MHz (first at {first})"
                    )
                times.append(row.time_s)
                energies.append(row.energy_j)
                seen_ranks.add(ranks)
            else:
                groups[key] = (loc, [row.time_s], [row.energy_j], {ranks})
        if not groups:
            raise PlanError(f"{source}: the profile has a header but no rows")
        rows = [
            ProfileRow(
                stage=stage,
                instruction=kind,
                freq_mhz=freq_mhz,
                time_s=max(times),
                energy_j=math.fsum(energies) / len(energies),
            )
            for (stage, kind, freq_mhz), (_, times, energies, _) in groups.items()
        ]
        return cls._create(
            rows,
            source,
            [group[0] for group in groups.values()],
            {name: value for name, (value, _) in settings.items()},
        )

    @classmethod
    def from_json(cls, data: Any, source: str = "<json>") -> Profile:
        """Build a profile from its JSON form (see :meth:`to_json`).

        Args:
            data: The decoded JSON object.
            source: Names the data in error messages.

        Returns:
            The validated profile.

        Raises:
            PlanError: A wrong schema, a malformed row, or a profile that fails validation; the
                message gives the row index as ``rows[i]``.
        """
        if not isinstance(data, Mapping):
            raise PlanError(f"{source}: a JSON profile must be an object with 'schema' and 'rows'")
        if data.get("schema") != PROFILE_SCHEMA:
            raise PlanError(
                f"{source}: unknown schema {data.get('schema')!r}; expected {PROFILE_SCHEMA!r}"
            )
        items = data.get("rows")
        if not isinstance(items, list):
            raise PlanError(f"{source}: 'rows' must be a list of row objects")
        rows: list[ProfileRow] = []
        where: list[_Where] = []
        for i, item in enumerate(items):
            loc = f"rows[{i}]"
            if not isinstance(item, Mapping):
                raise PlanError(f"{source}: {loc}: expected an object, got {item!r}")
            missing = [name for name in _JSON_FIELDS if name not in item]
            if missing:
                raise PlanError(f"{source}: {loc}: missing field(s) {', '.join(missing)}")
            stage = item["stage"]
            if isinstance(stage, bool) or not isinstance(stage, int):
                raise PlanError(f"{source}: {loc}: stage must be an integer, got {stage!r}")
            if not isinstance(item["instruction"], str):
                raise PlanError(
                    f"{source}: {loc}: instruction must be a string, got {item['instruction']!r}"
                )
            for name in ("freq_mhz", "time_s", "energy_j"):
                value = item[name]
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise PlanError(f"{source}: {loc}: {name} must be a number, got {value!r}")
            rows.append(
                ProfileRow(
                    stage=stage,
                    instruction=item["instruction"],
                    freq_mhz=float(item["freq_mhz"]),
                    time_s=float(item["time_s"]),
                    energy_j=float(item["energy_j"]),
                )
            )
            where.append(loc)
        settings: dict[str, Any] = {}
        for name in SETTINGS:
            settings[name] = data.get(name)  # checked with the rows
        return cls._create(rows, source, where, settings)

    # --- writing -------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The profile as a JSON-ready dict, ``{"schema": ..., "rows": [...]}``.

        Returns:
            A new dict; floats are kept exactly, so the round trip is lossless. ``p_block_w``
            and ``unit_time_s`` are included when the profile carries them.
        """
        carried = {
            name: getattr(self, name) for name in SETTINGS if getattr(self, name) is not None
        }
        return {
            "schema": PROFILE_SCHEMA,
            **carried,
            "rows": [
                {
                    "stage": row.stage,
                    "instruction": row.instruction,
                    "freq_mhz": row.freq_mhz,
                    "time_s": row.time_s,
                    "energy_j": row.energy_j,
                }
                for row in self.rows
            ],
        }

    def write_json(self, path: str | Path) -> None:
        """Write the profile as JSON (see :meth:`to_json`).

        Args:
            path: The file to create or replace.
        """
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    def to_csv_text(self) -> str:
        """The profile as CSV text, header ``stage,instruction,frequency,time,energy``.

        The settings the profile carries follow as columns ``p_block_w`` and ``unit_time_s``
        (the same value on every row; tools that read only the five columns ignore them).

        Returns:
            The text; floats are written with :func:`repr`, so the round trip is lossless.
        """
        carried = [name for name in SETTINGS if getattr(self, name) is not None]
        extra = [repr(float(getattr(self, name))) for name in carried]
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow([*CSV_COLUMNS, *carried])
        for row in self.rows:
            writer.writerow(
                [
                    row.stage,
                    row.instruction,
                    _fmt_freq(row.freq_mhz),
                    repr(row.time_s),
                    repr(row.energy_j),
                    *extra,
                ]
            )
        return out.getvalue()

    def write_csv(self, path: str | Path) -> None:
        """Write the profile as CSV (see :meth:`to_csv_text`).

        Args:
            path: The file to create or replace.
        """
        Path(path).write_text(self.to_csv_text(), encoding="utf-8")


def _row_order(row: ProfileRow) -> tuple[int, int, float]:
    return (row.stage, KINDS.index(row.instruction), -row.freq_mhz)


def _fmt_freq(freq_mhz: float) -> str:
    return str(int(freq_mhz)) if float(freq_mhz).is_integer() else repr(float(freq_mhz))


def _parse_number(text: str, column: str, source: str, loc: _Where) -> float:
    try:
        return float(text)
    except ValueError:
        raise PlanError(f"{source}: {loc}: column {column} is not a number: {text!r}") from None


def _parse_stage(text: str, source: str, loc: _Where) -> int:
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


def _check_row(row: ProfileRow, source: str, loc: _Where, names: Mapping[str, str]) -> ProfileRow:
    """Validate one row's values and return it with the instruction lower-cased.

    ``names`` says how a message names each value: the CSV column or the field.
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


def _check_setting(value: Any, name: str, prefix: str) -> float | None:
    """A carried planner setting (:data:`SETTINGS`), checked; ``None`` when absent.

    Messages start with ``prefix`` then ``name`` (e.g. ``"p.csv: line 3: column "``).
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


def _csv_setting(
    seen: dict[str, tuple[float, _Where]], name: str, text: str, source: str, loc: _Where
) -> None:
    """Record a CSV row's ``name`` cell: a number, the same on every row (empty: not given)."""
    if not text:
        return
    value = _parse_number(text, name, source, loc)
    _check_setting(value, name, f"{source}: {loc}: column ")
    first = seen.get(name)
    if first is None:
        seen[name] = (value, loc)
    elif value != first[0]:
        raise PlanError(
            f"{source}: {loc}: column {name} is {text} here but {first[0]!r} at {first[1]}; "
            "a profile carries one value"
        )


def _csv_rows(reader: Any, source: str) -> Iterable[list[str]]:
    """The reader's rows; a malformed row (e.g. a field over csv's 128 KiB limit) is one line."""
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as err:
            raise PlanError(f"{source}: line {reader.line_num}: malformed CSV: {err}") from None
        yield fields
