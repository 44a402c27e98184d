"""The session around a training loop, on emulated pipelines: profile -> plan -> apply -> restore."""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from pathlib import Path

import pytest
from runtime_helpers import FREQS, emulated_sessions, make_emulator, toy_profile

from powerlib.errors import InvalidArgumentError, PlanError
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.profile import Profile
from powerlib.runtime.coordination import SingleProcess
from powerlib.runtime.session import optimize


def _run(emulator, sessions, iterations: int) -> list:
    results = []
    with contextlib.ExitStack() as stack:
        for s in sessions:
            stack.enter_context(s)
        for _ in range(iterations):
            results.append(emulator.run_iteration(sessions))
    return results


def _unlocked(emulator) -> bool:
    return all(d.read_state().locked_sm_freqs_mhz is None for d in emulator.devices)


def test_auto_profiles_plans_applies_and_restores(tmp_path: Path) -> None:
    profile = toy_profile()
    emulator = make_emulator(profile, 4)
    base = emulator.run_iteration()
    sessions = emulated_sessions(emulator, tmp_path / "out", switch_latency_s=0.0)
    sweep_iterations = 1 + len(FREQS) * 2
    results = _run(emulator, sessions, sweep_iterations + 4)

    # profile phase: every clock, every stage; P_block measured between instructions
    assert [r.phases for r in results[:sweep_iterations]] == [("profile",) * 4] * sweep_iterations
    gathered = Profile.read(tmp_path / "out" / "profile.csv")
    assert gathered.num_stages == 4
    for row in gathered.rows:  # exact counter, no noise: the profile is the ground truth
        truth = dict((f, (t, e)) for f, t, e in profile.options(row.stage, row.instruction))
        assert row.time_s == pytest.approx(truth[row.freq_mhz][0], rel=1e-9)
        assert row.energy_j == pytest.approx(truth[row.freq_mhz][1], rel=1e-9)
    plan = FrequencyPlan.read(tmp_path / "out" / "plan.json")
    assert plan.workload["p_block_w"] == pytest.approx(80.0, rel=1e-6)
    # the profile carries what it was planned with: `powerlib plan` on it needs neither flag
    assert gathered.p_block_w == plan.workload["p_block_w"]
    assert gathered.unit_time_s == plan.workload["unit_time_s"]

    # apply phase from the next iteration, in every stage, each instruction at its planned clock
    assert all(r.phases == ("apply",) * 4 for r in results[sweep_iterations:])
    for s, session in enumerate(sessions):
        assert session.apply_started_iteration == sweep_iterations
        requested = [f for _, f in session.first_apply_requests]
        assert requested == plan.frequencies(s)
        ran = [
            ex.segments[-1][2]
            for ex in results[sweep_iterations].executed
            if ex.instruction.stage == s
        ]
        assert ran == plan.frequencies(s)
    managed = results[-1]
    assert managed.time_s <= base.time_s * 1.001
    assert managed.energy_j < base.energy_j * 0.97
    # and everything is back after the with block
    assert _unlocked(emulator)
    assert all(s.phase == "closed" for s in sessions)


def test_the_sweep_stops_once_energy_keeps_rising(tmp_path: Path) -> None:
    # energy per iteration is lowest near 780 MHz; the coarse pass (every third clock, then
    # the lowest) visits 1410, 1095, 780, 465, 150: two rises in a row end it, and the fill
    # pass visits only the skipped clocks above the first rise (465 MHz)
    freqs = (*FREQS, 675.0, 570.0, 465.0, 360.0, 255.0, 150.0)
    profile = toy_profile(freqs=freqs)
    emulator = make_emulator(profile, 2)
    sessions = emulated_sessions(emulator, None, stop_after_rises=2, progress=False)
    _run(emulator, sessions, 1 + 2 * len(freqs) + 2)
    profiled = sessions[0].report().profiled_freqs_mhz
    assert 465.0 in profiled and 150.0 in profiled
    assert 360.0 not in profiled and 255.0 not in profiled
    assert 570.0 in profiled and 1305.0 in profiled
    assert all(s.plan is not None for s in sessions)  # it went on to plan


