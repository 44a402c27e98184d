"""Kareus's per-partition search: multi-pass multi-objective Bayesian optimisation (kareus.md §2.1).

One partition type has a finite configuration space (clock × communication SM count × launch
slot, at most 1,080 points). Measuring a candidate costs about 13 s of thermally stable profiling,
so the search measures a small fraction of the space and returns the Pareto set of what it
measured, in the (time, total energy) and (time, dynamic energy) planes.

Algorithm (Alg. 1 and App. C of the paper; the artifact's ``tests/bayesian/common``):

1. Measure ``n_init`` configurations drawn uniformly at random (seeded).
2. For up to ``batches`` batches of ``batch_size``: retrain two surrogates (time ``T`` and
   dynamic energy ``E``; total energy is derived as ``E + P_static·T``, not trained) and a
   5-member bootstrap ensemble of each; predict every unevaluated configuration; pick the batch
   greedily in pass order, each pass excluding what earlier passes took:

   - ``total`` (40 %): hypervolume improvement (HVI) in the normalised (T, E_total) plane;
   - ``dynamic`` (20 %): HVI in the normalised (T, E_dyn) plane;
   - ``fastest`` (20 %): the lowest predicted time (the paper's static-energy pass: static
     energy is ``P_static·T``, so its HVI degenerates to "faster than the fastest");
   - ``uncertainty`` (the rest): the largest ``σ_T + σ_E`` across the ensemble (standard
     deviations of the normalised predictions).

   HVI passes take only candidates whose predicted point improves the hypervolume; a shortfall
   is filled (source ``fill``) by the best of the two HVI scores, ties broken by the smallest
   additive distance to the front. Measure the batch.
3. Stop after ``batches`` batches, when the space is exhausted, or on the hypervolume plateau:
   the mean relative HV gain (normalised total-energy plane) over the last ``R`` batches is
   below ``ε`` (the paper's ``R = 2``, ``ε = 1e-3``; the artifact has no such rule).

Normalisation. Objectives are normalised to [0, 1] by the min and max observed so far (a zero
range normalises to 0). The reference point is ``1.1 × worst observed``, that is 1.1 in
normalised space. The HV gain of a batch compares the fronts before and after it under the *same*
normalisation (the data after the batch), so gains are comparable although the normalisation
moves as data arrive.

HVI. Scores are exact 2-D hypervolume improvements of the surrogate's point prediction against
the front, computed vectorised with numpy from the sorted front (``_hvi_2d``): scoring 1,080
candidates against a 60-point front is one 1,080×61 array operation. Within the HVI passes a
pick's predicted point joins the front before the next pick is scored (a "believer" greedy
batch), so a pass does not spend its share on a dozen neighbours of one promising point; the
paper states "greedily in pass order" without saying whether the front is updated. Reported
hypervolumes (``hv_history``, the stopping rule, :func:`hypervolume`,
:func:`relative_hypervolume`) use ``moocore.hypervolume``.

Surrogates. ``sklearn.ensemble.GradientBoostingRegressor`` with the paper's XGBoost settings
(depth 6, learning rate 0.3, 100 rounds, row subsample 0.8, column subsample 0.8). Measured on the
synthetic landscape of ``tests/kareus/test_search.py`` (4 partition types × 3 seeds, paper
budgets, mean relative HV total/dynamic plane): these settings 0.9994/0.9978; learning rate 0.1
0.9987/0.9968; ``ExtraTreesRegressor`` 0.9985/0.9976; and ``HistGradientBoostingRegressor``
fits ~30× slower on ≤ 224 samples (thread start-up per fit) for no gain. So the paper's choice
stays. The believer batch above beat plain top-k HVI in the same runs (0.9994/0.9978 against
0.9985/0.9969; true Pareto points recovered within 1 %: 81/84 % against 74/78 %). Inputs:
frequency in MHz, the index of the SM count in the space's sorted SM counts, and a one-hot
launch slot, where "no overlap" (``slot=None``) is a category of its own.

Resumable log. With ``log_path`` every measurement is appended as one JSON line and flushed as it
is taken (schema :data:`LOG_SCHEMA`; a header line first). Rerunning with the same log replays
it: the search runs again from the start with the same seed, and each configuration it selects
that the log already holds is taken from the log instead of being measured. Surrogate training
is deterministic, so the same seed and log give exactly the continuation an uninterrupted run
would have taken. A log written with other settings (seed, budget, passes) makes the replay ask
for a configuration the log lacks while logged ones remain unused; that is a
:class:`~powerlib.errors.PlanError` rather than a silent discard of measured GPU time.

scikit-learn and moocore are imported lazily (``pip install 'powerlib[kareus]'``), so the
planning package imports without them.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO, Any, cast

import numpy as np

from powerlib.errors import PlanError
from powerlib.inputs import parse_json, read_text
from powerlib.planning.kareus.evaluator import Evaluator, Measurement
from powerlib.planning.kareus.partition import Budget, Config, PartitionType, search_budget

__all__ = [
    "LOG_SCHEMA",
    "PASSES",
    "SOURCES",
    "EvaluationRecord",
    "SearchResult",
    "hypervolume",
    "read_log",
    "relative_hypervolume",
    "search_partition",
]

LOG_SCHEMA = "powerlib.kareus-log.v1"
"""Schema tag of the evaluation log's header line."""

