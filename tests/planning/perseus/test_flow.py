"""The min-cost circulation solve of fixed-makespan and ``T*`` points against HiGHS and by hand."""

from __future__ import annotations

import random

import numpy as np
import pytest
from perseus_cases import profile_or_skip, random_case

from powerlib.errors import BackendUnavailableError, PlanError
from powerlib.planning.perseus import mincost
from powerlib.planning.perseus.cost_model import TableCostModel, build_cost_model
from powerlib.planning.perseus.frequency_options import prepare_options
from powerlib.planning.perseus.solver import PhillipsDessouky
from powerlib.planning.pipeline import KINDS, build_dag
from powerlib.planning.profile import Profile
from powerlib.planning.schedules import build_schedule

pytest.importorskip(
    "powerlib.planning.perseus._mincost",
    reason="the C++ min-cost flow extension was not built (pip install -e . with a C++ compiler)",
)

from powerlib.planning.perseus.flow import FlowSolver  # noqa: E402


def _direct_solver():
    """DirectSolver, or a skip when highspy (extra ``fast``) is missing."""
    pytest.importorskip("highspy", reason="HiGHS (highspy, extra 'fast') is the reference")
    from powerlib.planning.perseus.direct import DirectSolver

    return DirectSolver


def _walk_of_profile(
    profile: Profile, schedule: str, stages: int, microbatches: int, chunks: int
) -> PhillipsDessouky:
    """The planner's DAG and cost tables, built as compute_frontier builds them."""
    dag = build_dag(build_schedule(schedule, stages, microbatches, chunks), "looped")
    used = {(ins.stage, ins.kind) for ins in dag.instructions}
    models = {}
    for stage in range(dag.num_stages):
        for kind in (k for k in KINDS if (stage, k) in used):
            opts = prepare_options(
                profile.options(stage, kind),
                unit_time_s=2e-3,
                p_block_w=83.64,
                order="filter-then-subtract",
            )
            models[(stage, kind)] = build_cost_model(opts, kind="exp", unit_time_s=2e-3)
    costs = [models[(ins.stage, ins.kind)] for ins in dag.instructions]
    return PhillipsDessouky(len(dag.instructions), dag.edges, costs)


def _assert_same_as_highs(walk: PhillipsDessouky, times: list[int]) -> None:
    direct = _direct_solver()(walk)
    flow = FlowSolver(walk)
    assert (flow.t_min, flow.t_max) == (direct.t_min, direct.t_max)
    for t in times:
        want, got = direct.at(t), flow.at(t)
        assert got.quant_time == t
        assert got.cost == pytest.approx(want.cost, rel=1e-9, abs=1e-12)
        assert got.cost == pytest.approx(walk.total_cost(list(got.durations)), rel=0, abs=0)
        assert walk.makespan(list(got.durations)) <= t
        for table, q in zip(walk.tables, got.durations):
            assert table.q_min <= q <= table.q_max


def test_two_activities_in_series_by_hand() -> None:
    # a: crash 3 -> 2 costs 4, 2 -> 1 costs 6; b: 3 -> 2 costs 2, 2 -> 1 costs 3.
    a = TableCostModel({1: 10.0, 2: 4.0, 3: 0.0})
    b = TableCostModel({1: 5.0, 2: 2.0, 3: 0.0})
    flow = FlowSolver(PhillipsDessouky(2, [(0, 1)], [a, b]))
    assert (flow.t_min, flow.t_max) == (2, 6)
    expected = {6: ((3, 3), 0.0), 5: ((3, 2), 2.0), 4: ((3, 1), 5.0), 3: ((2, 1), 9.0)}
    expected[2] = ((1, 1), 15.0)
    for t, (durations, cost) in expected.items():
        got = flow.at(t)
        assert (got.durations, got.cost) == (durations, cost)
    # past T_max every activity stays at q_max (lengthened into the slack)
    assert flow.at(9).durations == (3, 3)


def test_parallel_activities_crash_together() -> None:
    # two parallel chains share the makespan: at T = 2 both must crash, at T = 3 neither.
    a = TableCostModel({2: 7.0, 3: 1.0})
    flow = FlowSolver(PhillipsDessouky(2, [], [a, a]))
    assert flow.at(2).durations == (2, 2) and flow.at(2).cost == 14.0
    assert flow.at(3).durations == (3, 3) and flow.at(3).cost == 2.0


@pytest.mark.parametrize("seed", range(40))
def test_random_dags_equal_highs_at_every_makespan(seed: int) -> None:
    n, edges, models = random_case(random.Random(seed))
    walk = PhillipsDessouky(n, edges, models)
    t_min, t_max = walk.fastest_makespan(), walk.makespan([t.q_max for t in walk.tables])
    _assert_same_as_highs(walk, list(range(t_min, t_max + 2)))