def test_a_loop_that_runs_another_order_warns_once_resets_and_continues(tmp_path: Path) -> None:
    profile = toy_profile()
    emulator = make_emulator(profile, 4)
    # make a plan, then swap two instructions of stage 1
    sessions = emulated_sessions(emulator, tmp_path / "a", switch_latency_s=0.0)
    _run(emulator, sessions, 1 + 2 * len(FREQS) + 1)
    data = json.loads((tmp_path / "a" / "plan.json").read_text())
    ins = data["stages"][1]["instructions"]
    ins[0], ins[1] = ins[1], ins[0]
    bad = tmp_path / "swapped.json"
    bad.write_text(json.dumps(data))

    sessions = emulated_sessions(emulator, None, mode="apply", plan_path=bad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = _run(emulator, sessions, 3)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "stage 1" in messages[0] and "order" in messages[0]
    assert len(results) == 3  # training went on
    assert sessions[1].phase == "closed" and sessions[1].plan is not None
    assert sessions[1].report().frequency_changes >= 1  # the reset
    assert emulator.devices[1].freq_at(emulator.clock()) == max(FREQS)
    assert len(sessions[0].first_apply_requests) == 8  # the other stages applied their plan
    assert _unlocked(emulator)


def test_apply_mode_with_a_malformed_plan_fails_before_any_change(tmp_path: Path) -> None:
    profile = toy_profile()
    emulator = make_emulator(profile, 4)
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"schema": "powerlib.plan.v1", "stages": [{"instructions": []}]}))
    session = optimize(
        num_stages=1,
        num_microbatches=4,
        mode="apply",
        plan_path=bad,
        backend=emulator.backend,
        device=0,
        coordinator=SingleProcess(),
        out_dir=None,
        progress=False,
    )
    with pytest.raises(PlanError, match=r"plan\.json: stages\[0\]\.instructions"), session:
        pass
    assert emulator.devices[0].switches == 0


def test_a_plan_for_clocks_the_device_lacks_is_refused(tmp_path: Path) -> None:
    profile = toy_profile()
    emulator = make_emulator(profile, 4)
    sessions = emulated_sessions(emulator, tmp_path / "a")
    _run(emulator, sessions, 1 + 2 * len(FREQS) + 1)
    data = json.loads((tmp_path / "a" / "plan.json").read_text())
    data["stages"][2]["instructions"][3]["freq_mhz"] = 1234.0
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(data))
    switches = [d.switches for d in emulator.devices]
    session = optimize(
        num_stages=4,
        num_microbatches=4,
        mode="apply",
        plan_path=path,
        stage=2,
        backend=emulator.backend,
        device=2,
        coordinator=SingleProcess(),
        out_dir=None,
        progress=False,
    )
    with pytest.raises(PlanError, match="1234 MHz"), session:
        pass
    assert [d.switches for d in emulator.devices] == switches


def test_plan_mode_plans_from_a_saved_profile(tmp_path: Path) -> None:
    profile = toy_profile()
    profile.write_csv(tmp_path / "profile.csv")
    emulator = make_emulator(profile, 4)
    sessions = emulated_sessions(
        emulator,
        tmp_path / "out",
        mode="plan",
        profile_path=tmp_path / "profile.csv",
        p_block_w=80.0,
    )
    results = _run(emulator, sessions, 3)
    assert all(r.phases == ("apply",) * 4 for r in results)
    assert (tmp_path / "out" / "plan.json").exists()


def test_profile_mode_writes_the_profile_and_releases_the_clocks(tmp_path: Path) -> None:
    profile = toy_profile()
    emulator = make_emulator(profile, 4)
    sessions = emulated_sessions(emulator, tmp_path / "out", mode="profile")
    results = _run(emulator, sessions, 1 + 2 * len(FREQS) + 2)
    assert results[-1].phases == ("done",) * 4
    assert Profile.read(tmp_path / "out" / "profile.csv").num_stages == 4
    assert not (tmp_path / "out" / "plan.json").exists()
    assert all(s.plan is None for s in sessions)
    assert _unlocked(emulator)


def test_an_exception_in_the_loop_restores_the_devices(tmp_path: Path) -> None:
    profile = toy_profile()
    emulator = make_emulator(profile, 4)
    sessions = emulated_sessions(emulator, None)
    with pytest.raises(RuntimeError, match="boom"), contextlib.ExitStack() as stack:
        for s in sessions:
            stack.enter_context(s)
        emulator.run_iteration(sessions)
        emulator.run_iteration(sessions)
        assert not _unlocked(emulator)  # profiling has locked the clocks
        raise RuntimeError("boom")
    assert _unlocked(emulator)


def test_a_planning_failure_after_profiling_warns_and_leaves_training_alone(tmp_path: Path) -> None:
    profile = toy_profile()
    emulator = make_emulator(profile, 4)
    sessions = emulated_sessions(emulator, None, policy="deadline", deadline_s=float("nan"))
    with pytest.warns(RuntimeWarning, match="planning failed"):
        results = _run(emulator, sessions, 1 + 2 * len(FREQS) + 2)
    assert results[-1].phases == ("done",) * 4
    assert _unlocked(emulator)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "train"}, "mode must be one of"),
        ({"mode": "plan"}, "needs profile_path"),
        ({"mode": "apply"}, "needs plan_path"),
        ({"policy": "cheapest"}, "unknown policy"),
        ({"policy": "deadline"}, "needs deadline_s or deadline_ratio"),
        ({"warmup_iterations": -1}, "warmup_iterations"),
        ({"max_slowdown": -0.1}, "max_slowdown"),
        ({"unit_time_s": 0.0}, "unit_time_s must be a positive time"),
    ],
)
def test_bad_options_are_refused_up_front(kwargs: dict, match: str) -> None:
    with pytest.raises((InvalidArgumentError, PlanError), match=match):
        optimize(num_stages=2, num_microbatches=2, **kwargs)


