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
optimum; the solver sums every capacity in int64, so where that sum would pass 2^62 (64 x 1024)
the unit grows past a nanojoule (:func:`capacity_scale`). The same network, with breakpoints
at real durations instead of every quantum, is the slowdown guard's exact-time solve
(:mod:`powerlib.planning.perseus.guard`). Every solve is certified (:func:`powerlib.planning.perseus.mincost.certify`); a failed
certificate is a :class:`~powerlib.errors.PlanError`, never a plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
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
from powerlib.planning.perseus.work import direct_kind

__all__ = ["ActivityNetwork", "FlowSolver", "capacity_scale", "flow_available", "point_solver"]

#: Joules to the integer capacity unit (nanojoules), unless int64 headroom asks for less.
_SCALE = 1e9
_INT64_MAX = int(np.iinfo(np.int64).max)
_SOURCE = 0
_SINK = 1


def point_solver(
    walk: PhillipsDessouky, *, time_cost_per_quantum: float = 0.0, direct_solver: str = "auto"
) -> Any:
    """The direct solver of a frontier's points: the compiled flow where it is built, else HiGHS.

    Both return the same :class:`DirectSolution` at the same optimal cost (tested to 1e-9
    relative); the flow needs no extra and certifies every solve. ``direct_solver="highs"``
    forces HiGHS (for side-by-side benchmarks; :func:`~powerlib.planning.perseus.work.direct_kind`).

    Raises:
        BackendUnavailableError: Neither the extension nor ``highspy`` is available.
    """
    if direct_kind(direct_solver) == "flow":
        return FlowSolver(walk, time_cost_per_quantum=time_cost_per_quantum)
    return DirectSolver(walk, time_cost_per_quantum=time_cost_per_quantum)


def flow_available() -> bool:
    """Whether the flow solve can run here (the compiled min-cost flow extension loads)."""
    return mincost.available()


def crash_slopes(times: Any, costs: Any) -> tuple[np.ndarray, np.ndarray]:
    """The crash arcs of one convex, piecewise-linear activity cost, as float slopes.

    Args:
        times: Breakpoint durations, strictly increasing (integer time units).
        costs: The cost at each breakpoint, non-increasing and convex.

    Returns:
        ``(cumulative, cost)``: for each breakpoint after the first, from the slowest down, the
        slope of the segment below it (joules per time unit, non-decreasing: the capacities are
        its increments) and the arc's unit cost ``-time``.
    """
    times = np.asarray(times, dtype=np.int64)
    costs = np.asarray(costs, dtype=float)
    slopes = (costs[:-1] - costs[1:]) / np.diff(times).astype(float)
    return np.maximum(slopes[::-1], 0.0), -times[:0:-1]


def crash_capacities(cumulative: np.ndarray, scale: float) -> np.ndarray:
    """Integer capacities of crash arcs from their cumulative slopes (:func:`crash_slopes`).

    The cumulative slopes are rounded to integers and then differenced, so equal slopes stay
    equal (ties kept) and the error stays far below ``1e-9`` relative.
    """
    rounded = np.maximum.accumulate(np.rint(cumulative * scale).astype(np.int64))
    return np.diff(rounded, prepend=np.int64(0))


def capacity_scale(finite_j: float, num_unbounded: int, what: str) -> float:
    """Joules to integer capacity units: nanojoules, or less where int64 asks for it.

    The solver sums every capacity in int64, and each of the ``num_unbounded`` uncapped arcs
    carries the sum of the finite ones plus one; at 64 x 1024 that is past int64 in nanojoules.
    The scale keeps the whole sum below 2^62 (the rounding error stays below 1e-8 relative).

    Raises:
        PlanError: Even one unit per joule would overflow.
    """
    if finite_j <= 0:
        return _SCALE
    scale = min(_SCALE, 2.0**62 / (num_unbounded + 2) / finite_j)
    if scale < 1.0:
        raise PlanError(f"{what} are too large for the flow solve's int64 capacities")
    return scale


