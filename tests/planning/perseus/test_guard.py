"""The slowdown guard: one exact-time flow, speed-ups for latency and noise (issue 34)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from perseus_cases import profile_or_skip

from powerlib import PlanError
from powerlib.planning.choice import Policy
from powerlib.planning.perseus import flow, guard, mincost
from powerlib.planning.perseus.frontier import Frontier, FrontierSettings, compute_frontier
from powerlib.planning.perseus.noise import TimeNoise
from powerlib.planning.perseus.replay import IncrementalReplay, replay_options
from powerlib.planning.schedules import build_schedule
from powerlib.planning.workflow import PlanRequest, plan_profile, wanted_for

pytestmark = pytest.mark.skipif(not mincost.available(), reason="flow extension not built")


def _frontier(name: str, stages: int = 8, microbatches: int = 12) -> Frontier:
    return compute_frontier(
        profile_or_skip(name),
        build_schedule("1f1b", stages, microbatches, 1),
        settings=FrontierSettings(unit_time_s=1e-3, p_block_w=83.64, solver="direct"),
        schedule_name="1f1b",
        num_microbatches=microbatches,
    )


def _limit(frontier: Frontier, limit_s: float | None, max_slowdown: float = 0.001) -> float:
    """The guard's limit: all-max's time, or the straggler's ``limit_s``, plus the slowdown."""
    reference_s = frontier.baseline_time_s if limit_s is None else limit_s
    return guard.guard_limit(reference_s, max_slowdown)


def _greedy(frontier: Frontier, latency: float, cv: float, limit_s: float | None = None):
    """The guard before issue 34: from the quantized point, one speed-up per replay."""
    point = frontier.fastest if limit_s is None else frontier.select("deadline", limit_s)
    noisy = guard._NoiseCheck(frontier.model, TimeNoise.iid(cv), 0.0, limit_s, 0.001) if cv > 0 else None
    limit = _limit(frontier, limit_s)
    start = frontier.planned_options(point)
    return guard._speed_up(frontier.model, start, limit, latency, noisy, batch=False)


@pytest.mark.parametrize("name", ["profile_gpt3-175b_a100_sxm.csv", "profile_bloom_a40.csv"])
def test_the_exact_start_realizes_within_the_limit_without_latency(name: str) -> None:
    frontier = _frontier(name)
    limit = guard.guard_limit(frontier.baseline_time_s, 0.001)
    start = guard.exact_start(frontier.model, limit)
    run = frontier.realized(start, 0.0)
    assert run.time_s <= limit
    # and spends the slack: within 0.2 % of the limit, unlike all-max
    assert run.time_s > limit * 0.998
    assert run.energy_j < frontier.baseline(run.time_s).energy_j


def test_the_exact_start_saves_what_the_greedy_leaves() -> None:
    """BLOOM A40 8 x 24: the greedy's plan realizes 0.8 % under the limit, the flow's at it."""
    frontier = _frontier("profile_bloom_a40.csv", microbatches=24)
    old = frontier.realized(_greedy(frontier, 0.005, 0.0), 0.005)
    new = frontier.realized(
        frontier.within_slowdown(frontier.fastest, switch_latency_s=0.005), 0.005
    )
    limit = guard.guard_limit(frontier.baseline_time_s, 0.001)
    assert old.time_s < limit * 0.995
    assert limit * 0.998 < new.time_s <= limit
    assert new.energy_j < old.energy_j * 0.99


@pytest.mark.parametrize("name", ["profile_gpt3-175b_a100_sxm.csv", "profile_bloom_a40.csv"])
@pytest.mark.parametrize("latency", [0.0, 0.005, 0.02])
@pytest.mark.parametrize("cv", [0.0, 0.02])
def test_the_guard_is_never_worse_than_the_greedy_and_within_the_limit(
    name: str, latency: float, cv: float
) -> None:
    frontier = _frontier(name, microbatches=4)
    for deadline in (None, frontier.baseline_time_s * 1.05):
        if deadline is not None:
            frontier = frontier.extend(wanted_for(Policy(name="deadline", deadline_s=deadline)))
        point = frontier.fastest if deadline is None else frontier.select("deadline", deadline)
        ours = frontier.within_slowdown(
            point, switch_latency_s=latency, limit_s=deadline, time_cv=cv
        )
        old = _greedy(frontier, latency, cv, deadline)
        got = frontier.realized(ours, latency)
        assert got.time_s <= _limit(frontier, deadline) * (1 + 1e-12)
        # under a straggler the iteration lasts the deadline whatever the plan
        ours_j = guard.held_energy_j(frontier.model, ours, latency, deadline)
        assert ours_j <= guard.held_energy_j(frontier.model, old, latency, deadline) * (1 + 1e-12)


