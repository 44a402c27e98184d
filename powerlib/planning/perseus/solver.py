"""Phillips-Dessouky: the exact minimum-cost time frontier of a DAG of convex activities.

Input: an activity-on-node DAG whose activities each take an integer duration ``d`` in
``[q_min, q_max]`` (units of the time quantum τ) at a convex, non-increasing cost ``c(d)``.
Output, one step at a time: for every makespan from ``T_max - 1`` down to ``T_min``, durations
that minimise the total cost, with the cost and its change.

Each step works on the activity-on-arc (AOA) form: activity ``v`` is the arc ``v_in -> v_out``,
precedence ``u -> v`` is a zero-duration dummy arc ``u_out -> v_in``, and one source and one sink
close the graph. A step:

1. runs the critical-path method (integer event times) and keeps the zero-slack arcs;
2. gives each critical arc the flow bounds ``lb`` = what slowing it by one unit saves and ``ub``
   = what speeding it up by one unit costs (``∞`` where it cannot move that way; dummies
   ``[0, ∞)``);
3. finds a minimum s-t cut with those lower and upper bounds (a feasible circulation first,
   then a maximum flow, both by Dinic's algorithm with real infinities);
4. crashes the arcs the cut crosses forward (``d -= 1``) and un-crashes the activities it
   crosses backward (``d += 1``): every source-sink path loses exactly one unit.

It stops when the cut would have to cross a dummy or a fully-crashed arc forward, or crosses an
already fully-slowed arc backward (the makespan cannot shrink further), or when no feasible flow
exists. It does not stop on a zero cost change: a flat cost segment is a legitimate part of the
frontier (the reference implementation's ``|Δ| < 1e-6`` test ends such runs early).

Assumptions: the graph is acyclic; durations and time are integers; costs are convex in the
duration (so ``ub >= lb`` on every arc). The solver keeps its own duration array and never
mutates its inputs.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from powerlib.errors import PlanError

__all__ = ["ActivityCost", "FrontierStep", "PhillipsDessouky"]

logger = logging.getLogger(__name__)

_INF = math.inf
_EPS = 1e-9  # flow and residual tolerance (costs are J per time unit, ~1e-3 .. 1e3)


class ActivityCost(Protocol):
    """What the solver needs of a cost model."""

    q_min: int
    q_max: int

    def cost(self, q: int) -> float:
        """Cost at integer duration ``q`` in ``[q_min, q_max]``."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontierStep:
    """One point of the frontier.

    Attributes:
        iteration: 1-based step number.
        quant_time: Makespan in time units (``T_max - iteration``).
        cost: Total activity cost at this point.
        cost_change: Cost increase over the previous point (per one time unit).
        durations: Every activity's duration, in node order.
    """

    iteration: int
    quant_time: int
    cost: float
    cost_change: float
    durations: tuple[int, ...]


class _Table:
    """Costs of one cost model, precomputed on ``[q_min - 1, q_max + 1]`` (shared by activities)."""

    __slots__ = ("q_min", "q_max", "values")

    def __init__(self, model: ActivityCost) -> None:
        self.q_min, self.q_max = int(model.q_min), int(model.q_max)
        if self.q_min > self.q_max:
            raise PlanError(f"cost model has an empty duration range [{self.q_min}, {self.q_max}]")
        self.values = [float(model.cost(q)) for q in range(self.q_min, self.q_max + 1)]

    def at(self, q: int) -> float:
        return self.values[q - self.q_min]


