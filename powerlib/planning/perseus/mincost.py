"""Min-cost circulation for the Perseus planner: a compiled cost-scaling solve and its certificate.

The plan's linear program is the dual of a min-cost circulation (Fulkerson, "An out-of-kilter
method for minimal-cost flow problems", J. SIAM 9, 1961; docs/perseus.md §2.6 and issue 34). This
module solves the circulation with the C++ extension :mod:`powerlib.planning.perseus._mincost`:

* :func:`min_cost_circulation`: Goldberg's cost scaling push-relabel with partial augment-relabel
  (A. V. Goldberg, "An efficient implementation of a scaling minimum-cost flow algorithm",
  J. Algorithms 22(1):1-29, 1997). Costs are multiplied by ``num_nodes + 1`` inside the solver, so
  the last phase (epsilon = 1 on the scaled costs, below ``1 / num_nodes`` on the real ones)
  certifies an optimum. All supplies are zero: the caller closes the network with a return arc.
* :func:`potentials`: shortest distances from a node in the residual network of a flow, with the
  original costs (queue-based Bellman-Ford re-scanning only improved nodes). By LP duality
  ``pi = -dist`` are optimal dual values (event times) when the flow is optimal.
* :func:`certify`: an O(arcs) numpy check of a flow and its distances: bounds, conservation, and
  the reduced cost of every residual arc between reachable nodes. A flow and distances that pass
  are an optimum and an optimal dual, whatever computed them.

All quantities are integers (int64). Capacities must be finite: the caller caps an "unbounded"
arc at the sum of the finite capacities plus one, which never binds at an optimum. The extension
is built by ``pip install`` (``[tool.setuptools] ext-modules`` in pyproject.toml, optional so an
install without a compiler still succeeds); :func:`available` says whether it loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from powerlib.errors import PlanError

__all__ = [
    "UNREACHABLE",
    "FlowResult",
    "available",
    "certify",
    "min_cost_circulation",
    "potentials",
]

#: The distance :func:`potentials` gives a node the source cannot reach.
UNREACHABLE = int(np.iinfo(np.int64).max)

_STATUS_MESSAGES = {
    1: "a node index is out of range or a capacity is negative",
    2: "the instance exceeds int64 headroom (scaled costs, capacity sum or prices overflow)",
    3: "the residual network has a negative cycle: the flow is not optimal",
    4: "out of memory",
    5: "an internal invariant of the solver failed (please report this instance)",
}

try:
    from powerlib.planning.perseus import _mincost as _ext  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised only where the extension was not built
    _ext = None


@dataclass(frozen=True)
class FlowResult:
    """An optimal circulation.

    Attributes:
        flow: Flow on each arc, int64, in the caller's arc order.
        cost_total: ``sum(cost * flow)`` as an exact Python integer.
    """

    flow: np.ndarray[Any, np.dtype[np.int64]]
    cost_total: int


def available() -> bool:
    """Return whether the compiled solver imports on this machine.

    Returns:
        True when :mod:`powerlib.planning.perseus._mincost` was built and loads.
    """
    return _ext is not None


def _require_ext() -> Any:
    if _ext is None:
        raise PlanError(
            "the compiled min-cost flow solver (powerlib.planning.perseus._mincost) is not "
            "built; reinstall powerlib with a C++ compiler available"
        )
    return _ext


def _as_int64(name: str, values: Any, length: int | None) -> np.ndarray[Any, np.dtype[np.int64]]:
    array = np.asarray(values)
    if array.ndim != 1:
        raise PlanError(f"{name} must be one-dimensional, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise PlanError(f"{name} must hold integers, got dtype {array.dtype}")
    out = np.ascontiguousarray(array, dtype=np.int64)
    if length is not None and out.shape[0] != length:
        raise PlanError(f"{name} has {out.shape[0]} entries, expected {length}")
    return out


def _arrays(
    num_nodes: int, tail: Any, head: Any, capacity: Any, cost: Any
) -> tuple[np.ndarray[Any, np.dtype[np.int64]], ...]:
    if num_nodes < 0:
        raise PlanError(f"num_nodes must be non-negative, got {num_nodes}")
    tail_a = _as_int64("tail", tail, None)
    m = tail_a.shape[0]
    return (
        tail_a,
        _as_int64("head", head, m),
        _as_int64("capacity", capacity, m),
        _as_int64("cost", cost, m),
    )


def _check(status: int, what: str) -> None:
    if status != 0:
        reason = _STATUS_MESSAGES.get(status, f"unknown status {status}")
        raise PlanError(f"{what} failed: {reason}")


def min_cost_circulation(
    num_nodes: int, tail: Any, head: Any, capacity: Any, cost: Any
) -> FlowResult:
    """Solve a min-cost circulation exactly by cost scaling (Goldberg 1997).

    Minimises ``sum(cost * flow)`` subject to ``0 <= flow <= capacity`` and conservation at every
    node (no supplies). See the module docstring and docs/perseus.md §2.6.

    Args:
        num_nodes: Number of nodes; arcs index them from 0.
        tail: Tail node of each arc (integers).
        head: Head node of each arc.
        capacity: Finite, non-negative capacity of each arc.
        cost: Integer unit cost of each arc.

    Returns:
        The optimal flow and its exact total cost.

    Raises:
        PlanError: The extension is not built, the arrays are malformed, or the solver refused the
            instance (bad index, negative capacity, int64 overflow), with the reason in one line.
    """
    ext = _require_ext()
    tail_a, head_a, cap_a, cost_a = _arrays(num_nodes, tail, head, capacity, cost)
    flow = np.zeros(tail_a.shape[0], dtype=np.int64)
    _check(ext.solve(int(num_nodes), tail_a, head_a, cap_a, cost_a, flow), "min-cost circulation")
    return FlowResult(flow=flow, cost_total=int(ext.flow_cost(cost_a, flow)))


def potentials(
    num_nodes: int, tail: Any, head: Any, capacity: Any, cost: Any, flow: Any, source: int
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Shortest distances from ``source`` in the residual network of ``flow``.

    Residual arcs: ``tail -> head`` at ``cost`` where ``flow < capacity`` and ``head -> tail`` at
    ``-cost`` where ``flow > 0``. For an optimal flow there is no negative cycle, and ``-dist`` is
    an optimal dual (Fulkerson 1961): every residual arc has a non-negative reduced cost.

    Args:
        num_nodes: Number of nodes.
        tail: Tail node of each arc.
        head: Head node of each arc.
        capacity: Capacity of each arc.
        cost: Unit cost of each arc (original, unscaled).
        flow: Flow on each arc.
        source: The node distances are measured from.

    Returns:
        int64 distances, :data:`UNREACHABLE` where the source cannot reach.

    Raises:
        PlanError: The residual network has a negative cycle (the flow is not optimal), the input
            is malformed, or distances would overflow int64.
    """
    ext = _require_ext()
    tail_a, head_a, cap_a, cost_a = _arrays(num_nodes, tail, head, capacity, cost)
    flow_a = _as_int64("flow", flow, tail_a.shape[0])
    if not 0 <= source < num_nodes:
        raise PlanError(f"source {source} is not a node (0..{num_nodes - 1})")
    dist = np.empty(num_nodes, dtype=np.int64)
    status = ext.residual_distances(
        int(num_nodes), tail_a, head_a, cap_a, cost_a, flow_a, int(source), dist
    )
    _check(status, "residual distances")
    return dist