@dataclass(frozen=True, slots=True)
class ActivityNetwork:
    """The circulation of an activity DAG (the module docstring), return arcs last.

    Attributes:
        num_nodes: ``2 + 2 n``: source, sink, then ``v_in, v_out`` per activity.
        tail: Arc tails.
        head: Arc heads.
        capacity: Arc capacities (int64; "unbounded" is the finite sum plus one).
        cost: Arc unit costs; the two return arcs' costs are set per solve.
        v_in: Each activity's in-node.
        v_out: Each activity's out-node.
    """

    num_nodes: int
    tail: np.ndarray
    head: np.ndarray
    capacity: np.ndarray
    cost: np.ndarray
    v_in: np.ndarray
    v_out: np.ndarray

    @classmethod
    def build(
        cls,
        preds: Sequence[Sequence[int]],
        succs: Sequence[Sequence[int]],
        crash: Sequence[tuple[np.ndarray, np.ndarray]],
        floor: np.ndarray,
        w: int,
    ) -> ActivityNetwork:
        """The network of ``n`` activities.

        Args:
            preds: Each activity's predecessors.
            succs: Each activity's successors.
            crash: Per activity, its crash arcs' ``(capacity, cost)`` (zero capacities allowed).
            floor: Per activity, its shortest duration (the floor arc's cost is ``-floor``).
            w: Capacity of the return arc at ``lo`` (the time cost, in capacity units).

        Raises:
            PlanError: The capacities overflow int64.
        """
        n = len(preds)
        v_in = 2 + 2 * np.arange(n, dtype=np.int64)
        v_out = v_in + 1
        counts = np.fromiter((c.shape[0] for c, _ in crash), dtype=np.int64, count=n)
        crash_cap = np.concatenate([c for c, _ in crash]) if n else np.zeros(0, np.int64)
        crash_cost = np.concatenate([k for _, k in crash]) if n else np.zeros(0, np.int64)
        keep = crash_cap > 0
        edge_u = np.fromiter((u for v in range(n) for u in preds[v]), dtype=np.int64)
        edge_v = np.fromiter((v for v in range(n) for _ in preds[v]), dtype=np.int64)
        sources = np.fromiter((v for v in range(n) if not preds[v]), dtype=np.int64)
        sinks = np.fromiter((v for v in range(n) if not succs[v]), dtype=np.int64)
        unbounded = n + edge_u.shape[0] + sources.shape[0] + sinks.shape[0]
        big = int(crash_cap.sum(dtype=object)) + int(w) + 1  # exact Python integer
        if big * (unbounded + 2) > _INT64_MAX:
            raise PlanError("the plan's costs are too large for the flow solve's int64 capacities")
        tail = [
            np.repeat(v_in, counts)[keep],  # crash arcs
            v_in,  # floor arcs
            v_out[edge_u],  # precedence
            np.full(sources.shape[0], _SOURCE, dtype=np.int64),
            v_out[sinks],
            np.array([_SINK, _SINK], dtype=np.int64),  # return arcs (w at lo, then hi), last
        ]
        head = [
            np.repeat(v_out, counts)[keep],
            v_out,
            v_in[edge_v],
            v_in[sources],
            np.full(sinks.shape[0], _SINK, dtype=np.int64),
            np.array([_SOURCE, _SOURCE], dtype=np.int64),
        ]
        capacity = [
            crash_cap[keep],
            np.full(unbounded, big, dtype=np.int64),
            np.array([w, big], dtype=np.int64),
        ]
        cost = [
            crash_cost[keep],
            -np.asarray(floor, dtype=np.int64),
            np.zeros(unbounded - n + 2, dtype=np.int64),
        ]
        return cls(
            2 + 2 * n,
            np.concatenate(tail),
            np.concatenate(head),
            np.concatenate(capacity),
            np.concatenate(cost),
            v_in,
            v_out,
        )

    def events(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Solve with return arcs of cost ``lo`` and ``hi``; certified.

        Returns:
            ``(start, finish, makespan)``: every activity's optimal event times (the negated
            residual distances) and ``pi(t) - pi(s)``.

        Raises:
            PlanError: The solver refused the instance or the certificate failed.
        """
        cost = self.cost.copy()
        cost[-2] = lo
        cost[-1] = hi
        args = (self.num_nodes, self.tail, self.head, self.capacity, cost)
        result = mincost.min_cost_circulation(*args)
        dist = mincost.potentials(*args, result.flow, _SOURCE)
        mincost.certify(*args, result.flow, dist)
        if np.any(dist == mincost.UNREACHABLE):
            raise PlanError("internal error: an event of the flow solve is unreachable")
        return -dist[self.v_in], -dist[self.v_out], int(dist[_SOURCE] - dist[_SINK])

    @property
    def num_arcs(self) -> int:
        """Arcs in the network."""
        return int(self.tail.shape[0])


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
        self._w = float(time_cost_per_quantum)
        self._walk = walk
        self.t_min = walk.fastest_makespan()
        self.t_max = walk.makespan([t.q_max for t in walk.tables])
        self._build()

    def _build(self) -> None:
        walk = self._walk
        n = walk.num_nodes
        tables = walk.tables
        # Crash arcs, per shared table once: segment k crashes from q_max - k to q_max - k - 1.
        per_table: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        slopes = []
        for t in tables:
            got = per_table.get(id(t))
            if got is None:
                q = np.arange(int(t.q_min), int(t.q_max) + 1, dtype=np.int64)
                got = per_table[id(t)] = crash_slopes(q, t.values)
            slopes.append(got)
        finite_j = sum(float(c.max()) for c, _ in slopes if c.shape[0]) + self._w
        num_unbounded = 3 * n + sum(len(p) for p in walk.predecessors)
        scale = capacity_scale(finite_j, num_unbounded, "the plan's cost slopes")
        arcs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        crash = []
        for t in tables:
            got = arcs.get(id(t))
            if got is None:
                cumulative, cost = per_table[id(t)]
                got = arcs[id(t)] = (crash_capacities(cumulative, scale), cost)
            crash.append(got)
        self._w_units = int(np.rint(self._w * scale))
        floor = np.fromiter((t.q_min for t in tables), dtype=np.int64, count=n)
        self._net = ActivityNetwork.build(
            walk.predecessors, walk.successors, crash, floor, self._w_units
        )
        self._q_max = np.fromiter((t.q_max for t in tables), dtype=np.int64, count=n)
        self.num_arcs = self._net.num_arcs
        self.num_nodes = self._net.num_nodes

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
        start, finish, makespan = self._net.events(lo, hi)
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
