"""Frontier points solved directly: one linear program per point, no walk.

The Phillips-Dessouky walk (:mod:`powerlib.planning.perseus.solver`) finds the minimum cost at
*every* makespan from ``T_max`` down to ``T_min``, one max flow per time quantum; a plan needs one
or two of those points. Each point is the optimum of a linear program over the same DAG and cost
tables (docs/perseus.md §2.6):

* one finish time ``F_v`` per activity and one makespan column ``T``;
* each activity's convex cost as unit segments ``x_vk ∈ [0, 1]``: crashing ``v`` from ``q`` to
  ``q - 1`` costs ``c_v(q - 1) - c_v(q)`` (non-decreasing as ``q`` falls, so the cheapest
  segments fill first and ``d_v = q_max,v - Σ_k x_vk`` has cost ``c_v(d_v)``);
* ``F_v - F_u + Σ_k x_vk ≥ q_max,v`` for every edge ``u -> v`` (``F_v + Σ_k x_vk ≥ q_max,v``
  where ``v`` has no predecessor), and ``F_v ≤ T`` where ``v`` has no successor;
* minimise ``Σ segment costs + w · T`` with ``T`` fixed (a deadline) or free in a range with ``w``
  the blocking energy per quantum (``T*``, the minimum total energy).

Every row has one ``+1`` and one ``-1`` on the time columns plus unit columns: the matrix is
totally unimodular, so with integer bounds the simplex vertex HiGHS returns is integral. That is
checked, never assumed: a solution farther than ``1e-6`` from an integer is an error, not rounded.
The solved durations are then checked against the DAG (critical path ≤ ``T``, every duration in
its range) and their cost is read from the cost tables, exactly as the walk reads it.

Equal costs leave an LP free to crash an activity for nothing; afterwards every activity is
lengthened into its slack while its cost does not rise (at a strictly decreasing cost that never
changes an optimum), so a plan never runs a clock faster than its cost asks for.

HiGHS comes from ``highspy`` (extra ``fast``). One model is built per DAG and re-solved from its
last basis when only ``T`` moves (a sweep of nearby points costs a fraction of a cold solve).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from powerlib.errors import BackendUnavailableError, PlanError
from powerlib.planning.perseus.solver import PhillipsDessouky

__all__ = [
    "DirectSolution",
    "DirectSolver",
    "check_durations",
    "direct_available",
    "into_slack",
    "lengthen_into_slack",
]

logger = logging.getLogger(__name__)

_INTEGRAL_TOL = 1e-6
_HIGHS: list[Any] = []


def _highspy() -> Any | None:
    """The ``highspy`` module (extra ``fast``), or None when it is not installed."""
    if not _HIGHS:
        try:
            import highspy  # noqa: PLC0415 - optional extra

            _HIGHS.append(highspy)
        except ImportError:
            _HIGHS.append(None)
    return _HIGHS[0]


def direct_available() -> bool:
    """Whether a direct solve can run here.

    The compiled min-cost flow (:mod:`powerlib.planning.perseus.flow`, built by the default
    install) or ``highspy`` (extra ``fast``).
    """
    from powerlib.planning.perseus import mincost  # noqa: PLC0415 - flow imports this module

    return mincost.available() or _highspy() is not None


@dataclass(frozen=True, slots=True)
class DirectSolution:
    """One solved point.

    Attributes:
        quant_time: The makespan bound ``T`` the point is for (time quanta).
        durations: Every activity's duration, in node order.
        cost: Σ activity cost at ``durations``, read from the cost tables.
        simplex_iterations: What the solve took (0 when nothing had to move).
    """

    quant_time: int
    durations: tuple[int, ...]
    cost: float
    simplex_iterations: int


class DirectSolver:
    """The linear program of a DAG of convex activities, solved at one makespan at a time.

    Args:
        walk: The Phillips-Dessouky solver of the same DAG and costs (its tables, order and
            critical-path method are shared; it is not run).
        time_cost_per_quantum: ``w``: the cost of one quantum of makespan in :meth:`cheapest`
            (``N · P_block · τ`` for the minimum-energy point).

    Raises:
        BackendUnavailableError: ``highspy`` is not installed.
    """

    def __init__(self, walk: PhillipsDessouky, *, time_cost_per_quantum: float = 0.0) -> None:
        highspy = _highspy()
        if highspy is None:
            raise BackendUnavailableError(
                "the direct plan solve needs HiGHS: pip install 'powerlib[fast]' (highspy)"
            )
        if not (math.isfinite(time_cost_per_quantum) and time_cost_per_quantum >= 0):
            raise PlanError(f"time cost must be >= 0, got {time_cost_per_quantum}")
        self._walk = walk
        self._w = float(time_cost_per_quantum)
        self.t_min = walk.fastest_makespan()
        self.t_max = walk.makespan([t.q_max for t in walk.tables])
        self._build(highspy)

    def _build(self, highspy: Any) -> None:
        walk = self._walk
        n = walk.num_nodes
        seg = _Segments.of(walk)
        rows = _Rows.of(walk)
        t_col = n
        seg_col0 = n + 1
        n_cols = seg_col0 + seg.count
        start, index, value = _colwise(rows, seg, t_col, seg_col0)
        q_max = np.array([t.q_max for t in walk.tables], dtype=float)
        n_sinks = len(rows.sinks)
        lp = highspy.HighsLp()
        lp.num_col_ = n_cols
        lp.num_row_ = rows.count
        inf = highspy.kHighsInf
        lp.col_cost_ = np.concatenate([np.zeros(n), [self._w], seg.cost])
        lp.col_lower_ = np.zeros(n_cols)
        lp.col_upper_ = np.concatenate([np.full(n, inf), [float(self.t_max)], np.ones(seg.count)])
        lp.row_lower_ = np.concatenate([q_max[rows.node], np.full(n_sinks, -inf)])
        lp.row_upper_ = np.concatenate([np.full(rows.num_prec, inf), np.zeros(n_sinks)])
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = start
        lp.a_matrix_.index_ = index
        lp.a_matrix_.value_ = value
        h = new_highs(highspy)
        h.setOptionValue("solver", "simplex")
        status = h.passModel(lp)
        if status == highspy.HighsStatus.kError:
            raise PlanError("internal error: HiGHS refused the plan's linear program")
        self._h = h
        self._hs = highspy
        self._t_col = t_col
        self._seg_col0 = seg_col0
        self._seg_start = seg.start
        self._seg_owner = np.repeat(np.arange(n), seg.spans)
        self._q_max = np.array([t.q_max for t in walk.tables], dtype=np.int64)
        self.num_columns = n_cols
        self.num_rows = rows.count

    # -- solves ----------------------------------------------------------------------------------

    def at(self, quant_time: int) -> DirectSolution:
        """The minimum-cost durations with makespan at most ``quant_time``.

        Raises:
            PlanError: ``quant_time`` below ``T_min``, or HiGHS failed or returned a fractional
                solution.
        """
        t = int(quant_time)
        if t < self.t_min:
            raise PlanError(f"makespan {t} is below the fastest possible {self.t_min}")
        return self._solve(t, t, cost=0.0)

    def cheapest(self, lo: int, hi: int) -> DirectSolution:
        """The point of minimum ``cost + w · T`` over makespans ``T`` in ``[lo, hi]``.

        Raises:
            PlanError: An empty range, or HiGHS failed or returned a fractional solution.
        """
        lo, hi = max(int(lo), self.t_min), int(hi)
        if hi < lo:
            raise PlanError(f"no makespan in [{lo}, {hi}] (the fastest possible is {self.t_min})")
        return self._solve(lo, hi, cost=self._w)

    def _solve(self, lo: int, hi: int, *, cost: float) -> DirectSolution:
        h, hs = self._h, self._hs
        h.changeColCost(self._t_col, cost)
        h.changeColBounds(self._t_col, float(lo), float(hi))
        h.run()
        status = h.getModelStatus()
        if status != hs.HighsModelStatus.kOptimal:
            raise PlanError(
                f"the direct plan solve failed at makespan [{lo}, {hi}]: HiGHS says "
                f"{h.modelStatusToString(status)}"
            )
        x = np.asarray(h.getSolution().col_value)
        seg = x[self._seg_col0 :]
        t_val = float(x[self._t_col])
        worst = float(np.max(np.abs(seg - np.round(seg)), initial=0.0))
        worst = max(worst, abs(t_val - round(t_val)))
        if worst > _INTEGRAL_TOL:
            raise PlanError(
                f"internal error: the direct plan solve returned a fractional solution "
                f"(off an integer by {worst:.3g}); plan with --solver walk"
            )
        crashed = np.bincount(self._seg_owner, weights=np.round(seg), minlength=len(self._q_max))
        durations = (self._q_max - np.rint(crashed).astype(np.int64)).tolist()
        quant = lo if lo == hi else int(round(t_val))
        durations = self._lengthen(durations, quant)
        walk = self._walk
        check_durations(walk, durations, quant)
        info = h.getInfo()
        return DirectSolution(
            quant_time=quant,
            durations=tuple(durations),
            cost=walk.total_cost(durations),
            simplex_iterations=int(info.simplex_iteration_count),
        )

    def _lengthen(self, durations: list[int], quant: int) -> list[int]:
        """Lengthen each activity into its slack (:func:`lengthen_into_slack`)."""
        return lengthen_into_slack(self._walk, durations, quant)


@dataclass(frozen=True, slots=True)
class _Segments:
    """Each activity's convex cost as unit crash segments, one column each.

    Attributes:
        spans: Per activity, its number of segments (``q_max - q_min``).
        start: Activity ``v``'s segments are ``start[v] .. start[v + 1] - 1`` (``n + 1``
            entries).
        cost: Per segment ``k`` of ``v``, the cost of crashing ``v`` from ``q_max - k`` to
            ``q_max - k - 1``.
    """

    spans: npt.NDArray[np.int64]
    start: npt.NDArray[np.int64]
    cost: npt.NDArray[np.float64]

    @classmethod
    def of(cls, walk: PhillipsDessouky) -> _Segments:
        """The segments of ``walk``'s cost tables."""
        tables = walk.tables
        spans = np.array([t.q_max - t.q_min for t in tables], dtype=np.int64)
        start = np.zeros(walk.num_nodes + 1, dtype=np.int64)
        np.cumsum(spans, out=start[1:])
        cost = np.empty(int(start[-1]))
        for v, t in enumerate(tables):
            vals = t.values  # c(q_min) .. c(q_max)
            # segment k of v: crash from q_max - k to q_max - k - 1
            cost[start[v] : start[v + 1]] = np.subtract(vals[-2::-1], vals[:0:-1])
        np.maximum(cost, 0.0, out=cost)  # a non-increasing cost: round-off only
        return cls(spans=spans, start=start, cost=cost)

    @property
    def count(self) -> int:
        """The number of segments."""
        return int(self.start[-1])


