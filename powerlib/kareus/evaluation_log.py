"""The Kareus search's evaluation records and their resumable JSON Lines log.

With ``log_path`` every measurement is appended as one JSON line and flushed as it is taken
(schema :data:`LOG_SCHEMA`; a header line first); :mod:`powerlib.kareus.search` replays
the log on a rerun, and :func:`read_log` hands every record to composition.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from powerlib.errors import PlanError
from powerlib.inputs import parse_json, read_text
from powerlib.kareus.partition_types import Config

__all__ = ["LOG_SCHEMA", "PASSES", "SOURCES", "EvaluationRecord", "LogHeader", "read_log"]

LOG_SCHEMA = "powerlib.kareus-log.v1"
"""Schema tag of the evaluation log's header line."""

PASSES: tuple[str, ...] = ("total", "dynamic", "fastest", "uncertainty")
"""The acquisition passes, in the paper's order."""

SOURCES: tuple[str, ...] = ("init", *PASSES, "fill")
"""Where an evaluated configuration came from."""


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


def _num(value: object, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PlanError(f"{where}: {name} must be a finite number, got {value!r}")
    return float(value)


def _optional(obj: Mapping[str, object], name: str, where: str) -> float | None:
    value = obj.get(name)
    return None if value is None else _num(value, name, where)


@dataclass(frozen=True, slots=True, kw_only=True)
class EvaluationRecord:
    """One measured configuration.

    Attributes:
        config: The configuration.
        time_s: Time of one execution of the partition, per GPU.
        energy_j: Total energy of one execution, per GPU.
        dynamic_energy_j: ``energy_j − P_static · time_s``.
        source: Who selected it: ``init``, ``total``, ``dynamic``, ``fastest``,
            ``uncertainty`` or ``fill`` (:data:`SOURCES`).
        batch: 0 for the initial sample, then the batch number from 1.
        wall_s: Wall (or virtual) time the measurement cost.
        predicted_time_s: The time surrogate's prediction when a model selected it.
        predicted_dynamic_energy_j: The dynamic-energy surrogate's prediction.
        predicted_energy_j: The derived total-energy prediction.
    """

    config: Config
    time_s: float
    energy_j: float
    dynamic_energy_j: float
    source: str
    batch: int
    wall_s: float = 0.0
    predicted_time_s: float | None = None
    predicted_dynamic_energy_j: float | None = None
    predicted_energy_j: float | None = None

    def to_json(self, partition: str) -> dict[str, Any]:
        """The log line of this record (``partition`` names the type it belongs to)."""
        return {
            "partition": partition,
            **self.config.to_json(),
            "time_s": self.time_s,
            "energy_j": self.energy_j,
            "dynamic_energy_j": self.dynamic_energy_j,
            "wall_s": self.wall_s,
            "source": self.source,
            "batch": self.batch,
            "predicted_time_s": self.predicted_time_s,
            "predicted_dynamic_energy_j": self.predicted_dynamic_energy_j,
            "predicted_energy_j": self.predicted_energy_j,
        }

    @classmethod
    def from_json(
        cls, obj: Mapping[str, object], *, partition: str, where: str
    ) -> EvaluationRecord:
        """The record of one log line of ``partition``'s log, validated.

        Raises:
            PlanError: A record of another partition, or a malformed field (naming ``where``).
        """
        if obj.get("partition") != partition:
            raise PlanError(
                f"{where}: a record of partition {obj.get('partition')!r} in the log of "
                f"{partition!r}"
            )
        slot = obj.get("slot")
        sm = obj.get("sm_count")
        if slot is not None and not isinstance(slot, str):
            raise PlanError(f"{where}: slot must be a string or null, got {slot!r}")
        if isinstance(sm, bool) or not isinstance(sm, int) or sm < 1:
            raise PlanError(f"{where}: sm_count must be a positive integer, got {sm!r}")
        source = obj.get("source")
        if not isinstance(source, str) or source not in SOURCES:
            raise PlanError(f"{where}: source must be one of {', '.join(SOURCES)}, not {source!r}")
        batch = obj.get("batch")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
            raise PlanError(f"{where}: batch must be a non-negative integer, got {batch!r}")
        freq = _num(obj.get("freq_mhz"), "freq_mhz", where)
        t = _num(obj.get("time_s"), "time_s", where)
        e = _num(obj.get("energy_j"), "energy_j", where)
        ed = _num(obj.get("dynamic_energy_j"), "dynamic_energy_j", where)
        if t <= 0:
            raise PlanError(f"{where}: time_s must be positive, got {t}")
        return cls(
            config=Config(freq_mhz=freq, sm_count=sm, slot=slot),
            time_s=t,
            energy_j=e,
            dynamic_energy_j=ed,
            source=source,
            batch=batch,
            wall_s=_num(obj.get("wall_s", 0.0), "wall_s", where) or 0.0,
            predicted_time_s=_optional(obj, "predicted_time_s", where),
            predicted_dynamic_energy_j=_optional(obj, "predicted_dynamic_energy_j", where),
            predicted_energy_j=_optional(obj, "predicted_energy_j", where),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class LogHeader:
    """The first line of an evaluation log: which search wrote it (:data:`LOG_SCHEMA`).

    Attributes:
        partition: The partition type searched.
        space_size: Configurations in its space.
        p_static_w: The static power the dynamic energies were computed with.
        seed: The search seed.
        budget: ``(initial samples, batches, batch size)``.
        passes: The acquisition passes.
        shares: Each pass's share of a batch.
        created_unix_s: When the log was started.
    """

    partition: str
    space_size: int
    p_static_w: float
    seed: int
    budget: tuple[int, int, int]
    passes: tuple[str, ...]
    shares: tuple[float, ...]
    created_unix_s: float

    def to_json(self) -> dict[str, object]:
        """The header line (``schema`` first)."""
        return {
            "schema": LOG_SCHEMA,
            "partition": self.partition,
            "space_size": self.space_size,
            "p_static_w": self.p_static_w,
            "seed": self.seed,
            "budget": list(self.budget),
            "passes": list(self.passes),
            "shares": list(self.shares),
            "created_unix_s": self.created_unix_s,
        }

    def check(self, obj: Mapping[str, object], where: str) -> None:
        """Whether a log's header line ``obj`` is of this search: partition, space, P_static.

        The seed, budget, passes and shares are not compared: a rerun with other ones diverges
        from the log, which the search detects as it replays it.

        Raises:
            PlanError: Another schema, partition, space size or static power.
        """
        _check_schema(obj, self.partition, where)
        if obj.get("space_size") != self.space_size:
            raise PlanError(
                f"{where}: the log's space has {obj.get('space_size')!r} configurations, this "
                f"search's {self.space_size}"
            )
        p_static = _num(obj.get("p_static_w"), "p_static_w", where)
        if not math.isclose(p_static, self.p_static_w, rel_tol=1e-9):
            raise PlanError(
                f"{where}: the log was measured with P_static {p_static} W, the evaluator "
                f"reports {self.p_static_w} W"
            )


def _check_schema(obj: Mapping[str, object], partition: str | None, where: str) -> None:
    """A header line of :data:`LOG_SCHEMA` for ``partition`` (``None``: any partition)."""
    if obj.get("schema") != LOG_SCHEMA:
        raise PlanError(f"{where}: not a {LOG_SCHEMA} header (schema {obj.get('schema')!r})")
    key = obj.get("partition")
    if partition is not None and key != partition:
        raise PlanError(f"{where}: the log is for partition {key!r}, not {partition!r}")


# --------------------------------------------------------------------------------------------
# The evaluation log
# --------------------------------------------------------------------------------------------


class _Log:
    """The JSON Lines evaluation log: replayed on open, appended to as measurements arrive."""

    def __init__(self, path: Path | None, header: LogHeader) -> None:
        self.path = path
        self.key = header.partition
        self.records: dict[Config, EvaluationRecord] = {}
        self.used: set[Config] = set()
        self._file: IO[str] | None = None
        if path is None:
            return
        if path.exists() and path.stat().st_size > 0:
            self._read(path, header)
            self._file = path.open("a", encoding="utf-8")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("w", encoding="utf-8")
            self._write(header.to_json())

    def _read(self, path: Path, header: LogHeader) -> None:
        for lineno, obj, where in _log_objects(path):
            if lineno == 1:
                header.check(obj, where)
                continue
            rec = EvaluationRecord.from_json(obj, partition=self.key, where=where)
            if rec.config in self.records:
                raise PlanError(f"{where}: configuration {rec.config} is logged twice")
            self.records[rec.config] = rec

    def check_space(self, index: dict[Config, int]) -> None:
        for config in self.records:
            if config not in index:
                raise PlanError(
                    f"evaluation log {self.path} holds {config!r}, which is not in the "
                    f"configuration space of {self.key!r}"
                )

    def take(self, config: Config) -> EvaluationRecord | None:
        """The logged record of ``config`` (marked used), or None if it must be measured."""
        rec = self.records.get(config)
        if rec is not None:
            self.used.add(config)
            return rec
        if len(self.used) < len(self.records):
            raise PlanError(self.divergence())
        return None

    def divergence(self) -> str:
        unused = len(self.records) - len(self.used)
        return (
            f"evaluation log {self.path} holds {unused} measurement(s) this search did not "
            f"select: it was written with other settings (seed, budget, passes or shares); "
            f"rerun with those settings or start a new log"
        )

    def append(self, record: EvaluationRecord) -> None:
        self._write(record.to_json(self.key))

    def _write(self, obj: dict[str, object]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(obj, allow_nan=False) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _log_objects(path: Path) -> Iterator[tuple[int, dict[str, Any], str]]:
    """``(line number, JSON object, where)`` per non-blank line of an evaluation log.

    Raises:
        PlanError: Unreadable or empty file, or a line that is not a JSON object.
    """
    lines = read_text(path, what="evaluation log", error=PlanError).splitlines()
    if not lines:
        raise PlanError(f"evaluation log {path} is empty but not new: delete it to start over")
    for lineno, line in enumerate(lines, start=1):
        where = f"evaluation log {path}, line {lineno}"
        if not line.strip():
            continue
        obj = parse_json(line, path=where, what="evaluation record", error=PlanError)
        if not isinstance(obj, dict):
            raise PlanError(f"{where}: expected a JSON object")
        yield lineno, obj, where


def read_log(path: str | Path, *, partition: str | None = None) -> list[EvaluationRecord]:
    """Every measurement of an evaluation log, in the order taken (composition reads them all).

    Args:
        path: The JSON Lines log :func:`search_partition` wrote.
        partition: The partition key the log must be for (checked against its header).

    Raises:
        PlanError: Unreadable or malformed log, naming the file and line, or a log of another
            partition.
    """
    out: list[EvaluationRecord] = []
    seen: set[Config] = set()
    key = partition or ""
    for lineno, obj, where in _log_objects(Path(path)):
        if lineno == 1:
            _check_schema(obj, partition, where)
            key = str(obj.get("partition"))
            continue
        rec = EvaluationRecord.from_json(obj, partition=key, where=where)
        if rec.config in seen:
            raise PlanError(f"{where}: configuration {rec.config} is logged twice")
        seen.add(rec.config)
        out.append(rec)
    return out