def test_stage_must_be_given_when_ranks_are_not_stages(tmp_path: Path) -> None:
    emulator = make_emulator(toy_profile(), 2)
    session = optimize(
        num_stages=4,
        num_microbatches=2,
        backend=emulator.backend,
        coordinator=SingleProcess(),
        out_dir=None,
    )
    with pytest.raises(InvalidArgumentError, match="pass stage="), session:
        pass
    session = optimize(
        num_stages=4,
        num_microbatches=2,
        stage=4,
        backend=emulator.backend,
        coordinator=SingleProcess(),
        out_dir=None,
    )
    with pytest.raises(InvalidArgumentError, match="out of range"), session:
        pass
    assert _unlocked(emulator)


def test_kinds_accept_short_names_and_reject_others(tmp_path: Path) -> None:
    emulator = make_emulator(toy_profile(1), 1)
    with optimize(
        num_stages=1,
        num_microbatches=1,
        backend=emulator.backend,
        device=0,
        coordinator=SingleProcess(),
        clock=emulator.clock,
        out_dir=None,
        progress=False,
    ) as session:
        with session.instruction("F", microbatch=0):
            pass
        with pytest.raises(InvalidArgumentError, match="instruction kind"):
            session.begin("sideways")


def test_the_plan_follows_the_order_the_loop_really_ran(tmp_path: Path) -> None:
    profile = toy_profile()
    from powerlib.emulator.engine import Emulator
    from powerlib.planning.schedules import build_schedule

    emulator = Emulator(profile, build_schedule("gpipe", 4, 4), p_block_w=80.0)
    sessions = emulated_sessions(emulator, tmp_path / "out", schedule="1f1b")  # says 1f1b: wrong
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no order-mismatch warning may come
        results = _run(emulator, sessions, 1 + 2 * len(FREQS) + 2)
    assert results[-1].phases == ("apply",) * 4
    plan = FrequencyPlan.read(tmp_path / "out" / "plan.json")
    assert plan.workload["order_source"] == "recorded"
    gpipe = build_schedule("gpipe", 4, 4)
    for s in range(4):
        assert [p.instruction for p in plan.stage(s)] == gpipe[s]


def test_local_rank_and_simulated_counter_period_come_from_the_environment(tmp_path: Path) -> None:
    from powerlib.config import Settings
    from powerlib.errors import ConfigError
    from powerlib.registry import open_backend

    settings = Settings.from_env({"LOCAL_RANK": "3", "POWERLIB_SIM_ENERGY_PERIOD_S": "0.002"})
    assert settings.local_rank == 3 and settings.sim_energy_period_s == 0.002
    with open_backend("simulated", settings.replace(state_dir=tmp_path / "state")) as backend:
        assert backend.model.energy_update_period_s == 0.002
    for env in (
        {"LOCAL_RANK": "x"},
        {"POWERLIB_SIM_ENERGY_PERIOD_S": "0"},
        {"POWERLIB_SIM_ENERGY_PERIOD_S": "soon"},
    ):
        with pytest.raises(ConfigError):
            Settings.from_env(env)


def test_a_counter_that_never_moved_is_one_clear_baseline_verdict() -> None:
    from powerlib.planning.profile_rows import ProfileRow
    from powerlib.runtime.planning_step import make_plan
    from powerlib.runtime.records import NoPlan, ProfilePayload
    from powerlib.runtime.session_config import SessionConfig

    rows = tuple(
        ProfileRow(
            stage=0, instruction=k, freq_mhz=f, time_s=0.001, energy_j=0.0 if f == 1410.0 else 0.5
        )  # fmt: skip
        for k in ("forward", "backward")
        for f in (1410.0, 1200.0)
    )
    config = SessionConfig.from_keywords(num_stages=1, num_microbatches=1, out_dir=None)
    result = make_plan(config, [ProfilePayload(stage=0, rows=rows)])
    assert isinstance(result, NoPlan)  # no plan: the sessions run at the baseline clocks
    assert re.fullmatch(
        r"the energy counter cannot resolve per-instruction energy: stage 0 \w+ at 1410 MHz "
        r"\(1 ms\) is known not at all \(2 of 4 profiled rows worse than \+-8 %\); .*",
        result.reason,
    ), result.reason