class PhillipsDessouky:
    """The solver. Iterate :meth:`run` to stream frontier points, slowest first.

    Args:
        num_nodes: Number of activities (nodes ``0 .. num_nodes - 1``).
        edges: Precedence edges ``u -> v`` between activities.
        costs: One cost model per activity (activities of one kind may share an object).
    """

    def __init__(
        self, num_nodes: int, edges: Sequence[tuple[int, int]], costs: Sequence[ActivityCost]
    ) -> None:
        if len(costs) != num_nodes:
            raise PlanError(f"{num_nodes} activities but {len(costs)} cost models")
        tables: dict[int, _Table] = {}
        self._table = [tables.setdefault(id(c), _Table(c)) for c in costs]
        self.num_nodes = num_nodes
        self._preds: list[list[int]] = [[] for _ in range(num_nodes)]
        self._succs: list[list[int]] = [[] for _ in range(num_nodes)]
        for u, v in dict.fromkeys((int(u), int(v)) for u, v in edges):
            if not (0 <= u < num_nodes and 0 <= v < num_nodes) or u == v:
                raise PlanError(f"bad edge {u} -> {v} for {num_nodes} activities")
            self._succs[u].append(v)
            self._preds[v].append(u)
        self._topo = self._topological_order()
        self._topo_preds = [(v, tuple(self._preds[v])) for v in self._topo]
        self._rtopo_succs = [(v, tuple(self._succs[v])) for v in reversed(self._topo)]
        self.durations = [t.q_max for t in self._table]  # start from the slowest, cheapest plan
        self._makespan = 0

    @property
    def tables(self) -> list[_Table]:
        """Per activity, its cost table on ``[q_min, q_max]`` (shared by equal cost models)."""
        return self._table

    @property
    def predecessors(self) -> list[list[int]]:
        """Per activity, its predecessors (each edge once)."""
        return self._preds

    @property
    def successors(self) -> list[list[int]]:
        """Per activity, its successors (each edge once)."""
        return self._succs

    @property
    def order(self) -> list[int]:
        """A topological order of the activities."""
        return self._topo

    def _topological_order(self) -> list[int]:
        indegree = [len(p) for p in self._preds]
        ready = deque(v for v in range(self.num_nodes) if indegree[v] == 0)
        order = []
        while ready:
            u = ready.popleft()
            order.append(u)
            for v in self._succs[u]:
                indegree[v] -= 1
                if indegree[v] == 0:
                    ready.append(v)
        if len(order) != self.num_nodes:
            raise PlanError("the activity graph has a cycle")
        return order

    # -- critical path ---------------------------------------------------------------------------

    def _cpm(self, durations: Sequence[int]) -> tuple[int, list[int], list[int]]:
        """Makespan, earliest finish and latest start of every activity."""
        ef = [0] * self.num_nodes
        for v, pred in self._topo_preds:
            if pred:
                ef[v] = max([ef[u] for u in pred]) + durations[v]
            else:
                ef[v] = durations[v]
        makespan = max(ef) if ef else 0
        ls = [0] * self.num_nodes
        for v, succ in self._rtopo_succs:
            if succ:
                ls[v] = min([ls[w] for w in succ]) - durations[v]
            else:
                ls[v] = makespan - durations[v]
        return makespan, ef, ls

    def makespan(self, durations: Sequence[int] | None = None) -> int:
        """Makespan of ``durations`` (default: the current ones)."""
        return self._cpm(self.durations if durations is None else durations)[0]

    def total_cost(self, durations: Sequence[int] | None = None) -> float:
        """Total cost of ``durations`` (default: the current ones)."""
        d = self.durations if durations is None else durations
        return math.fsum(t.at(q) for t, q in zip(self._table, d))

    def fastest_makespan(self) -> int:
        """``T_min``: the makespan with every activity at ``q_min``."""
        return self.makespan([t.q_min for t in self._table])

    # -- one step --------------------------------------------------------------------------------

    def _step(self) -> float | None:
        """Shorten the makespan by one unit at minimum cost; the cost change, or None at the end."""
        n = self.num_nodes
        d = self.durations
        makespan, ef, ls = self._cpm(d)
        self._makespan = makespan
        # AOA node ids: v_in = 2v, v_out = 2v + 1, source = 2n, sink = 2n + 1.
        source, sink = 2 * n, 2 * n + 1
        # Critical arcs as parallel lists: tail, head, lower bound, upper bound, activity (-1: dummy).
        tails: list[int] = []
        heads: list[int] = []
        lbs: list[float] = []
        ubs: list[float] = []
        acts: list[int] = []
        preds, succs, tables = self._preds, self._succs, self._table
        for v in range(n):
            q = d[v]
            if ls[v] + q != ef[v]:
                continue  # slack: not critical
            table = tables[v]
            lo, hi = table.q_min, table.q_max
            if lo == hi:
                lb, ub = 0.0, _INF
            elif q == lo:
                lb, ub = table.at(q) - table.at(q + 1), _INF
            elif q == hi:
                lb, ub = 0.0, table.at(q - 1) - table.at(q)
            else:
                lb, ub = table.at(q) - table.at(q + 1), table.at(q - 1) - table.at(q)
            v_in, v_out = 2 * v, 2 * v + 1
            tails.append(v_in)
            heads.append(v_out)
            lbs.append(lb)
            ubs.append(ub if ub >= lb else lb)
            acts.append(v)
            if not preds[v] and ls[v] == 0:
                tails.append(source)
                heads.append(v_in)
                lbs.append(0.0)
                ubs.append(_INF)
                acts.append(-1)
            efv = ef[v]
            if not succs[v] and efv == makespan:
                tails.append(v_out)
                heads.append(sink)
                lbs.append(0.0)
                ubs.append(_INF)
                acts.append(-1)
            for w in succs[v]:
                if efv == ls[w]:  # the dummy v -> w has zero slack (so w is critical too)
                    tails.append(v_out)
                    heads.append(2 * w)
                    lbs.append(0.0)
                    ubs.append(_INF)
                    acts.append(-1)
        side = _min_cut_with_bounds(tails, heads, lbs, ubs, acts, 2 * n + 2, source, sink)
        if side is None:
            return None
        crash, uncrash = [], []
        for tail, head, v in zip(tails, heads, acts):
            if side[tail] and not side[head]:
                if v < 0 or d[v] == tables[v].q_min:
                    return None  # the cut is infinite: T_min reached
                crash.append(v)
            elif side[head] and not side[tail] and v >= 0:
                if d[v] == tables[v].q_max:
                    return None
                uncrash.append(v)
        if not crash:
            return None
        change = 0.0
        for v in crash:
            t = self._table[v]
            change += t.at(d[v] - 1) - t.at(d[v])
            d[v] -= 1
        for v in uncrash:
            t = self._table[v]
            change -= t.at(d[v]) - t.at(d[v] + 1)
            d[v] += 1
        return change

    def run(self, progress: Callable[[int, int], None] | None = None) -> Iterator[FrontierStep]:
        """Yield one frontier point per time unit, from ``T_max - 1`` down to ``T_min``.

        The starting point (every activity at ``q_max``, makespan ``T_max``) is not yielded; read
        it from :meth:`makespan` and :meth:`total_cost` before iterating.

        Args:
            progress: Called as ``progress(done, expected_total)`` after each step.
        """
        t_max = self.makespan()
        expected = t_max - self.fastest_makespan()
        cost = self.total_cost()
        iteration = 0
        while True:
            change = self._step()  # its CPM also checks that the previous step took one unit off
            if self._makespan != t_max - iteration:
                raise PlanError(
                    f"internal error: step {iteration} left the makespan at {self._makespan}, "
                    f"expected {t_max - iteration}"
                )
            if change is None:
                break
            iteration += 1
            cost += change
            makespan = t_max - iteration
            yield FrontierStep(
                iteration=iteration,
                quant_time=makespan,
                cost=cost,
                cost_change=change,
                durations=tuple(self.durations),
            )
            if progress is not None:
                progress(iteration, expected)


