"""Kareus's per-partition search: multi-pass multi-objective Bayesian optimisation (docs/kareus.md §2.1).

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
(depth 6, learning rate 0.3, 100 rounds, row subsample 0.8, column subsample 0.8). Why these
settings and the believer batch were kept (relative hypervolume and Pareto recovery against the
variants tried, on the synthetic landscape of ``tests/kareus/test_search.py``) is
measured in benchmarks/results/kareus_search_quality.md, with the command that reproduces it.
Inputs:
frequency in MHz, the index of the SM count in the space's sorted SM counts, and a one-hot
launch slot, where "no overlap" (``slot=None``) is a category of its own.

Resumable log (:mod:`powerlib.kareus.evaluation_log`). With ``log_path`` every measurement is
appended as one JSON line and flushed as it is taken (a
:class:`~powerlib.kareus.evaluation_log.LogHeader` line first). Rerunning with the same log replays
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

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np

from powerlib.errors import PlanError
from powerlib.kareus.evaluation_log import (
    PASSES,
    SOURCES,
    EvaluationRecord,
    LogHeader,
    _Log,
)
from powerlib.kareus.evaluator import Evaluator, Measurement
from powerlib.kareus.hypervolume import (
    REF_FACTOR,
    _moocore,
    _normalise,
    hypervolume,
)
from powerlib.kareus.partition import Budget, search_budget
from powerlib.kareus.partition_types import Config, PartitionType
from powerlib.kareus.surrogate import (
    _encode,
    _predict,
    _seed,
    _select_batch,
    _sklearn_ensemble,
)

__all__ = ["SearchResult", "search_partition"]

ProgressFn = Callable[[int, int, str], None]


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
        space: Its candidate configurations (:func:`~powerlib.kareus.partition.config_space`).
        evaluator: Measures one configuration (thermally stable protocol).
        budget: Initial sample, batches and batch size; default
            :func:`~powerlib.kareus.partition.search_budget` of ``ptype``
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
    header = LogHeader(
        partition=ptype.key,
        space_size=n,
        p_static_w=p_static,
        seed=seed,
        budget=(budget.n_init, budget.batches, budget.batch_size),
        passes=passes,
        shares=shares,
        created_unix_s=time.time(),
    )
    log = _Log(None if log_path is None else Path(log_path), header)
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