@dataclass(frozen=True, slots=True)
class _Rows:
    """The program's rows: precedence first, then one per sink.

    Attributes:
        node: Rows ``0 .. num_prec - 1``: one per edge ``u -> v`` (and one per source ``v``),
            ``F_v - F_u + Σ_k x_vk >= q_max,v``; this is ``v``.
        pred: ``u``, or -1 for a source.
        sinks: The activities without successors, one row ``F_v - T <= 0`` each.
    """

    node: npt.NDArray[np.int64]
    pred: npt.NDArray[np.int64]
    sinks: list[int]

    @classmethod
    def of(cls, walk: PhillipsDessouky) -> _Rows:
        """The rows of ``walk``'s DAG."""
        preds, succs = walk.predecessors, walk.successors
        row_node: list[int] = []
        row_pred: list[int] = []
        for v in range(walk.num_nodes):
            if preds[v]:
                for u in preds[v]:
                    row_node.append(v)
                    row_pred.append(u)
            else:
                row_node.append(v)
                row_pred.append(-1)
        return cls(
            node=np.asarray(row_node, dtype=np.int64),
            pred=np.asarray(row_pred, dtype=np.int64),
            sinks=[v for v in range(walk.num_nodes) if not succs[v]],
        )

    @property
    def num_prec(self) -> int:
        """The number of precedence rows."""
        return len(self.node)

    @property
    def count(self) -> int:
        """The number of rows."""
        return self.num_prec + len(self.sinks)


