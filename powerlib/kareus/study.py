"""A Kareus study on disk: the workload, the per-partition search logs and the components.

``powerlib kareus search`` writes a study directory; ``powerlib kareus plan`` reads it::

    study/
      study.json            workload (model, parallelism, stage split), clocks, P_static,
                            evaluator description, components (sequential, extras, stock)
      <partition>.jsonl     one resumable evaluation log per partition type (search.py)

Reading validates everything and raises one :class:`PlanError` line naming the file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from powerlib.errors import PlanError
from powerlib.inputs import load_json_file
from powerlib.kareus.compose import STOCK_SM_COUNT, Components
from powerlib.kareus.evaluator import Measurement
from powerlib.kareus.partition import PartitionWorkload, build_workload
from powerlib.kareus.shapes import MODEL_SHAPES, ModelShape, Parallelism

__all__ = ["STUDY_SCHEMA", "Study", "log_path", "read_study", "write_study"]

STUDY_SCHEMA = "powerlib.kareus-study.v1"
STUDY_FILE = "study.json"


@dataclass(frozen=True, slots=True)
class Study:
    """What a study directory holds (the logs are read separately, per partition)."""

    directory: Path
    model_key: str
    workload: PartitionWorkload
    stage_layers: tuple[int, ...]
    freqs_mhz: tuple[float, ...]
    components: Components
    evaluator: Mapping[str, Any]


def log_path(directory: str | Path, key: str) -> Path:
    """The evaluation log of partition type ``key`` in a study directory."""
    return Path(directory) / f"{key}.jsonl"


def _m_json(m: Measurement) -> dict[str, float]:
    """A measurement's fields in ``study.json`` (its row adds where it was taken)."""
    out = {"time_s": m.time_s, "energy_j": m.energy_j}
    if m.avg_freq_mhz is not None:
        out["avg_freq_mhz"] = m.avg_freq_mhz
    return out


