"""The min-cost circulation solve of a fixed-makespan point against HiGHS and by hand."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from powerlib.errors import BackendUnavailableError, PlanError
from powerlib.planning.perseus import mincost
from powerlib.planning.perseus.cost_model import TableCostModel, build_cost_model
from powerlib.planning.perseus.options import prepare_options
from powerlib.planning.perseus.solver import PhillipsDessouky
from powerlib.planning.pipeline import KINDS, build_dag, build_schedule
from powerlib.planning.profile import Profile

pytest.importorskip(
    "powerlib.planning.perseus._mincost",
    reason="the C++ min-cost flow extension was not built (pip install -e . with a C++ compiler)",
)

from powerlib.planning.perseus.flow import FlowSolver  # noqa: E402

SOSP = Path("/work/shared/perseus_validation/sosp24_emulation")
REPO_PROFILES = Path(__file__).resolve().parents[2] / "data" / "lowtime_frontiers" / "profiles"


def _direct_solver():
    """DirectSolver, or a skip when highspy (extra ``fast``) is missing."""
    pytest.importorskip("highspy", reason="HiGHS (highspy, extra 'fast') is the reference")
    from powerlib.planning.perseus.direct import DirectSolver  # noqa: PLC0415

    return DirectSolver


def _profile(name: str) -> Profile:
    for folder in (SOSP, REPO_PROFILES):
        if (folder / name).exists():
            return Profile.read(folder / name)
    pytest.skip(f"{name} not available")


def _random_case(rng: random.Random) -> tuple[int, list[tuple[int, int]], list[TableCostModel]]:
    """A random DAG of convex, non-increasing cost tables (as in test_direct.py)."""
    n = rng.randint(2, 14)
    edges = [(u, v) for v in range(n) for u in range(v) if rng.random() < 0.3]
    models = []
    for _ in range(n):
        q_min = rng.randint(1, 4)
        q_max = q_min + rng.randint(0, 6)
        cost, table = rng.uniform(0, 5), {}
        slopes = sorted((rng.uniform(0, 4) for _ in range(q_max - q_min)), reverse=True)
        table[q_max] = cost
        for q, slope in zip(range(q_max - 1, q_min - 1, -1), reversed(slopes)):
            cost += slope
            table[q] = cost
        models.append(TableCostModel(table))
    return n, edges, models


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
    n, edges, models = _random_case(random.Random(seed))
    walk = PhillipsDessouky(n, edges, models)
    t_min, t_max = walk.fastest_makespan(), walk.makespan([t.q_max for t in walk.tables])
    _assert_same_as_highs(walk, list(range(t_min, t_max + 2)))


@pytest.mark.parametrize("seed", range(10))
def test_random_dags_equal_the_walk(seed: int) -> None:
    n, edges, models = _random_case(random.Random(100 + seed))
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
    profile = _profile("profile_gpt3-175b_a100_sxm.csv")
    walk = _walk_of_profile(profile, schedule, stages, microbatches, chunks)
    t_min, t_max = walk.fastest_makespan(), walk.makespan([t.q_max for t in walk.tables])
    assert t_max > t_min
    deadlines = sorted({t_min + (t_max - t_min) * k // 4 for k in (1, 2, 3)})
    _assert_same_as_highs(walk, [t_min, *deadlines])


def test_a_makespan_below_t_min_is_refused() -> None:
    n, edges, models = _random_case(random.Random(3))
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
    n, edges, models = _random_case(random.Random(4))
    monkeypatch.setattr(mincost, "available", lambda: False)
    with pytest.raises(BackendUnavailableError, match="min-cost flow"):
        FlowSolver(PhillipsDessouky(n, edges, models))
