"""The Kareus search's evaluation records and their resumable JSON Lines log.

With ``log_path`` every measurement is appended as one JSON line and flushed as it is taken
(schema :data:`LOG_SCHEMA`; a header line first); :mod:`powerlib.kareus.search` replays
the log on a rerun, and :func:`read_log` hands every record to composition.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from powerlib.errors import PlanError
from powerlib.inputs import parse_json, read_text
from powerlib.kareus.partition_types import Config

__all__ = ["LOG_SCHEMA", "PASSES", "SOURCES", "EvaluationRecord", "read_log"]

LOG_SCHEMA = "powerlib.kareus-log.v1"
"""Schema tag of the evaluation log's header line."""

PASSES: tuple[str, ...] = ("total", "dynamic", "fastest", "uncertainty")
"""The acquisition passes, in the paper's order."""

SOURCES: tuple[str, ...] = ("init", *PASSES, "fill")
"""Where an evaluated configuration came from."""


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# The evaluation log
# --------------------------------------------------------------------------------------------


def _num(value: Any, name: str, where: str, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PlanError(f"{where}: {name} must be a finite number, got {value!r}")
    return float(value)


class _Log:
    """The JSON Lines evaluation log: replayed on open, appended to as measurements arrive."""

    def __init__(self, path: Path | None, key: str, header: dict[str, Any]) -> None:
        self.path = path
        self.key = key
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
            self._write(header)

    def _read(self, path: Path, header: dict[str, Any]) -> None:
        for lineno, obj, where in _log_objects(path):
            if lineno == 1:
                self._check_header(obj, header, where)
                continue
            rec = self._parse_record(obj, where)
            if rec.config in self.records:
                raise PlanError(f"{where}: configuration {rec.config} is logged twice")
            self.records[rec.config] = rec

    def _check_header(self, obj: dict[str, Any], header: dict[str, Any], where: str) -> None:
        if obj.get("schema") != LOG_SCHEMA:
            raise PlanError(f"{where}: not a {LOG_SCHEMA} header (schema {obj.get('schema')!r})")
        if obj.get("partition") != header["partition"]:
            raise PlanError(
                f"{where}: the log is for partition {obj.get('partition')!r}, not "
                f"{header['partition']!r}"
            )
        if obj.get("space_size") != header["space_size"]:
            raise PlanError(
                f"{where}: the log's space has {obj.get('space_size')!r} configurations, this "
                f"search's {header['space_size']}"
            )
        p_static = _num(obj.get("p_static_w"), "p_static_w", where)
        if p_static is None or not math.isclose(p_static, header["p_static_w"], rel_tol=1e-9):
            raise PlanError(
                f"{where}: the log was measured with P_static {p_static} W, the evaluator "
                f"reports {header['p_static_w']} W"
            )

    def _parse_record(self, obj: dict[str, Any], where: str) -> EvaluationRecord:
        if obj.get("partition") != self.key:
            raise PlanError(
                f"{where}: a record of partition {obj.get('partition')!r} in the log of "
                f"{self.key!r}"
            )
        slot = obj.get("slot")
        sm = obj.get("sm_count")
        if slot is not None and not isinstance(slot, str):
            raise PlanError(f"{where}: slot must be a string or null, got {slot!r}")
        if isinstance(sm, bool) or not isinstance(sm, int) or sm < 1:
            raise PlanError(f"{where}: sm_count must be a positive integer, got {sm!r}")
        source = obj.get("source")
        if source not in SOURCES:
            raise PlanError(f"{where}: source must be one of {', '.join(SOURCES)}, not {source!r}")
        batch = obj.get("batch")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
            raise PlanError(f"{where}: batch must be a non-negative integer, got {batch!r}")
        freq = _num(obj.get("freq_mhz"), "freq_mhz", where)
        t = _num(obj.get("time_s"), "time_s", where)
        e = _num(obj.get("energy_j"), "energy_j", where)
        ed = _num(obj.get("dynamic_energy_j"), "dynamic_energy_j", where)
        assert freq is not None and t is not None and e is not None and ed is not None
        if t <= 0:
            raise PlanError(f"{where}: time_s must be positive, got {t}")
        return EvaluationRecord(
            config=Config(freq_mhz=freq, sm_count=sm, slot=slot),
            time_s=t,
            energy_j=e,
            dynamic_energy_j=ed,
            source=source,
            batch=batch,
            wall_s=_num(obj.get("wall_s", 0.0), "wall_s", where) or 0.0,
            predicted_time_s=_num(
                obj.get("predicted_time_s"), "predicted_time_s", where, optional=True
            ),
            predicted_dynamic_energy_j=_num(
                obj.get("predicted_dynamic_energy_j"),
                "predicted_dynamic_energy_j",
                where,
                optional=True,
            ),
            predicted_energy_j=_num(
                obj.get("predicted_energy_j"), "predicted_energy_j", where, optional=True
            ),
        )

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

    def _write(self, obj: dict[str, Any]) -> None:
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
    log = _Log(None, partition or "", {})
    out: list[EvaluationRecord] = []
    seen: set[Config] = set()
    for lineno, obj, where in _log_objects(Path(path)):
        if lineno == 1:
            if obj.get("schema") != LOG_SCHEMA:
                raise PlanError(
                    f"{where}: not a {LOG_SCHEMA} header (schema {obj.get('schema')!r})"
                )
            key = obj.get("partition")
            if partition is not None and key != partition:
                raise PlanError(f"{where}: the log is for partition {key!r}, not {partition!r}")
            log.key = str(key)
            continue
        rec = log._parse_record(obj, where)
        if rec.config in seen:
            raise PlanError(f"{where}: configuration {rec.config} is logged twice")
        seen.add(rec.config)
        out.append(rec)
    return out
