"""The compiled min-cost circulation solver, its residual distances and its certificate."""

from __future__ import annotations

import numpy as np
import pytest

from powerlib.errors import PlanError

pytest.importorskip(
    "powerlib.planning.perseus._mincost",
    reason="the C++ extension was not built (pip install -e . with a C++ compiler)",
)
scipy_optimize = pytest.importorskip("scipy.optimize")
scipy_sparse = pytest.importorskip("scipy.sparse")

from powerlib.planning.perseus import mincost  # noqa: E402


def random_network(rng: np.random.Generator, num_nodes: int, num_arcs: int):
    """Random arcs plus a return arc of very negative cost, so the optimum circulates flow."""
    tail = rng.integers(0, num_nodes, num_arcs)
    head = rng.integers(0, num_nodes, num_arcs)
    capacity = rng.integers(0, 20, num_arcs)
    cost = rng.integers(-10, 40, num_arcs)
    tail = np.append(tail, num_nodes - 1)
    head = np.append(head, 0)
    capacity = np.append(capacity, 60)
    cost = np.append(cost, -200)
    return tail, head, capacity, cost


def linprog_cost(num_nodes, tail, head, capacity, cost) -> float:
    m = len(tail)
    rows = np.concatenate([head, tail])
    cols = np.concatenate([np.arange(m), np.arange(m)])
    vals = np.concatenate([np.ones(m), -np.ones(m)])
    a_eq = scipy_sparse.coo_matrix((vals, (rows, cols)), shape=(num_nodes, m))
    res = scipy_optimize.linprog(
        cost,
        A_eq=a_eq,
        b_eq=np.zeros(num_nodes),
        bounds=list(zip(np.zeros(m), capacity)),
        method="highs",
    )
    assert res.status == 0, res.message
    return float(res.fun)


def test_extension_is_built() -> None:
    assert mincost.available()


