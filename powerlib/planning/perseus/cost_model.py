"""Per-(stage, kind) cost curves: from profiled frequency options to a convex effective-energy curve.

Perseus plans on *effective* energy ``ẽ = e - P_block·q·τ``: the energy a computation draws beyond
what the GPU would have drawn anyway while blocked for the same (quantized) time. Each profiled
(stage, instruction) pair becomes one cost curve in three steps (reference §2.1):

1. :func:`~powerlib.planning.perseus.frequency_options.prepare_options` turns the measured
   ``(frequency, time, energy)`` points into the Pareto-optimal, floor-quantized,
   de-duplicated options, sorted fastest first.
2. :func:`build_cost_model` fits a convex, non-increasing curve over the integer durations
   ``[q_min, q_max]`` (in units of the time quantum τ): the exponential ``a·exp(b·q) + c`` of
   lowtime/Perseus (:func:`fit_exponential`), or the non-parametric lower convex hull
   (:class:`ConvexHullCostModel`).
3. After solving, :func:`~powerlib.planning.perseus.frequency_options.frequency_for` maps a planned
   duration back to a measured option: the slowest one whose quantized time still fits.

Steps 1 and 3 live in :mod:`powerlib.planning.perseus.frequency_options` (their names are re-exported
here). :class:`TableCostModel` wraps an explicit ``{duration: cost}`` table, for hand-made test
cases.

Pure code: standard library and numpy only, no device I/O.
"""

from __future__ import annotations

import bisect
import logging
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from powerlib.errors import PlanError
from powerlib.planning.names import COST_MODELS
from powerlib.planning.perseus.frequency_options import (
    Option,
    check_finite,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ConvexHullCostModel",
    "CostModel",
    "ExponentialCostModel",
    "TableCostModel",
    "build_cost_model",
    "fit_exponential",
]

_B0_PER_MS = (0.01, 0.02, 0.03, 0.04, 0.05, 0.1)
"""lowtime's initial guesses for ``-b`` at τ = 1 ms; they scale with τ (reference §2.1 step 5)."""

_U_MIN = 1e-4
"""Smallest ``|b|·(q_max - q_min)`` searched: below it the curve is a straight line to ~1e-8."""

_U_MAX = 700.0
"""Largest ``|b|·(q_max - q_min)`` searched: beyond it ``exp`` underflows over the whole span."""

_SCAN_POINTS = 481
"""Log-spaced points of the global scan over ``|b|·(q_max - q_min)`` in ``[_U_MIN, _U_MAX]``."""


# --------------------------------------------------------------------------------------------
# Cost models
# --------------------------------------------------------------------------------------------


@runtime_checkable
class CostModel(Protocol):
    """A convex, non-increasing effective-energy cost over integer durations ``[q_min, q_max]``.

    ``q_min`` and ``q_max`` may be plain attributes or read-only properties.
    """

    @property
    def q_min(self) -> int:
        """Shortest allowed duration, in time quanta."""
        ...

    @property
    def q_max(self) -> int:
        """Longest allowed duration, in time quanta."""
        ...

    def cost(self, q: int) -> float:
        """Effective energy (J) at integer duration ``q`` in ``[q_min, q_max]``."""
        ...


def _check_domain(q: int, q_min: int, q_max: int) -> int:
    qi = operator.index(q)
    if not q_min <= qi <= q_max:
        raise PlanError(f"duration {qi} is outside the cost model's domain [{q_min}, {q_max}]")
    return qi


@dataclass(frozen=True, slots=True, kw_only=True)
class ExponentialCostModel:
    """The lowtime/Perseus curve ``cost(q) = a·exp(b·q) + c`` on ``[q_min, q_max]``.

    With ``a >= 0`` and ``b <= 0`` it is convex and non-increasing in ``q``.

    Attributes:
        a: Scale (J), non-negative.
        b: Rate per time quantum, non-positive.
        c: Offset (J).
        q_min: Shortest allowed duration, in time quanta.
        q_max: Longest allowed duration, in time quanta.
        mse: Mean squared error (J²) of the fit over the options it was fitted to; NaN when
            the model was built by hand.
    """

    a: float
    b: float
    c: float
    q_min: int
    q_max: int
    mse: float = math.nan

    def __post_init__(self) -> None:
        for name in ("a", "b", "c"):
            check_finite(name, getattr(self, name))
        if self.a < 0.0 or self.b > 0.0:
            raise PlanError(
                f"an exponential cost needs a >= 0 and b <= 0 to be convex and non-increasing, "
                f"got a={self.a!r}, b={self.b!r}"
            )
        if operator.index(self.q_min) > operator.index(self.q_max):
            raise PlanError(f"empty duration range [{self.q_min}, {self.q_max}]")

    def cost(self, q: int) -> float:
        """Effective energy (J) at integer duration ``q`` in ``[q_min, q_max]``.

        Raises:
            PlanError: If ``q`` is outside ``[q_min, q_max]``.
        """
        qi = _check_domain(q, self.q_min, self.q_max)
        return self.a * math.exp(self.b * qi) + self.c