# -- minimum cut with lower and upper bounds -------------------------------------------------------


class _FlowGraph:
    """Residual graph for Dinic's algorithm (float capacities, real infinities)."""

    __slots__ = ("adj", "cap", "to")

    def __init__(self, num_nodes: int) -> None:
        self.adj: list[list[int]] = [[] for _ in range(num_nodes)]
        self.to: list[int] = []
        self.cap: list[float] = []

    def add(self, u: int, v: int, cap: float) -> int:
        """Add arc u -> v with capacity ``cap`` (and its reverse, capacity 0); returns its id."""
        self.adj[u].append(len(self.to))
        self.to.append(v)
        self.cap.append(cap)
        self.adj[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0.0)
        return len(self.to) - 2

    def max_flow(self, s: int, t: int) -> float:
        """Push the maximum flow s -> t; returns its value (``inf`` if unbounded)."""
        total = 0.0
        adj, to, cap = self.adj, self.to, self.cap
        while True:
            level = [-1] * len(adj)
            level[s] = 0
            queue = deque([s])
            while queue:
                u = queue.popleft()
                for e in adj[u]:
                    if cap[e] > _EPS and level[to[e]] < 0:
                        level[to[e]] = level[u] + 1
                        queue.append(to[e])
            if level[t] < 0:
                return total
            it = [0] * len(adj)
            while True:
                pushed = self._augment(s, t, _INF, level, it)
                if pushed <= _EPS:
                    break
                if pushed == _INF:
                    return _INF
                total += pushed

    def _augment(self, s: int, t: int, limit: float, level: list[int], it: list[int]) -> float:
        """Find one blocking-flow path iteratively (no recursion limits on long pipelines)."""
        adj, to, cap = self.adj, self.to, self.cap
        path: list[int] = []
        u = s
        while True:
            if u == t:
                pushed = limit
                for e in path:
                    if cap[e] < pushed:
                        pushed = cap[e]
                if pushed == _INF:
                    return _INF
                for e in path:
                    cap[e] -= pushed
                    cap[e ^ 1] += pushed
                return pushed
            advanced = False
            edges_u = adj[u]
            k = it[u]
            n_u = len(edges_u)
            want = level[u] + 1
            while k < n_u:
                e = edges_u[k]
                v = to[e]
                if cap[e] > _EPS and level[v] == want:
                    path.append(e)
                    it[u] = k
                    u = v
                    advanced = True
                    break
                k += 1
            if not advanced:
                it[u] = k
            if advanced:
                continue
            if not path:
                return 0.0
            level[u] = -1  # dead end: never visit again in this phase
            e = path.pop()
            u = to[e ^ 1]
            it[u] += 1

    def reachable(self, s: int) -> set[int]:
        """Nodes reachable from ``s`` through residual capacity."""
        seen = {s}
        queue = deque([s])
        adj, to, cap = self.adj, self.to, self.cap
        while queue:
            u = queue.popleft()
            for e in adj[u]:
                v = to[e]
                if cap[e] > _EPS and v not in seen:
                    seen.add(v)
                    queue.append(v)
        return seen