PASSES: tuple[str, ...] = ("total", "dynamic", "fastest", "uncertainty")
"""The acquisition passes, in the paper's order."""

SOURCES: tuple[str, ...] = ("init", *PASSES, "fill")
"""Where an evaluated configuration came from."""

REF_FACTOR = 1.1
"""Reference point in normalised space: 1.1 × the worst (normalised to 1)."""

ENSEMBLE_SIZE = 5
ENSEMBLE_FRACTION = 0.8

_MISSING_DEPS = "the Kareus search needs scikit-learn and moocore: pip install 'powerlib[kareus]'"

ProgressFn = Callable[[int, int, str], None]


# --------------------------------------------------------------------------------------------
# Optional dependencies
# --------------------------------------------------------------------------------------------


def _moocore() -> ModuleType:
    try:
        import moocore  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError as err:
        raise PlanError(_MISSING_DEPS) from err
    return cast(ModuleType, moocore)


def _sklearn_ensemble() -> ModuleType:
    try:
        # Import the parent first: a blocked ``sklearn`` must fail even when
        # ``sklearn.ensemble`` is still cached in sys.modules.
        import sklearn  # type: ignore[import-untyped,import-not-found,unused-ignore]
        import sklearn.ensemble  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError as err:
        raise PlanError(_MISSING_DEPS) from err
    return cast(ModuleType, sklearn.ensemble)


# --------------------------------------------------------------------------------------------
# Hypervolume helpers
# --------------------------------------------------------------------------------------------


def hypervolume(points: Any, ref: Sequence[float] | float) -> float:
    """Hypervolume dominated by ``points`` (minimisation) up to ``ref``, via moocore.

    Args:
        points: ``(n, d)`` array-like of objective vectors; points not strictly better than
            ``ref`` in every objective contribute nothing.
        ref: Reference point (``d`` values, or one value for all objectives).

    Returns:
        The hypervolume; 0.0 for no points.

    Raises:
        PlanError: If scikit-learn or moocore is missing, or the points are not a 2-D array
            of finite numbers.
    """
    moocore = _moocore()
    arr = np.asarray(points, dtype=float)
    if arr.size == 0:
        return 0.0
    if arr.ndim != 2 or not np.all(np.isfinite(arr)):
        raise PlanError(f"hypervolume needs an (n, d) array of finite numbers, got {arr.shape}")
    refv = np.broadcast_to(np.asarray(ref, dtype=float), (arr.shape[1],))
    inside = np.all(arr < refv, axis=1)
    if not inside.any():
        return 0.0
    return float(moocore.hypervolume(arr[inside], ref=refv))


