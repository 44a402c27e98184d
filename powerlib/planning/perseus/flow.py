"""Frontier points at a fixed makespan solved as a min-cost circulation (issue 34).

The plan's linear program (:mod:`powerlib.planning.perseus.direct`, docs/perseus.md §2.6) is the
dual of a min-cost circulation (Fulkerson, J. SIAM 9, 1961; Kelley, Oper. Res. 9, 1961). The
network, for a makespan bound ``T``:

* nodes: a source ``s``, a sink ``t``, and ``v_in -> v_out`` per activity ``v``;
* with ``K = q_max - q_min`` and crash-segment costs ``s_k = c(q_max - k - 1) - c(q_max - k)``
  (non-decreasing: ``c`` is convex), ``K`` parallel arcs ``v_in -> v_out`` of capacity
  ``a_k = s_k - s_{k-1}`` (``s_{-1} = 0``) and unit cost ``-(q_max - k)``, plus one floor arc of
  cost ``-q_min`` and unbounded capacity;
* precedence arcs ``u_out -> v_in``, arcs ``s -> v_in`` where ``v`` has no predecessor and
  ``v_out -> t`` where it has no successor, all of cost 0 and unbounded;
* a return arc ``t -> s`` of cost ``T``, unbounded.

For the minimum of ``Σ cost + w · T`` over ``T`` in ``[lo, hi]`` (:meth:`FlowSolver.cheapest`,
``T*``) the return arc is two parallel arcs ``t -> s``: one of cost ``lo`` and capacity ``w``
(nanojoules, as the crash arcs), one of cost ``hi``, unbounded. In the dual they read
``pi(t) - pi(s) <= hi`` and a penalty ``w · max(0, pi(t) - pi(s) - lo)``, so the optimal
potentials' makespan ``pi(t) - pi(s)`` is an optimal ``T`` (one circulation, no search). A
fixed makespan (:meth:`FlowSolver.at`) gives both arcs the cost ``T``.

With ``dist`` the shortest distances from ``s`` in the residual network of an optimal flow, the
event times ``pi = -dist`` are an optimal dual: ``S_v = pi(v_in)``, ``F_v = pi(v_out)``, with
``S_v >= F_u`` on every edge, ``S_v >= 0``, ``F_v <= T`` and ``F_v - S_v >= q_min`` (each an
arc that is always residual forward), and the penalty of the activity arcs summing to
``c_v(d_v) - c_v(q_max)``. Durations are ``d_v = min(F_v - S_v, q_max)``, lengthened into their
slack as the direct solve does, checked against the DAG, and priced from the cost tables.

Capacities are joules: the cumulative slopes ``s_k`` are rounded to int64 nanojoules and then
differenced, so equal slopes stay equal (ties kept) and the error stays far below ``1e-9``
relative. "Unbounded" is the sum of the finite capacities plus one, which never binds at an
optimum. Every solve is certified (:func:`powerlib.planning.perseus.mincost.certify`); a failed
certificate is a :class:`~powerlib.errors.PlanError`, never a plan.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from powerlib.errors import BackendUnavailableError, PlanError
from powerlib.planning.perseus import mincost
from powerlib.planning.perseus.direct import (
    DirectSolution,
    DirectSolver,
    check_durations,
    lengthen_into_slack,
)
from powerlib.planning.perseus.solver import PhillipsDessouky

__all__ = ["FlowSolver", "flow_available", "point_solver"]

#: Joules to the integer capacity unit (nanojoules).
_SCALE = 1e9
_INT64_MAX = int(np.iinfo(np.int64).max)
_SOURCE = 0
_SINK = 1


def point_solver(walk: PhillipsDessouky, *, time_cost_per_quantum: float = 0.0) -> Any:
    """The direct solver of a frontier's points: the compiled flow where it is built, else HiGHS.

    Both return the same :class:`DirectSolution` at the same optimal cost (tested to 1e-9
    relative); the flow needs no extra and certifies every solve.

    Raises:
        BackendUnavailableError: Neither the extension nor ``highspy`` is available.
    """
    if flow_available():
        return FlowSolver(walk, time_cost_per_quantum=time_cost_per_quantum)
    return DirectSolver(walk, time_cost_per_quantum=time_cost_per_quantum)


def flow_available() -> bool:
    """Whether the flow solve can run here (the compiled min-cost flow extension loads)."""
    return mincost.available()


def _activity_arcs(table: Any) -> tuple[np.ndarray, np.ndarray]:
    """Capacities (nJ, int64) and unit costs of one cost table's crash arcs, zero ones dropped.

    Args:
        table: A cost table (``q_min``, ``q_max``, ``values`` = ``c(q_min) .. c(q_max)``).

    Returns:
        ``(capacity, cost)`` of the parallel arcs with positive capacity.
    """
    vals = np.asarray(table.values, dtype=float)
    if vals.shape[0] < 2:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    # segment k: crash from q_max - k to q_max - k - 1
    slopes = np.subtract(vals[-2::-1], vals[:0:-1])
    cumulative = np.rint(np.maximum(slopes, 0.0) * _SCALE)
    if cumulative.size and cumulative[-1] >= 2.0**62:
        raise PlanError(
            f"an activity's cost slope ({slopes[-1]:.6g} J per quantum) is too large for the "
            "flow solve's int64 nanojoule capacities"
        )
    cumulative = np.maximum.accumulate(cumulative.astype(np.int64))  # round-off only
    capacity = np.diff(cumulative, prepend=np.int64(0))
    cost = -(int(table.q_max) - np.arange(slopes.shape[0], dtype=np.int64))
    keep = capacity > 0
    return capacity[keep], cost[keep]


class FlowSolver:
    """The plan's linear program at a fixed makespan, solved as a min-cost circulation.

    The same interface and result as :meth:`DirectSolver.at
    <powerlib.planning.perseus.direct.DirectSolver.at>`, so either can serve a deadline point.

    Args:
        walk: The Phillips-Dessouky solver of the DAG and costs (its tables, order and
            critical-path method are shared; it is not run).
        time_cost_per_quantum: ``w``: the cost of one quantum of makespan in :meth:`cheapest`
            (``N · P_block · τ`` for the minimum-energy point), joules.

    Raises:
        BackendUnavailableError: The compiled min-cost flow extension is not built.
        PlanError: ``time_cost_per_quantum`` is negative or not finite, or the finite
            capacities overflow int64.
    """

    def __init__(self, walk: PhillipsDessouky, *, time_cost_per_quantum: float = 0.0) -> None:
        if not mincost.available():
            raise BackendUnavailableError(
                "the flow plan solve needs the compiled min-cost flow extension "
                "(powerlib.planning.perseus._mincost); reinstall powerlib with a C++ compiler"
            )
        if not (math.isfinite(time_cost_per_quantum) and time_cost_per_quantum >= 0):
            raise PlanError(f"time cost must be >= 0, got {time_cost_per_quantum}")
        w_nj = float(np.rint(float(time_cost_per_quantum) * _SCALE))
        if w_nj >= 2.0**62:
            raise PlanError(
                f"time cost {time_cost_per_quantum:.6g} J per quantum is too large for the flow "
                "solve's int64 nanojoule capacities"
            )
        self._w = float(time_cost_per_quantum)
        self._w_nj = int(w_nj)
        self._walk = walk
        self.t_min = walk.fastest_makespan()
        self.t_max = walk.makespan([t.q_max for t in walk.tables])
        self._build()

    def _build(self) -> None:
        walk = self._walk
        n = walk.num_nodes
        tables = walk.tables
        v_in = 2 + 2 * np.arange(n, dtype=np.int64)
        v_out = v_in + 1
        # Crash arcs, per shared table once.
        per_table: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        caps: list[np.ndarray] = []
        costs: list[np.ndarray] = []
        counts = np.empty(n, dtype=np.int64)
        for v, t in enumerate(tables):
            arcs = per_table.get(id(t))
            if arcs is None:
                arcs = per_table[id(t)] = _activity_arcs(t)
            caps.append(arcs[0])
            costs.append(arcs[1])
            counts[v] = arcs[0].shape[0]
        crash_cap = np.concatenate(caps) if caps else np.zeros(0, dtype=np.int64)
        crash_cost = np.concatenate(costs) if costs else np.zeros(0, dtype=np.int64)
        finite = sum(int(c.sum()) for c in caps) + self._w_nj  # exact Python integer
        big = finite + 1
        if big > _INT64_MAX // 4:
            raise PlanError(
                "the plan's costs are too large for the flow solve's int64 nanojoule capacities"
            )
        preds, succs = walk.predecessors, walk.successors
        edge_u = np.fromiter((u for v in range(n) for u in preds[v]), dtype=np.int64)
        edge_v = np.fromiter((v for v in range(n) for _ in preds[v]), dtype=np.int64)
        sources = np.fromiter((v for v in range(n) if not preds[v]), dtype=np.int64)
        sinks = np.fromiter((v for v in range(n) if not succs[v]), dtype=np.int64)
        q_min = np.fromiter((t.q_min for t in tables), dtype=np.int64, count=n)
        tail = [
            np.repeat(v_in, counts),  # crash arcs
            v_in,  # floor arcs
            v_out[edge_u],  # precedence
            np.full(sources.shape[0], _SOURCE, dtype=np.int64),
            v_out[sinks],
            np.array([_SINK, _SINK], dtype=np.int64),  # return arcs (w at lo, then hi), last
        ]
        head = [
            np.repeat(v_out, counts),
            v_out,
            v_in[edge_v],
            v_in[sources],
            np.full(sinks.shape[0], _SINK, dtype=np.int64),
            np.array([_SOURCE, _SOURCE], dtype=np.int64),
        ]
        unbounded = n + edge_u.shape[0] + sources.shape[0] + sinks.shape[0]
        self._tail = np.concatenate(tail)
        self._head = np.concatenate(head)
        self._capacity = np.concatenate(
            [
                crash_cap,
                np.full(unbounded, big, dtype=np.int64),
                np.array([self._w_nj, big], dtype=np.int64),
            ]
        )
        self._cost = np.concatenate(
            [crash_cost, -q_min, np.zeros(unbounded - n + 2, dtype=np.int64)]
        )
        self._num_nodes = 2 + 2 * n
        self._v_in = v_in
        self._v_out = v_out
        self._q_max = np.fromiter((t.q_max for t in tables), dtype=np.int64, count=n)
        self.num_arcs = int(self._tail.shape[0])
        self.num_nodes = self._num_nodes

    def at(self, quant_time: int) -> DirectSolution:
        """The minimum-cost durations with makespan at most ``quant_time``.

        Args:
            quant_time: The makespan bound ``T`` (time quanta), at least ``T_min``.

        Returns:
            The point, as :class:`~powerlib.planning.perseus.direct.DirectSolution`
            (``simplex_iterations`` is 0: no simplex runs).

        Raises:
            PlanError: ``quant_time`` below ``T_min``, the solver refused the instance, the
                certificate failed, or the durations fail the DAG check.
        """
        t = int(quant_time)
        if t < self.t_min:
            raise PlanError(f"makespan {t} is below the fastest possible {self.t_min}")
        return self._solve(t, t)

    def cheapest(self, lo: int, hi: int) -> DirectSolution:
        """The point of minimum ``cost + w · T`` over makespans ``T`` in ``[lo, hi]``.

        As :meth:`DirectSolver.cheapest <powerlib.planning.perseus.direct.DirectSolver.cheapest>`,
        in one circulation (the module docstring). Among makespans of equal ``cost + w · T`` the
        smallest is taken: the shortest distances give the least potentials, so the fastest
        optimal ``T`` (HiGHS's choice among ties is unspecified; costs agree either way).
        ``quant_time`` is the chosen ``T``; ``cost`` is Σ activity cost, without ``w · T``.

        Args:
            lo: The least makespan allowed (raised to ``T_min``).
            hi: The greatest makespan allowed.

        Returns:
            The point, as :class:`~powerlib.planning.perseus.direct.DirectSolution`.

        Raises:
            PlanError: An empty range, the solver refused the instance, the certificate failed,
                or the durations fail the DAG check.
        """
        lo, hi = max(int(lo), self.t_min), int(hi)
        if hi < lo:
            raise PlanError(f"no makespan in [{lo}, {hi}] (the fastest possible is {self.t_min})")
        return self._solve(lo, hi)

    def _solve(self, lo: int, hi: int) -> DirectSolution:
        """Solve with return arcs of cost ``lo`` (capacity ``w``) and ``hi`` (unbounded)."""
        cost = self._cost.copy()
        cost[-2] = lo
        cost[-1] = hi
        args = (self._num_nodes, self._tail, self._head, self._capacity, cost)
        result = mincost.min_cost_circulation(*args)
        dist = mincost.potentials(*args, result.flow, _SOURCE)
        mincost.certify(*args, result.flow, dist)
        if np.any(dist == mincost.UNREACHABLE):
            raise PlanError("internal error: an event of the flow solve is unreachable")
        start = -dist[self._v_in]
        finish = -dist[self._v_out]
        makespan = int(dist[_SOURCE] - dist[_SINK])
        # Below lo the penalty is 0 and Σ cost cannot fall further: lo is as cheap.
        t = min(max(makespan, lo), hi)
        durations = np.minimum(finish - start, self._q_max).tolist()
        walk = self._walk
        durations = lengthen_into_slack(walk, durations, t)
        check_durations(walk, durations, t, solve="the flow plan solve")
        return DirectSolution(
            quant_time=t,
            durations=tuple(durations),
            cost=walk.total_cost(durations),
            simplex_iterations=0,
        )