@pytest.mark.parametrize("seed", range(10))
def test_random_dags_equal_the_walk(seed: int) -> None:
    n, edges, models = random_case(random.Random(100 + seed))
    walk = PhillipsDessouky(n, edges, models)
    flow = FlowSolver(walk)
    for step in PhillipsDessouky(n, edges, models).run():
        got = flow.at(step.quant_time)
        assert got.cost == pytest.approx(step.cost, rel=1e-9, abs=1e-9)
        assert walk.makespan(list(got.durations)) <= step.quant_time


@pytest.mark.parametrize(
    ("schedule", "stages", "microbatches", "chunks"),
    [("1f1b", 4, 6, 1), ("gpipe", 4, 4, 1), ("interleaved", 4, 4, 2), ("1f1b", 8, 8, 1)],
)
def test_gpt3_a100_profile_equals_highs(
    schedule: str, stages: int, microbatches: int, chunks: int
) -> None:
    profile = profile_or_skip("profile_gpt3-175b_a100_sxm.csv")
    walk = _walk_of_profile(profile, schedule, stages, microbatches, chunks)
    t_min, t_max = walk.fastest_makespan(), walk.makespan([t.q_max for t in walk.tables])
    assert t_max > t_min
    deadlines = sorted({t_min + (t_max - t_min) * k // 4 for k in (1, 2, 3)})
    _assert_same_as_highs(walk, [t_min, *deadlines])


def test_a_makespan_below_t_min_is_refused() -> None:
    n, edges, models = random_case(random.Random(3))
    walk = PhillipsDessouky(n, edges, models)
    with pytest.raises(PlanError, match="below the fastest"):
        FlowSolver(walk).at(walk.fastest_makespan() - 1)


def test_a_failed_certificate_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    a = TableCostModel({1: 10.0, 2: 4.0, 3: 0.0})
    b = TableCostModel({1: 5.0, 2: 2.0, 3: 0.0})
    flow = FlowSolver(PhillipsDessouky(2, [(0, 1)], [a, b]))
    real = mincost.potentials

    def shifted(*args: object) -> np.ndarray:
        dist = real(*args)
        dist[2] += 1  # activity 0's start event: no longer a shortest distance
        return dist

    monkeypatch.setattr(mincost, "potentials", shifted)
    with pytest.raises(PlanError, match="certificate"):
        flow.at(4)


def test_without_the_extension_the_solver_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    n, edges, models = random_case(random.Random(4))
    monkeypatch.setattr(mincost, "available", lambda: False)
    with pytest.raises(BackendUnavailableError, match="min-cost flow"):
        FlowSolver(PhillipsDessouky(n, edges, models))


# -- cheapest: minimum of Σ cost + w · T over a range of makespans, in one circulation -----------

#: Blocking power per GPU (W) and the quantum (s) that _walk_of_profile plans with.
_P_BLOCK_W = 83.64
_UNIT_TIME_S = 2e-3


def _assert_cheapest_same_as_highs(
    walk: PhillipsDessouky, w: float, ranges: list[tuple[int, int]]
) -> None:
    direct = _direct_solver()(walk, time_cost_per_quantum=w)
    flow = FlowSolver(walk, time_cost_per_quantum=w)
    for lo, hi in ranges:
        want, got = direct.cheapest(lo, hi), flow.cheapest(lo, hi)
        assert max(lo, flow.t_min) <= got.quant_time <= hi
        assert got.cost + w * got.quant_time == pytest.approx(
            want.cost + w * want.quant_time, rel=1e-9, abs=1e-12
        )
        assert got.cost == pytest.approx(walk.total_cost(list(got.durations)), rel=0, abs=0)
        assert walk.makespan(list(got.durations)) <= got.quant_time
        for table, q in zip(walk.tables, got.durations):
            assert table.q_min <= q <= table.q_max


def test_cheapest_two_activities_in_series_by_hand() -> None:
    # Σ cost at T = 2 .. 6 is 15, 9, 5, 2, 0 (test_two_activities_in_series_by_hand).
    a = TableCostModel({1: 10.0, 2: 4.0, 3: 0.0})
    b = TableCostModel({1: 5.0, 2: 2.0, 3: 0.0})
    walk = PhillipsDessouky(2, [(0, 1)], [a, b])
    # w -> (T*, durations): w = 1: 6 + 6 at T = 6; w = 5: 9 + 15 at T = 3; w = 7: 15 + 14 at 2.
    expected = {1.0: (6, (3, 3)), 5.0: (3, (2, 1)), 7.0: (2, (1, 1)), 100.0: (2, (1, 1))}
    for w, (t, durations) in expected.items():
        got = FlowSolver(walk, time_cost_per_quantum=w).cheapest(0, 9)
        assert (got.quant_time, got.durations) == (t, durations)
        assert got.cost == walk.total_cost(list(durations))
    # ties take the fastest optimal T: w = 3 costs 17 at T = 4 and at T = 5; w = 0 is flat past 6
    assert FlowSolver(walk, time_cost_per_quantum=3.0).cheapest(2, 9).quant_time == 4
    assert FlowSolver(walk, time_cost_per_quantum=0.0).cheapest(2, 9).quant_time == 6
    # the range binds: w = 1 would go to 6, w = 7 to 2
    assert FlowSolver(walk, time_cost_per_quantum=1.0).cheapest(2, 4).durations == (3, 1)
    assert FlowSolver(walk, time_cost_per_quantum=7.0).cheapest(4, 9).quant_time == 4
    assert FlowSolver(walk, time_cost_per_quantum=7.0).cheapest(5, 5).durations == (3, 2)
    # at() ignores w
    assert FlowSolver(walk, time_cost_per_quantum=100.0).at(5).durations == (3, 2)


@pytest.mark.parametrize("seed", range(40))
def test_random_dags_cheapest_equals_highs(seed: int) -> None:
    n, edges, models = random_case(random.Random(seed))
    walk = PhillipsDessouky(n, edges, models)
    t_min, t_max = walk.fastest_makespan(), walk.makespan([t.q_max for t in walk.tables])
    mid = (t_min + t_max) // 2
    ranges = [(t_min, t_max + 2), (0, mid), (mid, t_max), (mid, mid), (t_max + 1, t_max + 3)]
    for w in (0.0, 0.05, 0.7, 2.0, 50.0):
        _assert_cheapest_same_as_highs(walk, w, ranges)


@pytest.mark.parametrize(
    ("schedule", "stages", "microbatches", "chunks"),
    [("1f1b", 4, 6, 1), ("gpipe", 4, 4, 1), ("interleaved", 4, 4, 2), ("1f1b", 8, 8, 1)],
)
def test_gpt3_a100_profile_cheapest_equals_highs(
    schedule: str, stages: int, microbatches: int, chunks: int
) -> None:
    profile = profile_or_skip("profile_gpt3-175b_a100_sxm.csv")
    walk = _walk_of_profile(profile, schedule, stages, microbatches, chunks)
    t_min, t_max = walk.fastest_makespan(), walk.makespan([t.q_max for t in walk.tables])
    w = stages * _P_BLOCK_W * _UNIT_TIME_S  # N · P_block · τ, as frontier.py gives DirectSolver
    mid = (t_min + t_max) // 2
    _assert_cheapest_same_as_highs(walk, w, [(t_min, t_max), (t_min, mid), (mid, t_max)])
    # T* lies strictly inside the frontier here: the blocking power matters
    t_star = FlowSolver(walk, time_cost_per_quantum=w).cheapest(t_min, t_max).quant_time
    assert t_min < t_star < t_max


@pytest.mark.parametrize("seed", range(5))
def test_solve_points_by_flow_equals_highs(seed: int) -> None:
    pytest.importorskip("highspy", reason="HiGHS (highspy, extra 'fast') is the reference")
    from powerlib.planning.perseus.direct import solve_points

    n, edges, models = random_case(random.Random(200 + seed))
    walk = PhillipsDessouky(n, edges, models)
    t_min, t_max = walk.fastest_makespan(), walk.makespan([t.q_max for t in walk.tables])
    kwargs = {
        "times": [t_max, t_min, (t_min + t_max) // 2, t_min],
        "cheapest": [(t_min, t_max), (0, t_max + 1), (t_min, t_max)],
        "time_cost_per_quantum": 0.6,
    }
    want_at, want_best = solve_points(walk, **kwargs)
    got_at, got_best = solve_points(walk, solver_class=FlowSolver, **kwargs)
    assert got_at.keys() == want_at.keys() and got_best.keys() == want_best.keys()
    for t, want in want_at.items():
        assert got_at[t].quant_time == t
        assert got_at[t].cost == pytest.approx(want.cost, rel=1e-9, abs=1e-12)
    for rng, want in want_best.items():
        got = got_best[rng]
        assert got.cost + 0.6 * got.quant_time == pytest.approx(
            want.cost + 0.6 * want.quant_time, rel=1e-9, abs=1e-12
        )


def test_cheapest_refuses_an_empty_range_and_a_negative_time_cost() -> None:
    n, edges, models = random_case(random.Random(5))
    walk = PhillipsDessouky(n, edges, models)
    with pytest.raises(PlanError, match="no makespan"):
        FlowSolver(walk, time_cost_per_quantum=1.0).cheapest(0, walk.fastest_makespan() - 1)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(PlanError, match="time cost"):
            FlowSolver(walk, time_cost_per_quantum=bad)
