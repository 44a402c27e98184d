"""Hypervolume arithmetic of the Kareus search: moocore for reported figures, numpy for scoring.

Objectives are minimised. :func:`hypervolume` and :func:`relative_hypervolume` call
``moocore.hypervolume`` (imported lazily: ``pip install 'powerlib[kareus]'``); the 2-D helpers
score many candidates against one front in a single vectorised numpy operation.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any, cast

import numpy as np

from powerlib.errors import PlanError

__all__ = ["MISSING_DEPS", "REF_FACTOR", "hypervolume", "relative_hypervolume"]

REF_FACTOR = 1.1
"""Reference point in normalised space: 1.1 × the worst (normalised to 1)."""

MISSING_DEPS = "the Kareus search needs scikit-learn and moocore: pip install 'powerlib[kareus]'"
"""The install hint every missing optional dependency of the search raises."""


# --------------------------------------------------------------------------------------------
# The optional dependency
# --------------------------------------------------------------------------------------------


def _moocore() -> ModuleType:
    try:
        import moocore  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: PLC0415 - optional dependency, imported where used
    except ImportError as err:
        raise PlanError(MISSING_DEPS) from err
    return cast(ModuleType, moocore)


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