def _normalise(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    span = hi - lo
    span = np.where(span > 0, span, 1.0)
    out: np.ndarray = (values - lo) / span
    return out


def relative_hypervolume(found_points: Any, all_points: Any, *, ref: float = REF_FACTOR) -> float:
    """HV of the front of ``found_points`` over HV of the front of ``all_points``.

    Both sets are normalised by the per-objective min and max over ``all_points`` (the
    exhaustive ground truth, so the normalisation does not depend on what the search found),
    and the reference point is ``ref`` (1.1) in every normalised objective. This is how target
    T1 ("≥ 98 % of the exhaustive hypervolume") is measured.

    Args:
        found_points: ``(n, d)`` objective vectors the search found (e.g. the true values of
            its Pareto configurations).
        all_points: ``(N, d)`` objective vectors of every configuration.
        ref: Normalised reference point.

    Returns:
        The ratio (1.0 when ``found_points`` contains the true front).

    Raises:
        PlanError: If the arrays are malformed, ``all_points`` is empty or the deps are missing.
    """
    allv = np.asarray(all_points, dtype=float)
    found = np.asarray(found_points, dtype=float)
    if allv.ndim != 2 or allv.shape[0] == 0:
        raise PlanError("relative_hypervolume needs a non-empty (N, d) array of all points")
    if found.size == 0:
        return 0.0
    if found.ndim != 2 or found.shape[1] != allv.shape[1]:
        raise PlanError(
            f"found points {found.shape} and all points {allv.shape} differ in dimension"
        )
    lo, hi = allv.min(axis=0), allv.max(axis=0)
    total = hypervolume(_normalise(allv, lo, hi), ref)
    if total <= 0:
        return 1.0
    return hypervolume(_normalise(found, lo, hi), ref) / total


def _front_2d(points: np.ndarray) -> np.ndarray:
    """The non-dominated points of an ``(n, 2)`` array, sorted by the first objective."""
    if points.shape[0] == 0:
        return points
    order = np.lexsort((points[:, 1], points[:, 0]))
    pts = points[order]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], pts[:-1, 1])))
    return pts[pts[:, 1] < best_before]


def _hvi_2d(front: np.ndarray, cand: np.ndarray, ref: float) -> np.ndarray:
    """Exact 2-D hypervolume improvement of each candidate against ``front``.

    The region ``front`` dominates inside the reference box is a staircase: its upper edge is
    ``ref`` left of the first point, then the ``y`` of the last point at or left of ``x``. The
    improvement of ``c`` is the area of ``[cx, ref] × [cy, ref]`` below that edge, summed over
    the staircase's intervals: one ``(n_candidates, len(front) + 1)`` array operation.

    Args:
        front: ``(m, 2)`` non-dominated points sorted by the first objective (:func:`_front_2d`).
        cand: ``(n, 2)`` candidate points.
        ref: Reference value of both objectives.

    Returns:
        ``(n,)`` improvements, 0 for dominated candidates and those outside the box.
    """
    front = front[(front[:, 0] < ref) & (front[:, 1] < ref)]
    lefts = np.concatenate(([-np.inf], front[:, 0]))
    rights = np.concatenate((front[:, 0], [ref]))
    heights = np.concatenate(([ref], front[:, 1]))
    cx = np.minimum(cand[:, :1], ref)
    cy = cand[:, 1:2]
    width = np.clip(rights[None, :] - np.maximum(lefts[None, :], cx), 0.0, None)
    height = np.clip(heights[None, :] - cy, 0.0, None)
    return np.asarray((width * height).sum(axis=1))