class _PiecewiseLinear:
    """Shared evaluation of a convex piecewise-linear curve through integer-abscissa vertices."""

    __slots__ = ("_xs", "_ys", "q_max", "q_min", "vertices")

    q_min: int
    q_max: int
    vertices: tuple[tuple[int, float], ...]

    def _set_vertices(self, vertices: Sequence[tuple[int, float]]) -> None:
        self.vertices = tuple(vertices)
        self._xs = [x for x, _ in self.vertices]
        self._ys = [y for _, y in self.vertices]
        self.q_min = self._xs[0]
        self.q_max = self._xs[-1]

    def cost(self, q: int) -> float:
        """Effective energy (J) at integer duration ``q`` in ``[q_min, q_max]``.

        Exact at the vertices, linear in between.

        Raises:
            PlanError: If ``q`` is outside ``[q_min, q_max]``.
        """
        qi = _check_domain(q, self.q_min, self.q_max)
        k = bisect.bisect_left(self._xs, qi)
        if self._xs[k] == qi:
            return self._ys[k]
        x0, x1 = self._xs[k - 1], self._xs[k]
        y0, y1 = self._ys[k - 1], self._ys[k]
        return y0 + (y1 - y0) * ((qi - x0) / (x1 - x0))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vertices={self.vertices!r})"


def _cross(o: tuple[int, float], a: tuple[int, float], b: tuple[int, float]) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


class ConvexHullCostModel(_PiecewiseLinear):
    """Non-parametric cost: the lower convex hull of the measured ``(quant, eff_energy)`` points.

    Linear between hull vertices, exact at them, and never above a measured point. The hull is
    cut at its lowest vertex so the curve is non-increasing: options slower than that are
    dominated in (time, effective energy) and the solver never needs them (only the soft
    Pareto fallback can leave such options).

    Attributes:
        vertices: The hull vertices ``(quant, cost)``, sorted by ``quant``.
        q_min: Smallest vertex ``quant``.
        q_max: Largest vertex ``quant`` (the lowest-cost vertex).
    """

    __slots__ = ()

    def __init__(self, points: Sequence[tuple[int, float]]) -> None:
        """Build the hull of ``(duration, cost)`` points.

        Args:
            points: At least one ``(integer duration, finite cost)`` pair; with several
                points at one duration the lowest cost counts.

        Raises:
            PlanError: On an empty input, non-integer durations or non-finite costs.
        """
        lowest: dict[int, float] = {}
        for k, (x_raw, y_raw) in enumerate(points):
            x = operator.index(x_raw)
            y = check_finite(f"point {k} cost", y_raw)
            if x not in lowest or y < lowest[x]:
                lowest[x] = y
        if not lowest:
            raise PlanError("a convex-hull cost model needs at least one point")
        hull: list[tuple[int, float]] = []
        for p in sorted(lowest.items()):
            while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0.0:
                hull.pop()
            hull.append(p)
        lowest_k = min(range(len(hull)), key=lambda k: (hull[k][1], -k))
        self._set_vertices(hull[: lowest_k + 1])

    @classmethod
    def from_options(cls, options: Sequence[Option]) -> ConvexHullCostModel:
        """The hull of the options' ``(quant, eff_energy_j)`` points.

        Raises:
            PlanError: If ``options`` is empty.
        """
        return cls([(o.quant, o.eff_energy_j) for o in options])