@pytest.mark.parametrize("seed", range(40))
def test_cost_matches_highs_and_certifies(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_nodes = int(rng.integers(5, 41))
    tail, head, capacity, cost = random_network(
        rng, num_nodes, int(rng.integers(num_nodes, 5 * num_nodes))
    )
    result = mincost.min_cost_circulation(num_nodes, tail, head, capacity, cost)
    expected = linprog_cost(num_nodes, tail, head, capacity, cost)
    assert result.cost_total == round(expected)
    assert result.cost_total == int(np.dot(result.flow, cost))
    dist = mincost.potentials(num_nodes, tail, head, capacity, cost, result.flow, 0)
    mincost.certify(num_nodes, tail, head, capacity, cost, result.flow, dist)


def test_nontrivial_cycle_is_found() -> None:
    # 0 -> 1 -> 2 -> 0 with total cost -1 per unit, bottleneck 3; a parallel dearer path 0 -> 2.
    tail = [0, 1, 2, 0]
    head = [1, 2, 0, 2]
    capacity = [5, 3, 10, 10]
    cost = [1, 2, -4, 5]
    result = mincost.min_cost_circulation(3, tail, head, capacity, cost)
    assert result.flow.tolist() == [3, 3, 3, 0]
    assert result.cost_total == -3


def test_self_loops_and_isolated_nodes() -> None:
    result = mincost.min_cost_circulation(4, [1, 2], [1, 2], [7, 7], [-2, 3])
    assert result.flow.tolist() == [7, 0]
    assert result.cost_total == -14


def test_certify_rejects_tampered_flow() -> None:
    rng = np.random.default_rng(7)
    num_nodes = 20
    tail, head, capacity, cost = random_network(rng, num_nodes, 80)
    result = mincost.min_cost_circulation(num_nodes, tail, head, capacity, cost)
    dist = mincost.potentials(num_nodes, tail, head, capacity, cost, result.flow, 0)
    flow = result.flow.copy()
    i = int(np.flatnonzero((flow > 0) & (tail != head))[0])
    flow[i] -= 1  # one unit off an arc: its tail now sends less than it receives
    with pytest.raises(PlanError, match="conservation"):
        mincost.certify(num_nodes, tail, head, capacity, cost, flow, dist)


def test_certify_rejects_flow_over_capacity() -> None:
    with pytest.raises(PlanError, match=r"arc 1 .* outside \[0, 2\]"):
        mincost.certify(2, [0, 1], [1, 0], [5, 2], [1, 1], [3, 3], [0, 1])


def test_certify_rejects_suboptimal_feasible_flow() -> None:
    # Zero flow is feasible, but the cycle 0 -> 1 -> 0 has cost -1: some reduced cost must fail.
    tail, head, capacity, cost = [0, 1], [1, 0], [4, 4], [2, -3]
    zero = np.zeros(2, dtype=np.int64)
    with pytest.raises(PlanError, match="negative cycle"):
        mincost.potentials(2, tail, head, capacity, cost, zero, 0)
    # Any distances a caller might pass for it (here the plain shortest path ones) are refused.
    dist = np.array([0, 2], dtype=np.int64)
    with pytest.raises(PlanError, match="reduced cost"):
        mincost.certify(2, tail, head, capacity, cost, zero, dist)
    # The optimum passes.
    result = mincost.min_cost_circulation(2, tail, head, capacity, cost)
    assert result.flow.tolist() == [4, 4]
    dist = mincost.potentials(2, tail, head, capacity, cost, result.flow, 0)
    mincost.certify(2, tail, head, capacity, cost, result.flow, dist)


def test_certify_rejects_zero_flow_on_random_network() -> None:
    rng = np.random.default_rng(3)
    num_nodes = 15
    tail, head, capacity, cost = random_network(rng, num_nodes, 60)
    optimum = mincost.min_cost_circulation(num_nodes, tail, head, capacity, cost)
    assert optimum.cost_total < 0  # so the zero flow is feasible but not optimal
    zero = np.zeros(len(tail), dtype=np.int64)
    dist = mincost.potentials(num_nodes, tail, head, capacity, cost, optimum.flow, 0)
    with pytest.raises(PlanError, match="reduced cost"):
        mincost.certify(num_nodes, tail, head, capacity, cost, zero, dist)


def test_unreachable_nodes_get_int64_max() -> None:
    result = mincost.min_cost_circulation(3, [0, 1], [1, 0], [1, 1], [1, 1])
    dist = mincost.potentials(3, [0, 1], [1, 0], [1, 1], [1, 1], result.flow, 0)
    assert dist.tolist() == [0, 1, mincost.UNREACHABLE]


def test_overflow_sized_costs_are_refused() -> None:
    with pytest.raises(PlanError, match="int64 headroom"):
        mincost.min_cost_circulation(3, [0, 1, 2], [1, 2, 0], [1, 1, 1], [2**61, 0, -(2**61)])


def test_overflow_sized_capacities_are_refused() -> None:
    cap = 2**62
    with pytest.raises(PlanError, match="int64 headroom"):
        mincost.min_cost_circulation(2, [0, 1, 0], [1, 0, 1], [cap, cap, cap], [1, -2, 1])


def test_bad_node_index_is_refused() -> None:
    with pytest.raises(PlanError, match="out of range"):
        mincost.min_cost_circulation(2, [0, 5], [1, 0], [1, 1], [1, 1])


def test_twenty_thousand_arcs_solve_and_certify() -> None:
    rng = np.random.default_rng(11)
    num_nodes, num_arcs = 2_000, 20_000
    tail = rng.integers(0, num_nodes, num_arcs)
    head = rng.integers(0, num_nodes, num_arcs)
    capacity = rng.integers(0, 1_000, num_arcs)
    cost = rng.integers(-100, 1_000, num_arcs)
    result = mincost.min_cost_circulation(num_nodes, tail, head, capacity, cost)
    assert result.cost_total < 0
    for source in (0, num_nodes // 2):
        dist = mincost.potentials(num_nodes, tail, head, capacity, cost, result.flow, source)
        mincost.certify(num_nodes, tail, head, capacity, cost, result.flow, dist)
