"""The direct solve (one LP per point) against the Phillips-Dessouky walk, and the fast guard."""

from __future__ import annotations

import dataclasses
import random

import pytest
from perseus_cases import profile_or_skip, random_case

from powerlib import PlanError
from powerlib.planning.choice import Policy, choose
from powerlib.planning.perseus import guard
from powerlib.planning.perseus.direct import DirectSolver
from powerlib.planning.perseus.frontier import FrontierSettings, compute_frontier
from powerlib.planning.perseus.points import Wanted, deadline_quant, sweep_quants
from powerlib.planning.perseus.replay import layout_of, replay_options
from powerlib.planning.perseus.solver import PhillipsDessouky
from powerlib.planning.schedules import build_schedule

pytest.importorskip("highspy")


@pytest.mark.parametrize("seed", range(40))
def test_random_dags_give_the_walks_costs_at_every_makespan(seed: int) -> None:
    n, edges, models = random_case(random.Random(seed))
    walk = PhillipsDessouky(n, edges, models)
    steps = list(PhillipsDessouky(n, edges, models).run())
    direct = DirectSolver(walk, time_cost_per_quantum=0.7)
    for step in steps:
        got = direct.at(step.quant_time)
        assert got.cost == pytest.approx(step.cost, rel=1e-9, abs=1e-9)
        assert walk.makespan(list(got.durations)) <= step.quant_time
    if steps:
        best = min(steps, key=lambda s: (s.cost + 0.7 * s.quant_time, -s.quant_time))
        got = direct.cheapest(direct.t_min, steps[0].quant_time)
        assert got.cost + 0.7 * got.quant_time == pytest.approx(
            best.cost + 0.7 * best.quant_time, rel=1e-9, abs=1e-9
        )


def test_a_makespan_below_t_min_is_refused() -> None:
    n, edges, models = random_case(random.Random(3))
    walk = PhillipsDessouky(n, edges, models)
    with pytest.raises(PlanError, match="below the fastest"):
        DirectSolver(walk).at(walk.fastest_makespan() - 1)


def test_a_fractional_solution_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    n, edges, models = random_case(random.Random(5))
    direct = DirectSolver(PhillipsDessouky(n, edges, models))
    real = direct._h.getSolution

    class Fake:
        def __init__(self) -> None:
            values = list(real().col_value)
            values[-1] = 0.5
            self.col_value = values

    monkeypatch.setattr(direct._h, "getSolution", Fake)
    with pytest.raises(PlanError, match="fractional"):
        direct.at(direct.t_min)


SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)]


@pytest.mark.parametrize(("schedule", "chunks"), SCHEDULES)
def test_published_profile_direct_points_equal_the_walk(schedule: str, chunks: int) -> None:
    profile = profile_or_skip("profile_gpt3-175b_a100_sxm.csv")
    kw = dict(schedule_name=schedule, num_microbatches=8, num_chunks=chunks)
    settings = FrontierSettings(p_block_w=83.64, unit_time_s=2e-3)
    sched = build_schedule(schedule, 8, 8, chunks)
    walk = compute_frontier(profile, sched, settings=settings, **kw)
    deadline = (walk.fastest.time_s + walk.points[0].time_s) / 2
    direct = compute_frontier(
        profile,
        sched,
        settings=dataclasses.replace(settings, solver="direct"),
        wanted=Wanted(deadlines_s=(deadline,), argmin_deadlines_s=(deadline,), sweep=9),
        **kw,
    )
    assert not direct.complete and walk.complete
    by_quant = {p.quant_time: p for p in walk.points}
    for p in direct.points:
        ref = by_quant[p.quant_time]
        assert p.energy_j == pytest.approx(ref.energy_j, rel=1e-9)
        assert p.iteration == ref.iteration
    for name, d, argmin in [
        ("fastest", None, False),
        ("deadline", deadline, False),
        ("deadline", deadline, True),
        ("min-energy", None, False),
    ]:
        a, b = walk.select(name, d, argmin=argmin), direct.select(name, d, argmin=argmin)
        assert a.quant_time == b.quant_time
        assert a.energy_j == pytest.approx(b.energy_j, rel=1e-9)
        pa, pb = (
            choose(walk, Policy(name=name, deadline_s=d, argmin=argmin)),
            choose(direct, Policy(name=name, deadline_s=d, argmin=argmin)),
        )
        if a.durations == b.durations:  # equal-cost ties may pick other durations
            assert pa.options == pb.options
        assert pb.realized.time_s == pytest.approx(pa.realized.time_s, rel=1e-9)
    # a point that was not solved is not made up
    have = {p.quant_time for p in direct.points}
    missing = next(q for q in range(walk.fastest.quant_time, 10**9) if q not in have)
    other = (missing + 0.5) * 2e-3
    with pytest.raises(PlanError, match="without the point"):
        direct.select("deadline", other)
    more = direct.extend(Wanted(deadlines_s=(other,)))
    assert len(more.points) == len(direct.points) + 1
    assert more.select("deadline", other).energy_j == pytest.approx(
        by_quant[missing].energy_j, rel=1e-9
    )