def _colwise(
    rows: _Rows, seg: _Segments, t_col: int, seg_col0: int
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.float64]]:
    """The constraint matrix, column-wise: ``(start, index, value)`` as HiGHS takes them.

    Columns: ``F_v`` (``0 .. n - 1``), ``T`` (``t_col``), the segments (from ``seg_col0``).
    """
    rn, rp = rows.node, rows.pred
    n_prec = rows.num_prec
    # Column-wise triplets (row, col, value).
    has_pred = rp >= 0
    row_parts = [np.arange(n_prec), np.flatnonzero(has_pred)]
    col_parts = [rn, rp[has_pred]]
    val_parts = [np.ones(n_prec), -np.ones(int(has_pred.sum()))]
    counts = seg.spans[rn]
    seg_rows = np.repeat(np.arange(n_prec), counts)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    seg_cols = seg_col0 + np.repeat(seg.start[rn], counts) + offsets
    row_parts.append(seg_rows)
    col_parts.append(seg_cols)
    val_parts.append(np.ones(len(seg_rows)))
    n_sinks = len(rows.sinks)
    sink_rows = n_prec + np.arange(n_sinks)
    row_parts += [sink_rows, sink_rows]
    col_parts += [np.asarray(rows.sinks, dtype=np.int64), np.full(n_sinks, t_col)]
    val_parts += [np.ones(n_sinks), -np.ones(n_sinks)]
    r = np.concatenate(row_parts)
    c = np.concatenate(col_parts)
    a = np.concatenate(val_parts)
    n_cols = seg_col0 + seg.count
    order = np.lexsort((r, c))
    r, c, a = r[order], c[order], a[order]
    start = np.zeros(n_cols + 1, dtype=np.int32)
    np.cumsum(np.bincount(c, minlength=n_cols), out=start[1:])
    return start, r.astype(np.int32), a