def _gap_2d(front: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Additive distance each candidate must move (both objectives) to be non-dominated."""
    if front.shape[0] == 0:
        return np.zeros(cand.shape[0])
    dx = cand[:, :1] - front[None, :, 0]
    dy = cand[:, 1:2] - front[None, :, 1]
    return np.asarray(np.clip(np.minimum(dx, dy).max(axis=1), 0.0, None))


# --------------------------------------------------------------------------------------------
# Records and results
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


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchResult:
    """What :func:`search_partition` measured and found.

    Attributes:
        key: The partition type's key.
        budget: The budget it ran under.
        seed: The seed of the initial sample and the surrogates.
        p_static_w: Static power used to derive total energy from dynamic energy.
        evaluations: Every measurement, in the order taken.
        hv_history: Normalised total-plane hypervolume of the observed front after the initial
            sample and after each batch, each under the normalisation of the data at that point.
        hv_gains: Per batch, the relative HV gain of its measurements (front after vs before,
            both normalised by the data after the batch).
        stopped: ``"plateau"`` (the HV-plateau rule fired, possibly at the last batch),
            ``"budget"`` (every batch ran without it firing) or ``"exhausted"`` (no
            unevaluated configuration was left).
    """

    key: str
    budget: Budget
    seed: int
    p_static_w: float
    evaluations: tuple[EvaluationRecord, ...]
    hv_history: tuple[float, ...]
    hv_gains: tuple[float, ...]
    stopped: str

    @property
    def evaluations_used(self) -> int:
        """Configurations measured (or replayed from the log)."""
        return len(self.evaluations)

    @property
    def batches_run(self) -> int:
        """Model-guided batches that ran."""
        return len(self.hv_gains)

    @property
    def wall_s(self) -> float:
        """Sum of the measurements' wall time (the profiling cost, protocol included)."""
        return math.fsum(r.wall_s for r in self.evaluations)

    def points(self, plane: str = "total") -> np.ndarray:
        """``(n, 2)`` array of (time, total or dynamic energy) of every evaluation.

        Raises:
            PlanError: On an unknown plane.
        """
        if plane == "total":
            return np.array([[r.time_s, r.energy_j] for r in self.evaluations], dtype=float)
        if plane == "dynamic":
            return np.array([[r.time_s, r.dynamic_energy_j] for r in self.evaluations], dtype=float)
        raise PlanError(f"plane must be 'total' or 'dynamic', not {plane!r}")

    def pareto(self, plane: str = "total") -> list[EvaluationRecord]:
        """The non-dominated evaluations in the (time, energy) ``plane``, fastest first.

        Args:
            plane: ``"total"`` (time, total energy) or ``"dynamic"`` (time, dynamic energy).

        Raises:
            PlanError: On an unknown plane, or if moocore is missing.
        """
        pts = self.points(plane)
        if pts.shape[0] == 0:
            return []
        keep = np.asarray(_moocore().is_nondominated(pts), dtype=bool)
        chosen = [r for r, k in zip(self.evaluations, keep) if k]
        return sorted(chosen, key=lambda r: (r.time_s, r.energy_j))

    def front_sources(self, plane: str = "total") -> dict[str, int]:
        """How many of the :meth:`pareto` points each source found (all sources listed)."""
        counts = dict.fromkeys(SOURCES, 0)
        for r in self.pareto(plane):
            counts[r.source] += 1
        return counts


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


# --------------------------------------------------------------------------------------------
# Surrogates
# --------------------------------------------------------------------------------------------


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


def _encode(configs: Sequence[Config]) -> np.ndarray:
    """Features: frequency (MHz), SM-count index, one-hot slot (``None`` its own category)."""
    sms = sorted({c.sm_count for c in configs})
    sm_index = {s: i for i, s in enumerate(sms)}
    slots: list[str | None] = []
    for c in configs:
        if c.slot is not None and c.slot not in slots:
            slots.append(c.slot)
    if any(c.slot is None for c in configs):
        slots.append(None)
    slot_index = {s: i for i, s in enumerate(slots)}
    x = np.zeros((len(configs), 2 + len(slots)))
    for i, c in enumerate(configs):
        x[i, 0] = c.freq_mhz
        x[i, 1] = sm_index[c.sm_count]
        x[i, 2 + slot_index[c.slot]] = 1.0
    return x


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([p & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


def _fit(ensemble: ModuleType, x: np.ndarray, y: np.ndarray, seed: int) -> Any:
    model = ensemble.GradientBoostingRegressor(
        max_depth=6,
        learning_rate=0.3,
        n_estimators=100,
        subsample=0.8,
        max_features=0.8,
        random_state=seed,
    )
    model.fit(x, y)
    return model


@dataclass(frozen=True, slots=True)
class _Predictions:
    time_s: np.ndarray
    dynamic_energy_j: np.ndarray
    sigma: np.ndarray  # σ_T + σ_E of the normalised ensemble predictions


def _predict(
    ensemble: ModuleType,
    x_obs: np.ndarray,
    t_obs: np.ndarray,
    e_obs: np.ndarray,
    x_cand: np.ndarray,
    seed: int,
    batch: int,
) -> _Predictions:
    t_model = _fit(ensemble, x_obs, t_obs, _seed(seed, batch, 0))
    e_model = _fit(ensemble, x_obs, e_obs, _seed(seed, batch, 1))
    t_pred = np.asarray(t_model.predict(x_cand), dtype=float)
    e_pred = np.asarray(e_model.predict(x_cand), dtype=float)
    n = x_obs.shape[0]
    size = max(2, int(round(ENSEMBLE_FRACTION * n)))
    t_members = np.empty((ENSEMBLE_SIZE, x_cand.shape[0]))
    e_members = np.empty_like(t_members)
    for m in range(ENSEMBLE_SIZE):
        rng = np.random.default_rng(_seed(seed, batch, 100 + m))
        idx = rng.choice(n, size=size, replace=True)
        t_members[m] = _fit(ensemble, x_obs[idx], t_obs[idx], _seed(seed, batch, 200 + m)).predict(
            x_cand
        )
        e_members[m] = _fit(ensemble, x_obs[idx], e_obs[idx], _seed(seed, batch, 300 + m)).predict(
            x_cand
        )
    t_span = float(np.ptp(t_obs)) or 1.0  # a zero range normalises to 0, as in _normalise
    e_span = float(np.ptp(e_obs)) or 1.0
    sigma = t_members.std(axis=0) / t_span + e_members.std(axis=0) / e_span
    return _Predictions(time_s=t_pred, dynamic_energy_j=e_pred, sigma=sigma)


# --------------------------------------------------------------------------------------------
# Batch selection
# --------------------------------------------------------------------------------------------


def _pass_counts(k: int, shares: Sequence[float]) -> list[int]:
    """Picks per pass: rounded shares; the last pass takes the rest when shares add up to 1."""
    counts = [int(math.floor(s * k + 0.5)) for s in shares]
    if math.isclose(math.fsum(shares), 1.0, abs_tol=1e-9):
        counts[-1] = max(0, k - sum(counts[:-1]))
    while sum(counts) > k:  # rounding overshoot: trim from the end
        j = max(i for i, c in enumerate(counts) if c > 0)
        counts[j] -= 1
    return counts


@dataclass(slots=True)
class _Pick:
    index: int
    source: str


def _select_batch(
    k: int,
    passes: Sequence[str],
    shares: Sequence[float],
    obs_total: np.ndarray,
    obs_dynamic: np.ndarray,
    pred_total: np.ndarray,
    pred_dynamic: np.ndarray,
    pred_time: np.ndarray,
    sigma: np.ndarray,
) -> list[_Pick]:
    """Choose ``k`` candidate rows (all arrays normalised; rows = unevaluated configurations).

    Args:
        k: Batch size (at most the number of candidates).
        passes: Pass names in order.
        shares: Share of the batch of each pass.
        obs_total: ``(m, 2)`` observed (T, E_total), normalised.
        obs_dynamic: ``(m, 2)`` observed (T, E_dyn), normalised.
        pred_total: ``(n, 2)`` predicted (T, E_total), normalised.
        pred_dynamic: ``(n, 2)`` predicted (T, E_dyn), normalised.
        pred_time: ``(n,)`` predicted time (any monotone scale).
        sigma: ``(n,)`` ensemble uncertainty.
    """
    n = pred_total.shape[0]
    k = min(k, n)
    free = np.ones(n, dtype=bool)
    fronts = {"total": _front_2d(obs_total), "dynamic": _front_2d(obs_dynamic)}
    preds = {"total": pred_total, "dynamic": pred_dynamic}
    picks: list[_Pick] = []

    def take(i: int, source: str) -> None:
        free[i] = False
        picks.append(_Pick(int(i), source))
        for plane in fronts:  # believer update: the pick's prediction joins both fronts
            fronts[plane] = _front_2d(np.vstack([fronts[plane], preds[plane][i : i + 1]]))

    for name, count in zip(passes, _pass_counts(k, shares)):
        count = min(count, k - len(picks))
        if name in ("total", "dynamic"):
            for _ in range(count):
                score = np.where(free, _hvi_2d(fronts[name], preds[name], REF_FACTOR), 0.0)
                best = int(np.argmax(score))
                if score[best] <= 0.0:
                    break
                take(best, name)
        else:
            key = pred_time if name == "fastest" else -sigma
            order = np.argsort(key, kind="stable")
            for i in order[free[order]][:count]:
                take(int(i), name)
    while len(picks) < k:  # shortfall: best of the two HVI scores, then nearest the front
        hvi = np.maximum(
            _hvi_2d(fronts["total"], pred_total, REF_FACTOR),
            _hvi_2d(fronts["dynamic"], pred_dynamic, REF_FACTOR),
        )
        gap = np.minimum(
            _gap_2d(fronts["total"], pred_total), _gap_2d(fronts["dynamic"], pred_dynamic)
        )
        order = np.lexsort((gap, -hvi))
        take(int(order[free[order]][0]), "fill")
    return picks


# --------------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------------


def _check_settings(
    budget: Budget,
    passes: Sequence[str],
    shares: Sequence[float],
    plateau: tuple[int, float] | None,
) -> None:
    if budget.n_init < 1 or budget.batches < 0 or budget.batch_size < 1:
        raise PlanError(f"budget needs n_init ≥ 1, batches ≥ 0, batch_size ≥ 1, got {budget}")
    if not passes or len(passes) != len(shares):
        raise PlanError(f"give one share per pass, got passes {passes} and shares {shares}")
    unknown = [p for p in passes if p not in PASSES]
    if unknown or len(set(passes)) != len(passes):
        raise PlanError(f"passes must be distinct names from {', '.join(PASSES)}, got {passes}")
    if any(not (math.isfinite(s) and s >= 0) for s in shares) or math.fsum(shares) > 1 + 1e-9:
        raise PlanError(f"shares must be non-negative and add up to at most 1, got {shares}")
    if plateau is not None:
        window, eps = plateau
        if not isinstance(window, int) or window < 1 or not (math.isfinite(eps) and eps >= 0):
            raise PlanError(f"plateau must be (batches ≥ 1, ε ≥ 0), got {plateau}")


def _space_index(ptype: PartitionType, space: Sequence[Config]) -> dict[Config, int]:
    if not space:
        raise PlanError(f"the configuration space of {ptype.key!r} is empty")
    allowed = set(ptype.slots) | {None}
    index: dict[Config, int] = {}
    for c in space:
        if c in index:
            raise PlanError(f"configuration {c!r} appears twice in the space of {ptype.key!r}")
        if c.slot not in allowed:
            raise PlanError(
                f"configuration {c!r} launches in slot {c.slot!r}, which {ptype.key!r} lacks "
                f"(slots: {', '.join(ptype.slots)})"
            )
        index[c] = len(index)
    return index


def _measure(evaluator: Evaluator, ptype: PartitionType, config: Config) -> Measurement:
    m = evaluator.evaluate(ptype, config)
    for name in ("time_s", "energy_j", "dynamic_energy_j", "wall_s"):
        value = getattr(m, name)
        if not math.isfinite(value):
            raise PlanError(f"the evaluator returned {name}={value!r} for {config} of {ptype.key}")
    if m.time_s <= 0:
        raise PlanError(f"the evaluator returned time_s={m.time_s!r} for {config} of {ptype.key}")
    return m


@dataclass(slots=True)
class _Run:
    """Mutable state of one search: the data so far and where measurements go."""

    ptype: PartitionType
    configs: list[Config]
    evaluator: Evaluator
    log: _Log
    progress: ProgressFn | None
    total: int
    records: list[EvaluationRecord] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)

    def measure(
        self, row: int, source: str, batch: int, pred: tuple[float, float, float] | None
    ) -> None:
        config = self.configs[row]
        logged = self.log.take(config)
        if logged is not None:
            record = EvaluationRecord(
                config=config,
                time_s=logged.time_s,
                energy_j=logged.energy_j,
                dynamic_energy_j=logged.dynamic_energy_j,
                source=source,
                batch=batch,
                wall_s=logged.wall_s,
                predicted_time_s=None if pred is None else pred[0],
                predicted_dynamic_energy_j=None if pred is None else pred[1],
                predicted_energy_j=None if pred is None else pred[2],
            )
            note = "from the log"
        else:
            m = _measure(self.evaluator, self.ptype, config)
            record = EvaluationRecord(
                config=config,
                time_s=float(m.time_s),
                energy_j=float(m.energy_j),
                dynamic_energy_j=float(m.dynamic_energy_j),
                source=source,
                batch=batch,
                wall_s=float(m.wall_s),
                predicted_time_s=None if pred is None else pred[0],
                predicted_dynamic_energy_j=None if pred is None else pred[1],
                predicted_energy_j=None if pred is None else pred[2],
            )
            self.log.append(record)
            note = "measured"
        self.records.append(record)
        self.rows.append(row)
        if self.progress is not None:
            stage = "initial sample" if batch == 0 else f"batch {batch} ({source})"
            self.progress(
                len(self.records), self.total, f"{self.ptype.key}: {stage}, {config} {note}"
            )

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        t = np.array([r.time_s for r in self.records])
        e = np.array([r.energy_j for r in self.records])
        ed = np.array([r.dynamic_energy_j for r in self.records])
        return t, e, ed


def _front_hv(t: np.ndarray, e: np.ndarray, upto: int, lo: np.ndarray, hi: np.ndarray) -> float:
    pts = _normalise(np.column_stack([t[:upto], e[:upto]]), lo, hi)
    return hypervolume(pts, REF_FACTOR)


def search_partition(
    ptype: PartitionType,
    space: Sequence[Config],
    evaluator: Evaluator,
    *,
    budget: Budget | None = None,
    seed: int = 0,
    log_path: str | Path | None = None,
    progress: ProgressFn | None = None,
    passes: Sequence[str] = PASSES,
    shares: Sequence[float] = (0.4, 0.2, 0.2, 0.2),
    plateau: tuple[int, float] | None = (2, 1e-3),
) -> SearchResult:
    """Search one partition type's configurations for its time–energy Pareto set.

    Args:
        ptype: The partition type.
        space: Its candidate configurations (:func:`~powerlib.planning.kareus.partition.config_space`).
        evaluator: Measures one configuration (thermally stable protocol).
        budget: Initial sample, batches and batch size; default
            :func:`~powerlib.planning.kareus.partition.search_budget` of ``ptype``
            (36/3/16, 48/4/16 or 96/4/32 by size class).
        seed: Seeds the initial sample, the bootstrap resamples and the surrogates.
        log_path: JSON Lines evaluation log; replayed if it exists (see the module docstring),
            appended to with a flush after each measurement.
        progress: ``progress(done, total, message)`` after each evaluation; ``total`` is the
            most evaluations the budget allows.
        passes: Acquisition passes in order (names from :data:`PASSES`); a subset runs a
            single- or fewer-pass variant (target T2).
        shares: Share of each batch per pass. When they add up to 1 the last pass takes what
            rounding leaves; any shortfall is filled from the best HVI score (source ``fill``).
        plateau: ``(R, ε)`` of the HV-plateau rule, or None to always run every batch.

    Returns:
        Every evaluation with its source and predictions, the HV history and why it stopped.

    Raises:
        PlanError: On missing dependencies, an invalid space, budget or settings, a malformed or
            foreign log, a log written with other settings, or non-finite measurements.
            Exceptions from the evaluator propagate unchanged; every measurement taken before
            is already in the log, so rerunning with the same log resumes.
    """
    ensemble = _sklearn_ensemble()
    _moocore()
    budget = search_budget(ptype) if budget is None else budget
    passes = tuple(passes)
    shares = tuple(float(s) for s in shares)
    _check_settings(budget, passes, shares, plateau)
    index = _space_index(ptype, space)
    configs = list(index)
    n = len(configs)
    p_static = float(evaluator.p_static_w)
    if not math.isfinite(p_static):
        raise PlanError(f"the evaluator's p_static_w must be finite, got {p_static!r}")
    header = {
        "schema": LOG_SCHEMA,
        "partition": ptype.key,
        "space_size": n,
        "p_static_w": p_static,
        "seed": seed,
        "budget": [budget.n_init, budget.batches, budget.batch_size],
        "passes": list(passes),
        "shares": list(shares),
        "created_unix_s": time.time(),
    }
    log = _Log(None if log_path is None else Path(log_path), ptype.key, header)
    try:
        log.check_space(index)
        run = _Run(
            ptype=ptype,
            configs=configs,
            evaluator=evaluator,
            log=log,
            progress=progress,
            total=min(budget.total, n),
        )
        return _search(run, ensemble, budget, seed, p_static, passes, shares, plateau)
    finally:
        log.close()


def _search(
    run: _Run,
    ensemble: ModuleType,
    budget: Budget,
    seed: int,
    p_static: float,
    passes: tuple[str, ...],
    shares: tuple[float, ...],
    plateau: tuple[int, float] | None,
) -> SearchResult:
    n = len(run.configs)
    x_all = _encode(run.configs)
    rng = np.random.default_rng(_seed(seed, 0xA11CE))
    for row in rng.choice(n, size=min(budget.n_init, n), replace=False):
        run.measure(int(row), "init", 0, None)

    t, e, ed = run.arrays()
    lo, hi = np.array([t.min(), e.min()]), np.array([t.max(), e.max()])
    hv_history = [_front_hv(t, e, len(t), lo, hi)]
    gains: list[float] = []
    stopped = "budget"
    for batch in range(1, budget.batches + 1):
        evaluated = np.zeros(n, dtype=bool)
        evaluated[run.rows] = True
        cand = np.flatnonzero(~evaluated)
        if cand.size == 0:
            stopped = "exhausted"
            break
        t, e, ed = run.arrays()
        x_obs = x_all[run.rows]
        pred = _predict(ensemble, x_obs, t, ed, x_all[cand], seed, batch)
        pred_e = pred.dynamic_energy_j + p_static * pred.time_s
        lo_t, hi_t = np.array([t.min(), e.min()]), np.array([t.max(), e.max()])
        lo_d, hi_d = np.array([t.min(), ed.min()]), np.array([t.max(), ed.max()])
        picks = _select_batch(
            budget.batch_size,
            passes,
            shares,
            _normalise(np.column_stack([t, e]), lo_t, hi_t),
            _normalise(np.column_stack([t, ed]), lo_d, hi_d),
            _normalise(np.column_stack([pred.time_s, pred_e]), lo_t, hi_t),
            _normalise(np.column_stack([pred.time_s, pred.dynamic_energy_j]), lo_d, hi_d),
            pred.time_s,
            pred.sigma,
        )
        before = len(run.records)
        for pick in picks:
            i = pick.index
            run.measure(
                int(cand[i]),
                pick.source,
                batch,
                (float(pred.time_s[i]), float(pred.dynamic_energy_j[i]), float(pred_e[i])),
            )
        t, e, _ = run.arrays()
        lo, hi = np.array([t.min(), e.min()]), np.array([t.max(), e.max()])
        hv_after = _front_hv(t, e, len(t), lo, hi)
        hv_before = _front_hv(t, e, before, lo, hi)
        gains.append((hv_after - hv_before) / hv_before if hv_before > 0 else math.inf)
        hv_history.append(hv_after)
        if plateau is not None:
            window, eps = plateau
            if len(gains) >= window and math.fsum(gains[-window:]) / window < eps:
                stopped = "plateau"
                break
    if stopped == "budget" and len(run.records) >= n:
        stopped = "exhausted"
    if len(run.log.used) < len(run.log.records):
        raise PlanError(run.log.divergence())
    return SearchResult(
        key=run.ptype.key,
        budget=budget,
        seed=seed,
        p_static_w=p_static,
        evaluations=tuple(run.records),
        hv_history=tuple(hv_history),
        hv_gains=tuple(gains),
        stopped=stopped,
    )