def test_kareus_style_candidates_solve_directly() -> None:
    rng = random.Random(7)
    candidates = {}
    for stage in range(3):
        for kind in ("forward", "backward"):
            base = 0.02 if kind == "forward" else 0.04
            opts = []
            for f in (1410, 1300, 1200, 1100, 1000, 900, 800):
                t = base * 1410 / f * rng.uniform(0.98, 1.02)
                opts.append((f, t, t * (80 + f / 10), None))
            candidates[(stage, kind)] = opts
    kw = dict(schedule_name="1f1b", num_microbatches=6, candidates=candidates)
    settings = FrontierSettings(p_block_w=60.0, unit_time_s=1e-3)
    sched = build_schedule("1f1b", 3, 6)
    walk = compute_frontier(None, sched, settings=settings, **kw)
    direct = compute_frontier(
        None, sched, settings=dataclasses.replace(settings, solver="direct"), **kw
    )
    assert direct.fastest.energy_j == pytest.approx(walk.fastest.energy_j, rel=1e-9)
    assert direct.min_energy.energy_j == pytest.approx(walk.min_energy.energy_j, rel=1e-9)


def test_the_sweep_reports_progress_per_point_and_lists_every_point() -> None:
    profile = profile_or_skip("profile_gpt3-175b_a100_sxm.csv")
    seen: list[tuple[int, int]] = []
    frontier = compute_frontier(
        profile,
        build_schedule("1f1b", 8, 8),
        settings=FrontierSettings(unit_time_s=2e-3, p_block_w=83.64, solver="direct"),
        schedule_name="1f1b",
        num_microbatches=8,
        wanted=Wanted(sweep=12),
        progress=lambda done, expected: seen.append((done, expected)),
    )
    expected = seen[-1][1]
    assert seen == [(i, expected) for i in range(1, expected + 1)]
    quants = {p.quant_time for p in frontier.points}
    t_first = max(quants)
    assert set(sweep_quants(frontier.fastest.quant_time, t_first, 12)) <= quants
    assert 10 <= expected <= 12  # T_min, T_max - 1 and T* were solved before the sweep


def test_sweep_and_deadline_quants() -> None:
    assert sweep_quants(10, 20, 3) == [10, 15, 20]
    assert sweep_quants(10, 12, 50) == [10, 11, 12]
    assert deadline_quant(0.0155, 1e-3, 10, 20) == 15
    assert deadline_quant(0.5, 1e-3, 10, 20) == 20
    assert deadline_quant(0.0099, 1e-3, 10, 20) is None


# -- the guard's greedy: incremental replay, same result as one full replay per speed-up ----------------


def _reference_guard(frontier, point, max_slowdown, switch_latency_s):
    """The guard as it was: a full replay after every speed-up."""
    chosen = frontier.planned_options(point)
    limit = frontier.baseline_time_s * (1.0 + max_slowdown)
    layout = layout_of(frontier.dag)
    while True:
        run = replay_options(frontier.model, chosen, switch_latency_s, layout)
        if run.time_s <= limit:
            return chosen
        cands = set(run.path) | {
            run.prev[v] for v in run.path if run.penalized[v] and run.prev[v] >= 0
        }
        best = None
        for v in sorted(cands):
            ins = frontier.dag.instructions[v]
            faster = [
                o for o in frontier.options[(ins.stage, ins.kind)] if o.time_s < chosen[v].time_s
            ]
            if not faster:
                continue
            step = max(faster, key=lambda o: o.time_s)
            price = (step.energy_j - chosen[v].energy_j) / (chosen[v].time_s - step.time_s)
            if best is None or price < best[0]:
                best = (price, v, step)
        if best is None:
            return chosen
        chosen[best[1]] = best[2]


@pytest.mark.parametrize("latency", [0.0, 0.005, 0.02])
@pytest.mark.parametrize(("schedule", "chunks"), SCHEDULES)
def test_the_incremental_guard_equals_the_full_replay_guard(
    schedule: str, chunks: int, latency: float
) -> None:
    frontier = compute_frontier(
        profile_or_skip("profile_gpt3-175b_a100_sxm.csv"),
        build_schedule(schedule, 8, 16, chunks),
        settings=FrontierSettings(unit_time_s=1e-3, p_block_w=83.64, solver="direct"),
        schedule_name=schedule,
        num_microbatches=16,
        num_chunks=chunks,
    )
    point = frontier.fastest
    limit = frontier.baseline_time_s
    planned = frontier.planned_options(point)
    ours = guard._speed_up(frontier.model, planned, limit, latency, None, batch=False)
    ref = _reference_guard(frontier, point, 0.0, latency)
    assert ours == ref
    a, b = (
        replay_options(frontier.model, ours, latency),
        replay_options(frontier.model, ref, latency),
    )
    assert (a.time_s, a.energy_j) == (b.time_s, b.energy_j)
    assert sum(x != y for x, y in zip(planned, ours)) > 0
    # The guard itself (exact start, and this greedy below BOTH_STARTS_MAX_NODES) is no worse.
    got = replay_options(
        frontier.model, frontier.within_slowdown(point, 0.0, switch_latency_s=latency), latency
    )
    assert got.time_s <= limit * (1 + 1e-12)
    assert got.energy_j <= b.energy_j


def test_the_highs_banner_never_reaches_stdout(capfd: pytest.CaptureFixture[str]) -> None:
    """HiGHS 1.16 writes a banner to fd 1 from its constructor, before options can silence it;
    `powerlib plan --json` writes JSON there, so the constructor runs with fd 1 on stderr."""
    import os

    from powerlib.planning.perseus.direct import new_highs

    class Highs:
        def __init__(self) -> None:
            os.write(1, b"Running HiGHS 9.9.9\n")
            self.options: dict[str, object] = {}

        def setOptionValue(self, name: str, value: object) -> None:  # highspy's name
            self.options[name] = value

    class FakeHighspy:
        pass

    FakeHighspy.Highs = Highs
    print("before", flush=True)
    h = new_highs(FakeHighspy)
    print("after", flush=True)
    out, err = capfd.readouterr()
    assert out == "before\nafter\n"
    assert "Running HiGHS" in err
    assert h.options == {"output_flag": False}