def lengthen_into_slack(walk: PhillipsDessouky, durations: list[int], quant: int) -> list[int]:
    """Lengthen each activity into its slack while its cost does not rise.

    Latest-first: an activity takes the room its successors (or ``quant``) leave after its
    earliest start, as long as its cost table does not rise (later nodes keep their start).

    Args:
        walk: The DAG and cost tables the durations are for.
        durations: Every activity's duration, in node order; lengthened in place.
        quant: The makespan bound ``T`` (time quanta).

    Returns:
        ``durations``, lengthened.
    """
    tables = walk.tables

    def take(v: int, room: float) -> float:
        t = tables[v]
        q = durations[v]
        room = min(t.q_max, room)
        while q < room and t.at(q + 1) <= t.at(q):
            q += 1
        durations[v] = q
        return q

    into_slack(walk.order, walk.predecessors, walk.successors, durations, quant, take)
    return durations


def into_slack(
    order: Sequence[int],
    preds: Sequence[Sequence[int]],
    succs: Sequence[Sequence[int]],
    durations: Sequence[float],
    bound: float,
    take: Callable[[int, float], float],
    *,
    latest: bool = False,
) -> None:
    """Offer each activity, latest first, the room its successors leave after its earliest start.

    Earliest starts come from ``durations``; ``take(v, room)`` may lengthen ``v`` up to
    ``room`` and returns its new duration. Without ``latest`` the successors keep their
    earliest start (every offer stays valid). With ``latest`` each activity is moved to end as
    late as its successors, themselves moved late, allow: the room is then from its earliest
    start to that latest finish, so slack anywhere downstream reaches it (a predecessor taken
    later still ends before this activity's latest start).

    Args:
        order: A topological order.
        preds: Each activity's predecessors.
        succs: Each activity's successors.
        durations: Every activity's duration, in node order.
        bound: The makespan bound (the room of an activity without successors ends there).
        take: Called once per activity, in reverse topological order.
        latest: Offer the room up to the latest finish (above).
    """
    start = [0.0] * len(durations)
    for v in order:
        start[v] = max((start[u] + durations[u] for u in preds[v]), default=0)
    late_start = list(start)
    for v in reversed(order):
        finish_by = min(((late_start if latest else start)[w] for w in succs[v]), default=bound)
        late_start[v] = finish_by - take(v, finish_by - start[v])