def certify(
    num_nodes: int, tail: Any, head: Any, capacity: Any, cost: Any, flow: Any, dist: Any
) -> None:
    """Check that ``flow`` is an optimal circulation and ``dist`` its residual distances.

    O(arcs) in numpy, independent of the solver: ``0 <= flow <= capacity``; inflow equals outflow
    at every node; and for every residual arc between nodes with finite distances, the reduced
    cost is non-negative: ``dist[head] <= dist[tail] + cost`` where ``flow < capacity`` and
    ``dist[tail] <= dist[head] - cost`` where ``flow > 0``. A feasible flow with such potentials
    satisfies complementary slackness, hence is optimal (Fulkerson 1961; Goldberg 1997 §2).
    Only the reachable part is certified: an arc with an unreachable end is skipped (a residual
    arc from a reachable node always reaches a reachable node, which is also checked).

    Args:
        num_nodes: Number of nodes.
        tail: Tail node of each arc.
        head: Head node of each arc.
        capacity: Capacity of each arc.
        cost: Unit cost of each arc.
        flow: The flow to certify.
        dist: Residual distances (:func:`potentials`), :data:`UNREACHABLE` where unreachable.

    Raises:
        PlanError: The first violated condition, naming the arc or node.
    """
    tail_a, head_a, cap_a, cost_a = _arrays(num_nodes, tail, head, capacity, cost)
    m = tail_a.shape[0]
    flow_a = _as_int64("flow", flow, m)
    dist_a = _as_int64("dist", dist, num_nodes)
    if m and (tail_a.min() < 0 or head_a.min() < 0 or max(tail_a.max(), head_a.max()) >= num_nodes):
        raise PlanError("certificate: an arc names a node out of range")

    bad = np.flatnonzero((flow_a < 0) | (flow_a > cap_a))
    if bad.size:
        i = int(bad[0])
        raise PlanError(
            f"certificate: arc {i} ({tail_a[i]} -> {head_a[i]}) carries {flow_a[i]} outside "
            f"[0, {cap_a[i]}]"
        )
    # Conservation, exactly: bincount's float64 weights would round above 2**53.
    inflow = np.zeros(num_nodes, dtype=np.int64)
    outflow = np.zeros(num_nodes, dtype=np.int64)
    np.add.at(inflow, head_a, flow_a)
    np.add.at(outflow, tail_a, flow_a)
    bad = np.flatnonzero(inflow != outflow)
    if bad.size:
        v = int(bad[0])
        raise PlanError(
            f"certificate: node {v} receives {inflow[v]} but sends {outflow[v]} (conservation)"
        )

    reach = dist_a != UNREACHABLE
    # A residual arc out of a reachable node must lead to a reachable node.
    forward = flow_a < cap_a
    backward = flow_a > 0
    leak = (forward & reach[tail_a] & ~reach[head_a]) | (backward & reach[head_a] & ~reach[tail_a])
    bad = np.flatnonzero(leak)
    if bad.size:
        i = int(bad[0])
        raise PlanError(
            f"certificate: arc {i} ({tail_a[i]} -> {head_a[i]}) is residual from a reachable "
            "node to one marked unreachable"
        )
    both = reach[tail_a] & reach[head_a]
    # Python ints would be exact but slow; distances are bounded by num_nodes * max |cost| and the
    # solver refuses instances where that overflows, so int64 differences are exact here.
    d_tail = np.where(both, dist_a[tail_a], 0)
    d_head = np.where(both, dist_a[head_a], 0)
    reduced = cost_a + d_tail - d_head
    bad_forward = both & forward & (reduced < 0)
    bad_backward = both & backward & (reduced > 0)
    bad = np.flatnonzero(bad_forward | bad_backward)
    if bad.size:
        i = int(bad[0])
        side = "forward" if bad_forward[i] else "backward"
        raise PlanError(
            f"certificate: arc {i} ({tail_a[i]} -> {head_a[i]}, flow {flow_a[i]} of "
            f"{cap_a[i]}) has {side} reduced cost {int(reduced[i])} of the wrong sign: the "
            "flow is not optimal or the distances are not shortest"
        )