class TableCostModel(_PiecewiseLinear):
    """An explicit ``{duration: cost}`` table, e.g. for hand-made solver test cases.

    Durations between table keys, if any, are interpolated linearly.

    Attributes:
        vertices: The table as sorted ``(duration, cost)`` pairs.
        q_min: Smallest duration in the table.
        q_max: Largest duration in the table.
    """

    __slots__ = ()

    def __init__(self, table: Mapping[int, float]) -> None:
        """Check and wrap a cost table.

        Args:
            table: Non-negative integer durations mapped to finite costs; at least one entry.
                The costs must be convex and non-increasing in the duration (up to a relative
                rounding tolerance of 1e-9).

        Raises:
            PlanError: If the table is empty, malformed, non-convex or increasing somewhere.
        """
        items: list[tuple[int, float]] = []
        for x_raw, y_raw in table.items():
            try:
                x = operator.index(x_raw)
            except TypeError as err:
                raise PlanError(f"table durations must be integers, got {x_raw!r}") from err
            if x < 0:
                raise PlanError(f"table durations must be non-negative, got {x}")
            items.append((x, check_finite(f"cost at duration {x}", y_raw)))
        if not items:
            raise PlanError("a cost table needs at least one entry")
        items.sort()
        scale = max(1.0, max(abs(y) for _, y in items))
        tol = 1e-9 * scale
        slopes = [(y1 - y0) / (x1 - x0) for (x0, y0), (x1, y1) in zip(items, items[1:])]
        for (x, _), s in zip(items[1:], slopes):
            if s > tol:
                raise PlanError(
                    f"cost table increases at duration {x} (slope {s:g}); costs must be "
                    "non-increasing in the duration"
                )
        for (x, _), s0, s1 in zip(items[1:], slopes, slopes[1:]):
            if s1 < s0 - tol:
                raise PlanError(
                    f"cost table is not convex at duration {x}: slope {s0:g} before it, "
                    f"{s1:g} after it"
                )
        self._set_vertices(items)


# --------------------------------------------------------------------------------------------
# Exponential fit
# --------------------------------------------------------------------------------------------