def _min_cut_with_bounds(
    tails: list[int],
    heads: list[int],
    lbs: list[float],
    ubs: list[float],
    acts: list[int],
    num_nodes: int,
    source: int,
    sink: int,
) -> list[bool] | None:
    """Minimum cut with bounds: which nodes are on the source side (None if every cut is infinite).

    Uses scipy's compiled Dinic when scipy is installed (extra ``fast``), else pure Python.
    """
    scipy = _scipy_flow()
    if scipy is not None:
        return _min_cut_scipy(scipy, tails, heads, lbs, ubs, num_nodes, source, sink)
    return _min_cut_python(tails, heads, lbs, ubs, acts, num_nodes, source, sink)


@dataclass(frozen=True, slots=True)
class _ScipyFlow:
    """scipy's compiled graph routines (untyped: the extra ``fast``)."""

    csr_array: Callable[..., Any]
    maximum_flow: Callable[..., Any]
    breadth_first_order: Callable[..., Any]


_SCIPY: list[_ScipyFlow | None] = []  # found once: [] not looked for yet, [None] not installed
_SCALE = 1e6  # capacities in micro-units: the reference floors every bound to a multiple of 1e-6
# scipy's maximum_flow keeps capacities in int32: "infinity" is the largest one, and finite
# capacities are scaled so that even all of them together stay far below it.
_INT_INF = (1 << 31) - 1
_FINITE_BUDGET = float(1 << 29)


def _scipy_flow() -> _ScipyFlow | None:
    """``scipy.sparse.csgraph.maximum_flow`` if scipy is installed (extra ``fast``), else None."""
    if not _SCIPY:
        try:
            # Optional extra, and scipy costs `powerlib plan` its start-up (tests/test_boundaries.py)
            from scipy.sparse import csr_array  # noqa: PLC0415 - optional extra ``fast``
            from scipy.sparse.csgraph import (  # noqa: PLC0415 - optional extra ``fast``
                breadth_first_order,
                maximum_flow,
            )

            _SCIPY.append(_ScipyFlow(csr_array, maximum_flow, breadth_first_order))
        except ImportError:
            logger.info(
                "scipy not installed: using the pure-Python max flow (pip install 'powerlib[fast]')"
            )
            _SCIPY.append(None)
    return _SCIPY[0]