def check_durations(
    walk: PhillipsDessouky,
    durations: Sequence[int],
    quant: int,
    *,
    solve: str = "the direct plan solve",
) -> None:
    """Check solved durations against the DAG: critical path ``<= quant``, each in its range.

    Args:
        walk: The DAG and cost tables the durations are for.
        durations: Every activity's duration, in node order.
        quant: The makespan bound ``T`` (time quanta).
        solve: What produced the durations, for the error message.

    Raises:
        PlanError: The durations take longer than ``quant`` or leave a duration range.
    """
    makespan = walk.makespan(durations)
    tables = walk.tables
    if makespan > quant or any(not (t.q_min <= q <= t.q_max) for t, q in zip(tables, durations)):
        raise PlanError(
            f"internal error: {solve}'s durations take {makespan} quanta, "
            f"past the bound {quant}, or leave a duration range; plan with --solver walk"
        )


def solve_points(
    walk: PhillipsDessouky,
    *,
    times: Sequence[int] = (),
    cheapest: Sequence[tuple[int, int]] = (),
    time_cost_per_quantum: float = 0.0,
    solver_class: Callable[..., Any] | None = None,
) -> tuple[dict[int, DirectSolution], dict[tuple[int, int], DirectSolution]]:
    """Solve many points on one model, nearest first (each from the last basis).

    Args:
        walk: The Phillips-Dessouky solver of the DAG and costs (not run).
        times: Fixed makespans.
        cheapest: ``(lo, hi)`` ranges of the minimum-total-energy point.
        time_cost_per_quantum: ``w`` for the ``cheapest`` ranges, joules per quantum.
        solver_class: What solves the points: :class:`DirectSolver` (HiGHS, the default) or
            :class:`~powerlib.planning.perseus.flow.FlowSolver` (the same interface).

    Returns:
        ``{T: solution}`` for ``times`` and ``{(lo, hi): solution}`` for ``cheapest``.
    """
    make = DirectSolver if solver_class is None else solver_class
    solver = make(walk, time_cost_per_quantum=time_cost_per_quantum)
    at: dict[int, DirectSolution] = {}
    for t in sorted(set(times)):
        at[t] = solver.at(t)
    best = {rng: solver.cheapest(*rng) for rng in dict.fromkeys(cheapest)}
    return at, best


def new_highs(highspy: Any) -> Any:
    """A silent ``highspy.Highs()`` whose start-up banner stays off stdout.

    HiGHS 1.16 prints a banner from the constructor, before any option can be set, straight to
    file descriptor 1: that is where ``powerlib plan --json`` writes its JSON (the newest-versions
    check caught it). The constructor runs with fd 1 pointed at stderr, then output is switched
    off.
    """
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout at all: nothing to protect
        saved = None
    try:
        if saved is not None:
            try:
                os.dup2(2, 1)
            except OSError:  # no stderr either: the banner goes where it goes
                pass
        h = highspy.Highs()
    finally:
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
    h.setOptionValue("output_flag", False)
    return h