def _linear_part(phi: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares ``A``, ``C`` of ``y ≈ A·phi + C`` per row of ``phi``, with ``A >= 0``.

    ``phi`` has shape ``(..., n)``; ``y`` shape ``(n,)``. Where the unconstrained ``A`` is
    negative (or ``phi`` is constant) the constrained optimum is ``A = 0``, ``C = mean(y)``.
    """
    phi_mean = phi.mean(axis=-1, keepdims=True)
    dphi = phi - phi_mean
    dy = y - y.mean()
    s_pp = np.einsum("...i,...i->...", dphi, dphi)
    s_py = np.einsum("...i,i->...", dphi, dy)
    with np.errstate(divide="ignore", invalid="ignore"):
        amp = np.where(s_pp > 0.0, s_py / s_pp, 0.0)
    amp = np.where(np.isfinite(amp) & (amp > 0.0), amp, 0.0)
    off = y.mean() - amp * phi_mean[..., 0]
    return amp, off


def _rss(u: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Residual sum of squares of the best ``A·exp(-u·x) + C`` for each rate ``u`` (> 0)."""
    with np.errstate(under="ignore", over="ignore"):
        phi = np.exp(-np.multiply.outer(u, x))
        amp, off = _linear_part(phi, y)
        r = y - amp[..., None] * phi - off[..., None]
    return np.asarray(np.einsum("...i,...i->...", r, r))


def _rss_scalar(u: float, x: Sequence[float], y: Sequence[float]) -> float:
    """:func:`_rss` of one rate, in plain floats.

    Brent's method asks one rate at a time, and a few dozen points cost less in Python than
    numpy's per-call overhead (about a third of a small plan's fits).
    """
    n = len(x)
    phi = [math.exp(-u * xi) for xi in x]
    p_mean = math.fsum(phi) / n
    y_mean = math.fsum(y) / n
    s_pp = math.fsum((p - p_mean) ** 2 for p in phi)
    s_py = math.fsum((p - p_mean) * (yi - y_mean) for p, yi in zip(phi, y))
    amp = s_py / s_pp if s_pp > 0.0 else 0.0
    if not (math.isfinite(amp) and amp > 0.0):
        amp = 0.0
    off = y_mean - amp * p_mean
    return math.fsum((yi - amp * p - off) ** 2 for p, yi in zip(phi, y))


def _brent_min(f: Callable[[float], float], lo: float, hi: float, tol: float) -> float:
    """Minimize a scalar function on ``[lo, hi]`` by Brent's golden-section/parabolic method."""
    golden = 0.5 * (3.0 - math.sqrt(5.0))
    x = w = v = lo + golden * (hi - lo)
    fx = fw = fv = f(x)
    d = e = 0.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        tol1 = tol * abs(x) + 1e-15
        tol2 = 2.0 * tol1
        if abs(x - mid) <= tol2 - 0.5 * (hi - lo):
            break
        use_golden = True
        if abs(e) > tol1:
            # Parabola through (x, fx), (w, fw), (v, fv).
            r = (x - w) * (fx - fv)
            q = (x - v) * (fx - fw)
            p = (x - v) * q - (x - w) * r
            q = 2.0 * (q - r)
            if q > 0.0:
                p = -p
            q = abs(q)
            if abs(p) < abs(0.5 * q * e) and q * (lo - x) < p < q * (hi - x):
                e, d = d, p / q
                u = x + d
                if u - lo < tol2 or hi - u < tol2:
                    d = tol1 if mid >= x else -tol1
                use_golden = False
        if use_golden:
            e = (hi - x) if x < mid else (lo - x)
            d = golden * e
        u = x + (d if abs(d) >= tol1 else math.copysign(tol1, d))
        fu = f(u)
        if fu <= fx:
            if u < x:
                hi = x
            else:
                lo = x
            v, fv, w, fw, x, fx = w, fw, x, fx, u, fu
        else:
            if u < x:
                lo = u
            else:
                hi = u
            if fu <= fw or w == x:
                v, fv, w, fw = w, fw, u, fu
            elif fu <= fv or v in (x, w):
                v, fv = u, fu
    return x


def _polish(
    x: np.ndarray, y: np.ndarray, amp: float, u: float, off: float
) -> tuple[float, float, float]:
    """Levenberg-Marquardt steps on ``(A, u, C)`` of ``A·exp(-u·x) + C`` from a good start.

    Steps that would leave ``A >= 0``, ``u > 0`` or fail to lower the squared error are
    refused; the start is returned unchanged if no step helps.
    """

    def residual(p: np.ndarray) -> np.ndarray:
        with np.errstate(under="ignore"):
            return np.asarray(y - p[0] * np.exp(-p[1] * x) - p[2])

    p = np.array([amp, u, off])
    r = residual(p)
    rss = float(r @ r)
    lam = 1e-6
    for _ in range(30):
        with np.errstate(under="ignore"):
            phi = np.exp(-p[1] * x)
        jac = np.column_stack((phi, -p[0] * x * phi, np.ones_like(x)))
        scale = np.sqrt(np.einsum("ij,ij->j", jac, jac))
        if not np.all(scale > 0.0):
            break
        js = jac / scale
        jtj = js.T @ js
        jtr = js.T @ r
        improved = False
        while lam < 1e12:
            try:
                step = np.linalg.solve(jtj + lam * np.eye(3), jtr) / scale
            except np.linalg.LinAlgError:
                lam *= 10.0
                continue
            cand = p + step
            if cand[0] >= 0.0 and cand[1] > 0.0:
                rc = residual(cand)
                rss_c = float(rc @ rc)
                if rss_c <= rss:
                    small = np.all(np.abs(step) <= 1e-15 * np.maximum(np.abs(p), 1e-300))
                    p, r, rss = cand, rc, rss_c
                    lam = max(lam / 10.0, 1e-12)
                    improved = not small
                    break
            lam *= 10.0
        if not improved:
            break
    return float(p[0]), float(p[1]), float(p[2])


def _best_rate(x: np.ndarray, ys: np.ndarray, seeds: np.ndarray) -> float:
    """The scaled rate ``u`` of the least-squares ``A·exp(-u·x) + C`` through ``(x, ys)``.

    Scanned on a log grid (plus lowtime's starting rates ``seeds``), then refined by Brent's
    method between the best grid point's neighbours.
    """
    grid = np.concatenate((np.geomspace(_U_MIN, _U_MAX, _SCAN_POINTS), seeds))
    grid = np.array(sorted(set(grid[(grid >= _U_MIN) & (grid <= _U_MAX)].tolist())))
    rss = _rss(grid, x, ys)
    k = int(np.argmin(rss))
    lo = math.log(grid[max(k - 1, 0)])
    hi = math.log(grid[min(k + 1, grid.size - 1)])

    xs, yl = x.tolist(), ys.tolist()

    def objective(log_u: float) -> float:
        return _rss_scalar(math.exp(log_u), xs, yl)

    return math.exp(_brent_min(objective, lo, hi, 1e-12))


def fit_exponential(options: Sequence[Option], *, unit_time_s: float) -> ExponentialCostModel:
    """Least-squares fit of ``eff_energy ≈ a·exp(b·quant) + c`` over the options.

    This reproduces lowtime's ``ExponentialModel`` with the "best" search strategy: scipy's
    Levenberg-Marquardt started from ``a0 ∈ {10, 100, 1000}``,
    ``b0 ∈ -{0.01, 0.02, 0.03, 0.04, 0.05, 0.1}·(unit_time_s / 1 ms)``,
    ``c0 ∈ {10, 100, 1000}``, rejecting ``a < 0`` and failed fits and keeping the lowest mean
    squared error. That amounts to the least-squares optimum with ``a >= 0``, which is computed
    here directly, without scipy, by variable projection:

    * for a fixed rate ``b`` the best ``a >= 0`` and ``c`` are a closed-form linear solve, so
      the squared error is a function of ``b`` alone;
    * it is scanned on a log grid of ``|b|·(q_max - q_min)`` from 1e-4 to 700 (plus lowtime's
      starting rates), refined by Brent's method around the best grid point, and the three
      parameters are then polished together by a few damped Gauss-Newton steps.

    The rate is restricted to ``b < 0`` so that the curve is non-increasing; on decreasing data
    (every strict Pareto frontier) the optimum lies there anyway. With only two distinct
    durations every rate fits exactly; lowtime's first starting rate ``-0.01·(τ / 1 ms)`` is
    used then.

    Args:
        options: The options of one (stage, instruction) from :func:`prepare_options`; at least
            two distinct ``quant`` values.
        unit_time_s: The time quantum τ the options were quantized with, in seconds (it only
            scales lowtime's starting rates).

    Returns:
        The fitted model on ``[min quant, max quant]``, with its mean squared error.

    Raises:
        PlanError: If there are fewer than two distinct durations, or the fit is not finite.
    """
    tau = check_finite("unit_time_s", unit_time_s)
    if tau <= 0.0:
        raise PlanError(f"unit_time_s must be positive, got {unit_time_s!r}")
    qs = np.array([float(o.quant) for o in options])
    ys = np.array([check_finite("eff_energy_j", o.eff_energy_j) for o in options])
    # set(), not np.unique: np.unique's first call imports numpy.ma (15 ms of a small plan)
    n_distinct = len(set(qs.tolist()))
    if n_distinct < 2:
        raise PlanError(
            "an exponential cost model needs options with at least two distinct durations"
        )
    q_min, q_max = int(qs.min()), int(qs.max())
    span = float(q_max - q_min)
    x = (qs - q_min) / span  # in [0, 1]: the fit in scaled form is A·exp(-u·x) + C
    seeds = np.array(_B0_PER_MS) * (tau / 1e-3) * span
    u = float(seeds[0]) if n_distinct == 2 else _best_rate(x, ys, seeds)
    amp_arr, off_arr = _linear_part(np.exp(-u * x), ys)
    amp, off = float(amp_arr), float(off_arr)
    if amp > 0.0 and n_distinct > 2:
        amp, u, off = _polish(x, ys, amp, u, off)

    b = -u / span
    log_a = math.log(amp) - b * q_min if amp > 0.0 else -math.inf
    a = math.exp(log_a) if log_a < 709.0 else math.inf  # a·exp(b·q) = A·exp(b·(q - q_min))
    if not (math.isfinite(a) and math.isfinite(b) and math.isfinite(off)):
        raise PlanError(
            f"the exponential fit over durations [{q_min}, {q_max}] is not finite "
            f"(a={a!r}, b={b!r}, c={off!r}); use the convex-hull cost model instead"
        )
    model = ExponentialCostModel(a=a, b=b, c=off, q_min=q_min, q_max=q_max)
    pred = np.array([model.cost(int(q)) for q in qs])
    mse = float(np.mean((pred - ys) ** 2))
    return ExponentialCostModel(a=a, b=b, c=off, q_min=q_min, q_max=q_max, mse=mse)


def build_cost_model(
    options: Sequence[Option], *, kind: str = "exp", unit_time_s: float
) -> CostModel:
    """The cost model of one (stage, instruction) from its prepared options.

    Args:
        options: Options from :func:`prepare_options`.
        kind: ``"exp"`` for lowtime's exponential fit (:func:`fit_exponential`), ``"convex"``
            for the lower convex hull (:class:`ConvexHullCostModel`).
        unit_time_s: The time quantum τ, in seconds.

    With one option the model is that fixed duration; ``"exp"`` with two options, or with a fit
    that is not finite, falls back to the convex hull (exact at the measured points).

    Returns:
        A convex, non-increasing cost model over ``[q_min, q_max]``.

    Raises:
        PlanError: On an unknown ``kind`` or if the model cannot be built.
    """
    if len(options) == 1:  # one useful duration: a fixed-duration activity for the solver
        return ConvexHullCostModel.from_options(options)
    if kind == "exp":
        if len(options) == 2:  # three parameters, two points: the straight line through them
            return ConvexHullCostModel.from_options(options)
        try:
            return fit_exponential(options, unit_time_s=unit_time_s)
        except PlanError as err:
            # A degenerate fit (e.g. nearly collinear noisy points) must not sink the plan.
            logger.info("%s; using the convex hull of the measured points", err)
            return ConvexHullCostModel.from_options(options)
    if kind == "convex":
        return ConvexHullCostModel.from_options(options)
    raise PlanError(f"cost model kind must be one of {COST_MODELS}, got {kind!r}")