def _min_cut_scipy(
    scipy: _ScipyFlow,
    tails: list[int],
    heads: list[int],
    lbs: list[float],
    ubs: list[float],
    num_nodes: int,
    source: int,
    sink: int,
) -> list[bool] | None:
    """The same cut as :func:`_min_cut_python`, with integer micro-unit capacities in C.

    The graph never has two arcs between the same ordered pair of nodes (activity arcs join an
    activity's own two events, dummies are de-duplicated, and terminal arcs only touch events
    that have no arc to that terminal), so the CSR arrays are built directly.
    """
    import numpy as np  # noqa: PLC0415 - with scipy, only for this flow (scipy imported it)

    csr_array, maximum_flow, _bfs = scipy.csr_array, scipy.maximum_flow, scipy.breadth_first_order
    n, s, t = num_nodes, source, sink
    tail_a = np.asarray(tails, dtype=np.int64)
    head_a = np.asarray(heads, dtype=np.int64)
    lb_raw = np.asarray(lbs, dtype=float)
    ub_raw = np.asarray(ubs, dtype=float)
    finite = np.isfinite(ub_raw)
    ub_fin = np.where(finite, ub_raw, 0.0)
    total = float(ub_fin.sum() + 2.0 * lb_raw.sum())
    scale = _SCALE if total * _SCALE < _FINITE_BUDGET else _FINITE_BUDGET / total
    lb = np.floor(lb_raw * scale).astype(np.int64)
    cap = np.where(finite, np.maximum(np.floor(ub_fin * scale).astype(np.int64) - lb, 0), _INT_INF)
    weight = (
        np.bincount(tail_a, weights=lb, minlength=n) - np.bincount(head_a, weights=lb, minlength=n)
    ).astype(np.int64)
    weight[s] = weight[t] = 0
    pos = np.flatnonzero(weight > 0)
    neg = np.flatnonzero(weight < 0)
    rows = np.concatenate([tail_a, pos, np.full(len(neg), s, dtype=np.int64)])
    cols = np.concatenate([head_a, np.full(len(pos), t, dtype=np.int64), neg])
    caps = np.concatenate([cap, weight[pos], -weight[neg]])
    order = np.lexsort((cols, rows))
    rows, cols, caps = rows[order], cols[order], caps[order]
    indptr = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.bincount(rows, minlength=n), out=indptr[1:])
    graph = csr_array((caps.astype(np.int32), cols.astype(np.int32), indptr), shape=(n, n))
    result = maximum_flow(graph, s, t, method="dinic")
    if result.flow_value >= _INT_INF:
        return None  # an all-infinite path: every cut is infinite
    flow = result.flow
    f_keys = np.repeat(np.arange(n, dtype=np.int64), np.diff(flow.indptr)) * n + flow.indices
    keys = rows * n + cols
    where = np.minimum(np.searchsorted(f_keys, keys), len(f_keys) - 1)
    arc_flow = np.where(f_keys[where] == keys, flow.data[where], 0)
    fwd = arc_flow < caps
    bwd = arc_flow > 0
    r_rows = np.concatenate([rows[fwd], cols[bwd]])
    r_cols = np.concatenate([cols[fwd], rows[bwd]])
    r_order = np.argsort(r_rows, kind="stable")
    r_ptr = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.bincount(r_rows, minlength=n), out=r_ptr[1:])
    residual = csr_array(
        (np.ones(len(r_rows), dtype=np.int8), r_cols[r_order].astype(np.int32), r_ptr), shape=(n, n)
    )
    reached = _bfs(residual, s, directed=True, return_predecessors=False)
    mask = np.zeros(n, dtype=bool)
    mask[reached] = True
    side: list[bool] = mask.tolist()
    return side


def _min_cut_python(
    tails: list[int],
    heads: list[int],
    lbs: list[float],
    ubs: list[float],
    acts: list[int],
    num_nodes: int,
    source: int,
    sink: int,
) -> list[bool] | None:
    """Source side of a minimum s-t cut whose value is ``Σ_{S→T} ub - Σ_{T→S} lb``.

    With ``b(v)`` = (lower bounds leaving v) - (lower bounds entering v), that value equals
    ``Σ_{S→T} (ub - lb) + Σ_{v∈S} b(v)``: an ordinary cut with capacities ``ub - lb`` plus node
    weights, which become terminal arcs (``v -> t`` of capacity ``b(v)`` when positive, paid if v
    is on the source side; ``s -> v`` of capacity ``-b(v)`` when negative, paid otherwise). One
    maximum flow therefore finds it: the textbook feasible-flow-then-maximise construction folded
    into a single flow. Returns None when every cut is infinite.
    """
    s, t = source, sink
    graph = _FlowGraph(num_nodes)
    weight = [0.0] * num_nodes
    dummies: list[tuple[int, int, int]] = []
    for i, j, lb, ub, activity in zip(tails, heads, lbs, ubs, acts):
        arc = graph.add(i, j, ub - lb if ub != _INF else _INF)
        if activity < 0:
            dummies.append((i, j, arc))
        weight[i] += lb
        weight[j] -= lb
    from_source: dict[int, int] = {}
    to_sink: dict[int, int] = {}
    for node, w in enumerate(weight):
        if node == s or node == t:
            continue
        if w > _EPS:
            to_sink[node] = graph.add(node, t, w)
        elif w < -_EPS:
            from_source[node] = graph.add(s, node, -w)
    # Much of the flow runs s -> u -> (dummy, infinite) -> v -> t: push it directly, then let
    # Dinic finish. (A pure speed-up: the maximum flow, hence the cut, is the same.)
    cap = graph.cap
    for i, j, arc in dummies:
        a, b = from_source.get(i), to_sink.get(j)
        if a is None or b is None:
            continue
        push = min(cap[a], cap[b])
        if push > _EPS:
            for e in (a, arc, b):
                cap[e] -= push
                cap[e ^ 1] += push
    if graph.max_flow(s, t) == _INF:
        return None
    side = [False] * num_nodes
    for node in graph.reachable(s):
        side[node] = True
    return side