def test_the_exact_start_alone_meets_the_limit_with_latency(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Above BOTH_STARTS_MAX_NODES only the exact start runs; its speed-ups cover the latency."""
    monkeypatch.setattr(guard, "BOTH_STARTS_MAX_NODES", 0)
    frontier = _frontier("profile_gpt3-175b_a100_sxm.csv")
    for latency in (0.005, 0.02):
        chosen = frontier.within_slowdown(frontier.fastest, switch_latency_s=latency)
        assert frontier.realized(chosen, latency).time_s <= guard.guard_limit(
            frontier.baseline_time_s, 0.001
        )


def test_a_failed_certificate_is_an_error_never_a_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    frontier = _frontier("profile_gpt3-175b_a100_sxm.csv", microbatches=4)
    real = mincost.potentials

    def off_by_one(*args, **kwargs):
        dist = real(*args, **kwargs).copy()
        dist[5] -= 1  # one event one unit early: a residual arc now has a negative reduced cost
        return dist

    monkeypatch.setattr(mincost, "potentials", off_by_one)
    with pytest.raises(PlanError, match="certificate"):
        guard.exact_start(frontier.model, guard.guard_limit(frontier.baseline_time_s, 0.001))


def test_without_the_extension_the_guard_is_the_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    frontier = _frontier("profile_gpt3-175b_a100_sxm.csv", microbatches=4)
    monkeypatch.setattr(guard, "available", lambda: False)
    chosen = frontier.within_slowdown(frontier.fastest, switch_latency_s=0.02)
    assert chosen == _greedy(frontier, 0.02, 0.0)


def test_the_plan_workflow_solves_the_guard_beside_the_points() -> None:
    policy = Policy(name="fastest", switch_latency_s=0.005)
    result = plan_profile(
        profile_or_skip("profile_gpt3-175b_a100_sxm.csv"),
        PlanRequest(
            num_stages=8,
            num_microbatches=12,
            p_block_w=83.64,
            unit_time_s=1e-3,
            policy=policy.name,
            switch_latency_s=policy.switch_latency_s,
            solver="direct",
        ),
    )
    frontier = result.frontier
    limit = guard.guard_limit(frontier.baseline_time_s, policy.max_slowdown)
    assert list(frontier.direct.guard_starts) == [(limit, False)]
    got = frontier.direct.guard_starts[(limit, False)].result()
    assert got == guard.exact_start(frontier.model, limit)
    frontier.direct.guard_starts.clear()
    again = frontier.within_slowdown(frontier.fastest, switch_latency_s=0.005)
    assert list(result.choice.options) == again


@pytest.mark.parametrize("request_ahead_s", [None, 0.03])
def test_set_many_equals_one_full_replay(request_ahead_s: float | None) -> None:
    """Also with switches up requested ahead (issue 45): a change then also re-times the
    instruction before it (its tail runs at the faster clock)."""
    frontier = _frontier("profile_gpt3-175b_a100_sxm.csv", microbatches=8)
    model = dataclasses.replace(frontier.model, request_ahead_s=request_ahead_s)
    chosen = frontier.planned_options(frontier.fastest)
    replay = IncrementalReplay(model, chosen, 0.02)
    full = replay_options(model, chosen, 0.02)
    assert (replay.run().time_s, replay.run().energy_j) == (full.time_s, full.energy_j)
    rng = np.random.default_rng(1)
    for _ in range(5):
        moves = []
        for v in rng.choice(len(chosen), size=7, replace=False):
            ins = frontier.dag.instructions[int(v)]
            options = frontier.options[(ins.stage, ins.kind)]
            moves.append((int(v), options[int(rng.integers(len(options)))]))
        replay.set_many(moves)
        for v, option in moves:
            chosen[v] = option
        full = replay_options(model, chosen, 0.02)
        got = replay.run()
        assert (got.time_s, got.energy_j) == (full.time_s, full.energy_j)


def test_capacities_shrink_below_nanojoules_where_int64_needs_it() -> None:
    assert flow.capacity_scale(10.0, 100, "x") == 1e9
    small = flow.capacity_scale(1e6, 200_000, "x")
    assert small < 1e9
    assert 1e6 * small * 200_002 <= 2.0**62
    with pytest.raises(PlanError, match="too large"):
        flow.capacity_scale(1e30, 200_000, "the slopes")
    # one activity whose capacity times its unbounded arcs passes int64
    crash = [(np.array([2**61], dtype=np.int64), np.array([-5], dtype=np.int64))] * 2
    with pytest.raises(PlanError, match="too large"):
        flow.ActivityNetwork.build([[], [0]], [[1], []], crash, np.array([1, 1]), 0)


def test_under_a_straggler_the_guard_spends_the_deadline() -> None:
    """``deadline``: ending early saves nothing (the straggler holds the iteration), so the
    exact start spends the slack up to the deadline instead of paying for a faster plan."""
    frontier = _frontier("profile_gpt3-175b_a100_sxm.csv")
    deadline = frontier.baseline_time_s * 1.15
    limit = guard.guard_limit(deadline, 0.001)
    held = guard.exact_start(frontier.model, limit, held=True)
    free = guard.exact_start(frontier.model, limit)
    assert frontier.realized(held, 0.0).time_s > limit * 0.995
    assert frontier.realized(free, 0.0).time_s <= frontier.realized(held, 0.0).time_s
    assert guard.held_energy_j(frontier.model, held, 0.0, deadline) <= guard.held_energy_j(
        frontier.model, free, 0.0, deadline
    )
    assert frontier.realized(free, 0.0).energy_j <= frontier.realized(held, 0.0).energy_j
