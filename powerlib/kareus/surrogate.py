"""The Kareus search's surrogates and batch selection (acquisition passes).

Two gradient-boosted surrogates (time and dynamic energy) and a bootstrap ensemble of each
predict every unevaluated configuration; :func:`select_batch` picks a batch greedily in pass
order (see :mod:`powerlib.kareus.search`). scikit-learn is imported lazily.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

import numpy as np

from powerlib.errors import PlanError
from powerlib.kareus.hypervolume import (
    MISSING_DEPS,
    REF_FACTOR,
    _front_2d,
    _gap_2d,
    _hvi_2d,
)
from powerlib.kareus.partition_types import Config

__all__ = ["ENSEMBLE_FRACTION", "ENSEMBLE_SIZE"]

ENSEMBLE_SIZE = 5
ENSEMBLE_FRACTION = 0.8


def _sklearn_ensemble() -> ModuleType:
    try:
        # Import the parent first: a blocked ``sklearn`` must fail even when
        # ``sklearn.ensemble`` is still cached in sys.modules.
        import sklearn  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: PLC0415 - optional dependency, imported where used
        import sklearn.ensemble  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: PLC0415 - optional dependency, imported where used
    except ImportError as err:
        raise PlanError(MISSING_DEPS) from err
    return cast(ModuleType, sklearn.ensemble)


# --------------------------------------------------------------------------------------------
# Surrogates
# --------------------------------------------------------------------------------------------


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