def write_study(
    directory: str | Path,
    *,
    model_key: str,
    parallelism: Parallelism,
    stage_layers: tuple[int, ...],
    freqs_mhz: tuple[float, ...],
    components: Components,
    evaluator: Mapping[str, Any],
) -> Path:
    """Write ``study.json`` (atomically) and return its path."""
    path = Path(directory) / STUDY_FILE
    data = {
        "schema": STUDY_SCHEMA,
        "model": model_key,
        "parallelism": {
            "tp": parallelism.tp,
            "cp": parallelism.cp,
            "micro_batch": parallelism.micro_batch,
            "seq_len": parallelism.seq_len,
            "recompute": parallelism.recompute,
        },
        "stage_layers": list(stage_layers),
        "freqs_mhz": list(freqs_mhz),
        "p_static_w": components.p_static_w,
        "stock_sm_count": components.stock_sm_count,
        "evaluator": dict(evaluator),
        "sequential": [
            {"phase": ph, "freq_mhz": f, **_m_json(m)}
            for (ph, f), m in sorted(components.sequential.items())
        ],
        "extras": [
            {"stage": s, "kind": k, "freq_mhz": f, **_m_json(m)}
            for (s, k, f), m in sorted(components.extras.items())
        ],
        "stock": [
            {"partition": key, "freq_mhz": f, **_m_json(m)}
            for (key, f), m in sorted(components.stock.items())
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def _num(entry: Mapping[str, Any], name: str, where: str, *, positive: bool = False) -> float:
    value = entry.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PlanError(f"{where}: {name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise PlanError(f"{where}: {name} must be positive, got {value!r}")
    return float(value)


def _measurement(entry: Any, where: str, p_static_w: float) -> Measurement:
    if not isinstance(entry, dict):
        raise PlanError(f"{where} must be an object")
    avg = entry.get("avg_freq_mhz")
    return Measurement(
        time_s=_num(entry, "time_s", where, positive=True),
        energy_j=_num(entry, "energy_j", where),
        p_static_w=p_static_w,
        avg_freq_mhz=None if avg is None else _num(entry, "avg_freq_mhz", where),
    )


def read_study(directory: str | Path) -> Study:
    """Read and validate a study directory's ``study.json``.

    Raises:
        PlanError: Missing or malformed file, unknown model, inconsistent workload.
    """
    path = Path(directory) / STUDY_FILE
    source = str(path)
    if not path.exists():
        raise PlanError(f"{source}: no study here; run `powerlib kareus search` first")
    data = load_json_file(path, what="study", error=PlanError)
    if not isinstance(data, dict) or data.get("schema") != STUDY_SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise PlanError(f"{source}: schema is {got!r}, expected {STUDY_SCHEMA!r}")
    model_key = data.get("model")
    if model_key not in MODEL_SHAPES:
        raise PlanError(f"{source}: unknown model {model_key!r}; known: {', '.join(MODEL_SHAPES)}")
    model: ModelShape = MODEL_SHAPES[model_key]
    par_raw = data.get("parallelism")
    if not isinstance(par_raw, dict):
        raise PlanError(f"{source}: 'parallelism' must be an object")
    try:
        par = Parallelism(**par_raw)
        layers = tuple(int(n) for n in data.get("stage_layers", []))
        workload = build_workload(model, par, layers)
    except (TypeError, ValueError, PlanError) as err:
        raise PlanError(f"{source}: {err}") from err
    freqs = data.get("freqs_mhz")
    if not isinstance(freqs, list) or not freqs:
        raise PlanError(f"{source}: 'freqs_mhz' must be a non-empty list")
    p_s = _num(data, "p_static_w", source)
    sequential: dict[tuple[str, float], Measurement] = {}
    for i, e in enumerate(data.get("sequential", [])):
        where = f"{source}: sequential[{i}]"
        if not isinstance(e, dict) or e.get("phase") not in ("fwd", "bwd"):
            raise PlanError(f"{where}: phase must be fwd or bwd")
        sequential[(e["phase"], _num(e, "freq_mhz", where))] = _measurement(e, where, p_s)
    extras: dict[tuple[int, str, float], Measurement] = {}
    for i, e in enumerate(data.get("extras", [])):
        where = f"{source}: extras[{i}]"
        if not isinstance(e, dict) or e.get("kind") not in ("forward", "backward"):
            raise PlanError(f"{where}: kind must be forward or backward")
        key = (int(_num(e, "stage", where)), e["kind"], _num(e, "freq_mhz", where))
        extras[key] = _measurement(e, where, p_s)
    stock: dict[tuple[str, float], Measurement] = {}
    known = {p.key for p in workload.partitions}
    for i, e in enumerate(data.get("stock", [])):
        where = f"{source}: stock[{i}]"
        if not isinstance(e, dict) or e.get("partition") not in known:
            raise PlanError(f"{where}: unknown partition {e.get('partition')!r}")
        stock[(e["partition"], _num(e, "freq_mhz", where))] = _measurement(e, where, p_s)
    freq_set = tuple(sorted(float(f) for f in freqs))
    for f in freq_set:
        for ph in ("fwd", "bwd"):
            if (ph, f) not in sequential:
                raise PlanError(f"{source}: no sequential {ph} measurement at {f:g} MHz")
        for name in sorted(known):
            if (name, f) not in stock:
                raise PlanError(f"{source}: no stock measurement of {name} at {f:g} MHz")
    components = Components(
        p_static_w=p_s,
        sequential=sequential,
        extras=extras,
        stock=stock,
        stock_sm_count=int(data.get("stock_sm_count", STOCK_SM_COUNT)),
        freqs_mhz=freq_set,
    )
    evaluator = data.get("evaluator", {})
    return Study(
        directory=Path(directory),
        model_key=model_key,
        workload=workload,
        stage_layers=layers,
        freqs_mhz=freq_set,
        components=components,
        evaluator=evaluator if isinstance(evaluator, dict) else {},
    )
