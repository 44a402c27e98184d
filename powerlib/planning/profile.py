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
  mean** (energy per GPU). Without rank columns a repeated row is an error. One row and the
  CSV form are :mod:`powerlib.planning.profile_rows`.
- **JSON**: ``{"schema": "powerlib.profile.v1", "rows": [{"stage": 0, "instruction":
  "forward", "freq_mhz": 1410, "time_s": 0.03, "energy_j": 9.0}, ...]}``.

A profile may also carry what the planner needs besides the rows
(:data:`~powerlib.planning.profile_rows.SETTINGS`): the blocking power ``p_block_w`` (W) and
the time quantum ``unit_time_s`` (s) it was planned with. JSON has them as top-level numbers;
CSV as optional columns of those names, the same value on every row (an empty cell: not
carried). ``powerlib plan`` uses them when no option overrides.

Every validation error is a :class:`~powerlib.errors.PlanError` with a one-line message that
starts with the file name and, where one row is at fault, its line (CSV) or row index (JSON)
and the column (CSV) or field (JSON) at fault.

This module is pure: it imports only the standard library.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
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
from powerlib.planning.profile_rows import (
    FIELD_NAMES,
    SETTINGS,
    ProfileRow,
    Where,
    check_row,
    check_setting,
    fmt_freq,
    rows_from_csv,
    rows_to_csv,
)

__all__ = ["PROFILE_SCHEMA", "Profile"]

PROFILE_SCHEMA = "powerlib.profile.v1"
"""The ``schema`` value of a JSON profile."""

_JSON_FIELDS = ("stage", "instruction", "freq_mhz", "time_s", "energy_j")


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
        where: list[Where],
        settings: Mapping[str, Any],
    ) -> None:
        if not rows:
            raise PlanError(f"{source}: the profile has no rows")
        p_block_w = check_setting(settings.get("p_block_w"), "p_block_w", f"{source}: ")
        unit_time_s = check_setting(settings.get("unit_time_s"), "unit_time_s", f"{source}: ")
        clean: list[ProfileRow] = []
        first: dict[tuple[int, str, float], Where] = {}
        for row, loc in zip(rows, where):
            row = check_row(row, source, loc, FIELD_NAMES)
            key = (row.stage, row.instruction, row.freq_mhz)
            if key in first:
                raise PlanError(
                    f"{source}: {loc}: duplicate row for stage {row.stage} {row.instruction} at "
                    f"{fmt_freq(row.freq_mhz)} MHz (first at {first[key]})"
                )
            first[key] = loc
            clean.append(row)
        options: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
        location: dict[tuple[int, str], Where] = {}
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
                    f"frequency ({fmt_freq(points[0][0])} MHz); the planner needs at least two"
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
        where: list[Where],
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
        parsed = rows_from_csv(text, source, progress=progress)
        return cls._create(parsed.rows, source, parsed.where, parsed.settings)

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
        where: list[Where] = []
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
        carried = {
            name: getattr(self, name) for name in SETTINGS if getattr(self, name) is not None
        }
        return rows_to_csv(self.rows, carried)

    def write_csv(self, path: str | Path) -> None:
        """Write the profile as CSV (see :meth:`to_csv_text`).

        Args:
            path: The file to create or replace.
        """
        Path(path).write_text(self.to_csv_text(), encoding="utf-8")


def _row_order(row: ProfileRow) -> tuple[int, int, float]:
    return (row.stage, KINDS.index(row.instruction), -row.freq_mhz)
