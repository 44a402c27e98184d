"""Hostile or mismatched input to the runtime and `powerlib simulate`: one clear line, nothing changed.

- a plan made for another workload (stages, microbatches, schedule, chunks) is refused by
  ``powerlib simulate`` and by ``mode="apply"`` sessions at the ``with`` line;
- the hooks refuse to run outside the ``with`` block, and a second session on a device this
  process (or another) already holds is refused at its ``with`` line, naming the holder;
- a profile that cannot resolve per-instruction energy, and a plan that would spend more energy
  than all maximum clocks, are not applied: one warning, the baseline clocks.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner
from runtime_helpers import FREQS, emulated_sessions, make_emulator, toy_profile

from powerlib.cli import cli
from powerlib.config import Settings
from powerlib.control import StateDir
from powerlib.control.journal import list_journals
from powerlib.errors import DeviceBusyError, InvalidArgumentError, PlanError
from powerlib.planning.choice import Policy, objection
from powerlib.planning.plan import PLAN_SCHEMA
from powerlib.planning.profile import Profile
from powerlib.planning.schedules import build_schedule
from powerlib.planning.workflow import PlanRequest, plan_profile
from powerlib.registry import open_backend
from powerlib.runtime.coordination import SingleProcess
from powerlib.runtime.planning_step import make_plan
from powerlib.runtime.records import NoPlan, Planned, SavedProfile
from powerlib.runtime.session import Session, optimize
from powerlib.runtime.session_config import SessionConfig

REPO = Path(__file__).resolve().parents[2]


def _plan(path: Path, schedule: str, stages: int, microbatches: int, chunks: int = 1, **workload):
    """A valid all-1410-MHz plan file for a generated schedule."""
    order = build_schedule(schedule, stages, microbatches, chunks)
    data = {
        "schema": PLAN_SCHEMA,
        "workload": {
            "num_stages": stages,
            "num_microbatches": microbatches,
            "schedule": schedule,
            "num_chunks": chunks,
            **workload,
        },
        "policy": "fastest",
        "stages": [
            {
                "stage": s,
                "instructions": [
                    {"kind": i.kind, "microbatch": i.microbatch, "chunk": i.chunk, "freq_mhz": 1410}
                    for i in order[s]
                ],
            }
            for s in range(stages)
        ],
    }
    path.write_text(json.dumps(data))
    return path


def _one_error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("powerlib: error: ")
    return lines[0]


# -- 1. a plan for another workload -------------------------------------------------------------


def test_simulate_refuses_a_plan_for_another_number_of_stages(tmp_path: Path) -> None:
    plan = _plan(tmp_path / "plan4.json", "1f1b", 4, 12)
    result = CliRunner().invoke(cli, ["simulate", str(plan)], catch_exceptions=False)
    assert result.exit_code == 7
    line = _one_error_line(result)
    assert line.endswith(
        "plan4.json: the plan has 4 stages, the profile gpt3-175b_a100_sxm.csv has 8"
    )
    assert result.stdout == ""  # nothing was replayed


def test_simulate_refuses_a_plan_whose_workload_contradicts_its_instructions(
    tmp_path: Path,
) -> None:
    plan = _plan(tmp_path / "plan.json", "1f1b", 8, 4)
    data = json.loads(plan.read_text())
    data["workload"]["num_microbatches"] = 12  # says 12, lists 4
    plan.write_text(json.dumps(data))
    result = CliRunner().invoke(cli, ["simulate", str(plan)], catch_exceptions=False)
    assert result.exit_code == 7
    assert _one_error_line(result).endswith(
        "plan.json: workload.num_microbatches is 12 but the plan's instructions have 4"
    )


def _apply(plan: Path, emulator, **kwargs) -> Session:
    options = {
        "num_stages": 1,
        "num_microbatches": 8,
        "mode": "apply",
        "plan_path": plan,
        "backend": emulator.backend,
        "device": 0,
        "stage": 0,
        "coordinator": SingleProcess(),
        "out_dir": None,
        "progress": False,
    }
    return optimize(**(options | kwargs))


@pytest.mark.parametrize(
    ("plan_args", "session_args", "message"),
    [
        (("1f1b", 4, 8, 1), {"num_stages": 8}, "the plan has 4 stages, the session has 8"),
        (("1f1b", 1, 12, 1), {}, "the plan is for 12 microbatches, the session has 8"),
        (
            ("gpipe", 1, 8, 1),
            {"schedule": "1f1b"},
            "the plan is for the gpipe schedule, the session runs 1f1b",
        ),
        (
            ("interleaved", 1, 8, 2),
            {"num_chunks": 1},
            "the plan has 2 chunks per stage, the session has 1",
        ),
    ],
)
def test_apply_refuses_a_plan_for_another_workload_at_the_with_line(
    tmp_path: Path, plan_args: tuple, session_args: dict, message: str
) -> None:
    plan = _plan(tmp_path / "plan.json", *plan_args)
    emulator = make_emulator(toy_profile(1), 8)
    session = _apply(plan, emulator, **session_args)
    with pytest.raises(PlanError) as caught, session:
        pass
    assert str(caught.value) == f"{plan}: {message}"
    assert caught.value.exit_code == 7
    assert emulator.devices[0].switches == 0
    assert session.phase == "closed" and session.plan is None


def test_a_layout_given_later_is_checked_against_the_plan(tmp_path: Path) -> None:
    plan = _plan(tmp_path / "plan.json", "gpipe", 1, 8)
    emulator = make_emulator(toy_profile(1), 8)
    with _apply(plan, emulator) as session:  # no schedule given: the order check decides later
        with pytest.raises(
            PlanError, match="the plan is for the gpipe schedule, the session runs 1f1b"
        ):
            session.set_layout(schedule="1f1b")  # what an integration does when it attaches
        assert session.plan is None and session.phase == "done"
    assert emulator.devices[0].switches == 0


def test_apply_mismatch_on_the_simulated_backend_changes_nothing(tmp_path: Path) -> None:
    plan = _plan(tmp_path / "plan.json", "1f1b", 1, 12)
    settings = Settings(backend="simulated", sim_gpus=1, state_dir=tmp_path / "state")
    with open_backend(settings=settings) as backend:
        before = backend.device(0).read_state()
    session = optimize(
        num_stages=1,
        num_microbatches=8,
        mode="apply",
        plan_path=plan,
        settings=settings,
        device=0,
        coordinator=SingleProcess(),
        out_dir=tmp_path / "out",
        progress=False,
    )
    with (
        pytest.raises(PlanError, match="the plan is for 12 microbatches, the session has 8"),
        session,
    ):
        pass
    with open_backend(settings=settings) as backend:
        after = backend.device(0).read_state()
    assert after.locked_sm_freqs_mhz == before.locked_sm_freqs_mhz is None
    assert after.power_limit_w == before.power_limit_w
    assert list(list_journals(StateDir(tmp_path / "state"))) == []
    assert not (tmp_path / "out").exists()


# -- 2. session API misuse ----------------------------------------------------------------------


def _calls(session: Session) -> dict:
    def instruction() -> None:
        with session.instruction("forward"):
            raise AssertionError("the body must not run")

    return {
        "begin": lambda: session.begin("forward"),
        "end": session.end,
        "step": session.step,
        "instruction": instruction,
        "start_iteration": session.start_iteration,
    }


def test_the_hooks_refuse_to_run_outside_the_with_block() -> None:
    emulator = make_emulator(toy_profile(1), 1)
    session = optimize(
        num_stages=1,
        num_microbatches=1,
        backend=emulator.backend,
        device=0,
        coordinator=SingleProcess(),
        clock=emulator.clock,
        out_dir=None,
        progress=False,
    )
    for name, call in _calls(session).items():
        hook = "begin" if name == "instruction" else name
        with pytest.raises(
            InvalidArgumentError, match=rf"session\.{hook}\(\) was called before it was entered"
        ):
            call()
    with session:
        with session.instruction("forward"):
            pass
        session.step()
    for name, call in _calls(session).items():
        hook = "begin" if name == "instruction" else name
        with pytest.raises(
            InvalidArgumentError, match=rf"session\.{hook}\(\) was called after it ended"
        ):
            call()
    with pytest.raises(
        InvalidArgumentError, match="already entered and has ended; a session is entered once"
    ):
        session.__enter__()
    assert emulator.devices[0].read_state().locked_sm_freqs_mhz is None


def _sim_session(**kwargs) -> Session:
    return optimize(
        **{
            "num_stages": 1,
            "num_microbatches": 1,
            "backend": "simulated",
            "device": 0,
            "coordinator": SingleProcess(),
            "freqs_mhz": [1410, 1200],
            "warmup_iterations": 1,
            "out_dir": None,
            "progress": False,
        }
        | kwargs
    )


def test_a_second_session_on_a_held_device_is_refused_naming_this_process() -> None:
    with _sim_session(threaded=False) as outer:  # the clock is locked when step() returns
        with outer.instruction("forward"):
            pass
        outer.step()
        locked = outer.device.read_state().locked_sm_freqs_mhz
        assert locked == (1410.0, 1410.0)  # profiling
        with warnings.catch_warnings():
            warnings.simplefilter(
                "error"
            )  # no "driver error" warning, no reset of the outer's clocks
            inner = _sim_session()
            with pytest.raises(DeviceBusyError) as caught, inner:
                pass
        assert f"already held by this process (pid {os.getpid()})" in str(caught.value)
        assert caught.value.exit_code == 8
        assert outer.device.read_state().locked_sm_freqs_mhz == locked  # untouched
        with outer.instruction("forward"):  # the outer session goes on
            pass
        outer.step()
        assert outer.phase == "profile"
    assert outer.device.read_state().locked_sm_freqs_mhz is None


def test_two_sessions_entered_before_any_change_still_conflict_at_the_with_line() -> None:
    with _sim_session(), pytest.raises(DeviceBusyError, match="already held by this process"):
        with _sim_session():
            pass


def test_a_session_on_a_device_another_process_holds_is_refused_naming_it(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, powerlib\n"
            "from powerlib.runtime.coordination import SingleProcess\n"
            "with powerlib.optimize(num_stages=1, num_microbatches=1, backend='simulated', "
            "device=0, coordinator=SingleProcess(), out_dir=None, progress=False):\n"
            "    print('ready', flush=True)\n"
            "    sys.stdin.readline()\n",
        ],
        env=os.environ | {"POWERLIB_BACKEND": "simulated"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        session = _sim_session()
        with pytest.raises(DeviceBusyError, match=rf"controlled by pid {holder.pid} "), session:
            pass
    finally:
        holder.communicate("\n", timeout=30)
    assert holder.returncode == 0
    assert list(list_journals(StateDir(Path(os.environ["POWERLIB_STATE_DIR"])))) == []


# -- 3. profiles too coarse to plan from, plans that would not pay ---------------------------------


def _run(emulator, sessions, iterations: int, *, then: int | None = None) -> tuple[list, list[str]]:
    """``iterations`` iterations; with ``then``, at most that many, stopping ``then`` iterations
    after every session left the profile phase."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = []
        with contextlib.ExitStack() as stack:
            for s in sessions:
                stack.enter_context(s)
            left = then
            for _ in range(iterations):
                results.append(emulator.run_iteration(sessions))
                if left is not None and all(s.phase in ("apply", "done") for s in sessions):
                    if left == 0:
                        break
                    left -= 1
    return results, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


_GAVE_UP = (
    r"^powerlib: the energy counter cannot resolve per-instruction energy: stage \d: after 4 "
    r"iterations at 1410 MHz its instruction energ"
)


@pytest.mark.parametrize(
    ("counter", "message"),
    [
        # fewer whole counter intervals in the block than unknown powers: nothing is known
        ({"counter_period_s": 0.5},
         _GAVE_UP + r"ies are not resolved yet \(fewer whole counter intervals than "
         r"instructions to solve for\) \(target \+-2 %\) with an energy "
         r"counter that updates every 500 ms; it would resolve with many more iterations "),
        # instructions far noisier than the 100 ms counter can average in a block: known, but
        # to far worse than 4x the target at the block's maximum (A100/H100's part-time
        # sampling used to end here; it plans since issue 45: test_part_time_profile.py)
        ({"counter_period_s": 0.1, "noise": 0.2},
         _GAVE_UP + r"y is known to \+-\d\d+ % \(target \+-2 %\) with an energy counter that updates every "
         r"100 ms; it would resolve with about \d+ iterations per clock "),
    ],
)  # fmt: skip
def test_a_counter_too_coarse_for_the_instructions_warns_once_and_keeps_the_baseline(
    tmp_path: Path, counter: dict, message: str
) -> None:
    emulator = make_emulator(toy_profile(), 4, **counter)
    sessions = emulated_sessions(emulator, tmp_path / "out")
    results, warned = _run(emulator, sessions, 1 + 2 * len(FREQS) + 3)
    assert len(warned) == 1, warned  # rank 0 says it for the four stages
    assert re.search(message, warned[0]) and warned[0].endswith(
        "(max_iterations_per_freq) or longer instructions (larger microbatches); "
        "running at the baseline clocks, no plan applied"
    ), warned[0]
    # told within the first clock: warm-up, settle, and the block's 4 measured iterations
    assert [r.phases for r in results[:6]] == [("profile",) * 4] * 6
    assert all(r.phases == ("done",) * 4 for r in results[6:])
    assert all(s.plan is None for s in sessions)
    assert all(d.read_state().locked_sm_freqs_mhz is None for d in emulator.devices)
    for r in results[-2:]:  # the last iterations ran at the top clock throughout
        assert {seg[2] for ex in r.executed for seg in ex.segments} == {max(FREQS)}
    # no profile, frontier or plan from a profile that resolves nothing: only the reason
    out = tmp_path / "out"
    assert sorted(f.name for f in out.iterdir()) == ["summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["plan"] is None and warned[0] == f"powerlib: {summary['refused']}" + (
        "; running at the baseline clocks, no plan applied"
    )


@pytest.mark.parametrize("counter_period_s", [0.001, 0.05])
def test_a_fine_counter_still_plans_and_applies(tmp_path: Path, counter_period_s: float) -> None:
    """A 50 ms counter resolves these 20-90 ms instructions too: energy is attributed over
    whole counter intervals, not read at the hooks."""
    emulator = make_emulator(toy_profile(), 4, counter_period_s=counter_period_s)
    sessions = emulated_sessions(emulator, tmp_path / "out")
    results, warned = _run(emulator, sessions, 60, then=1)
    assert warned == []
    assert results[-1].phases == ("apply",) * 4
    assert (tmp_path / "out" / "plan.json").exists()


# A profile with the marks of a coarse counter: some slower clocks "cost" far more energy than the
# top clock. Stage 1's backward at 990 MHz floors to the same 0.1 ms quantum as at 1410 MHz for
# 46 % more energy: the SOSP'24 artifact's pruning keeps that costlier option of the quantum, and
# T* runs it, spending 6 % more than all maximum clocks. Weak pruning (the default, issue 45)
# keeps 1410 MHz there and plans a saving, which clock changes that land 5 ms late turn into a
# loss. (The guarded policies re-solve on the measured numbers themselves since issue 34, so
# their plan saves energy here.)
NOISY = """stage,instruction,frequency,time,energy
0,forward,1410,0.00594,0.632
0,forward,1200,0.00647,0.700
0,forward,990,0.00826,0.707
0,backward,1410,0.00454,0.341
0,backward,1200,0.00520,0.697
0,backward,990,0.00584,0.473
1,forward,1410,0.00253,0.629
1,forward,1200,0.00281,0.664
1,forward,990,0.00280,0.530
1,backward,1410,0.00957,0.489
1,backward,1200,0.01064,0.787
1,backward,990,0.00960,0.712
"""


def test_a_plan_that_would_spend_more_than_all_max_is_refused_and_not_written(
    tmp_path: Path,
) -> None:
    path = tmp_path / "noisy.csv"
    path.write_text(NOISY)
    out = tmp_path / "out"
    config = SessionConfig.from_keywords(
        num_stages=2,
        num_microbatches=2,
        p_block_w=85.0,
        switch_latency_s=0.005,
        out_dir=out,
        policy="min-energy",
    )
    result = make_plan(config, [SavedProfile(stage=0, path=path)])
    assert isinstance(result, NoPlan)
    assert result.reason == (
        "the min-energy plan would spend 6.29703 J per iteration, 0.93 % more than all "
        "maximum clocks (6.239 J per iteration as the job runs them; replayed on the profile)"
    )
    assert not (out / "plan.json").exists()  # nobody can apply it later by mistake
    assert json.loads((out / "summary.json").read_text())["refused"] == result.reason


def test_a_session_planning_from_that_profile_runs_at_the_baseline(tmp_path: Path) -> None:
    path = tmp_path / "noisy.csv"
    path.write_text(NOISY)
    profile = Profile.read(path)
    emulator = make_emulator(profile, 2, p_block_w=85.0)
    sessions = emulated_sessions(
        emulator,
        None,
        mode="plan",
        profile_path=path,
        p_block_w=85.0,
        switch_latency_s=0.005,
        policy="min-energy",
    )
    results, warned = _run(emulator, sessions, 2)
    assert len(warned) == 1 and "0.93 % more than all maximum clocks" in warned[0]
    assert all(r.phases == ("done", "done") for r in results)
    assert emulator.devices[0].switches == emulator.devices[1].switches == 0


@pytest.mark.parametrize(
    ("pruning", "refused"),
    [
        (
            "artifact",
            "the min-energy plan would spend 6.61405 J per iteration, 6.01 % more than all "
            "maximum clocks (6.239 J per iteration as the job runs them; replayed on the profile)",
        ),
        ("weak", None),
    ],
)
def test_that_profile_with_instant_switches_is_refused_only_under_the_artifact_pruning(
    tmp_path: Path, pruning: str, refused: str | None
) -> None:
    path = tmp_path / "noisy.csv"
    path.write_text(NOISY)
    request = PlanRequest(
        num_stages=2,
        num_microbatches=2,
        p_block_w=85.0,
        switch_latency_s=0.0,
        policy="min-energy",
        pruning=pruning,
    )
    result = plan_profile(Profile.read(path), request)
    assert result.choice.objection == refused
    frontier = result.frontier
    stage1_backward = frontier.options[(1, "backward")]
    # the quantum 95 (9.57 ms at 1410 MHz, 9.60 ms at 990 MHz) keeps one clock of the two
    assert [(o.quant, o.freq_mhz) for o in stage1_backward] == [
        (95, 990.0 if pruning == "artifact" else 1410.0)
    ]
    if refused is None:
        saving = 1.0 - result.choice.realized.energy_j / frontier.baseline().energy_j
        assert saving > 0.01  # weak pruning's plan saves energy on the profile


def test_the_guarded_plan_of_that_profile_spends_no_more_than_all_max(tmp_path: Path) -> None:
    """Before issue 34 the fastest plan of NOISY was refused (7.06 % more than all-max): the
    guard started from the fitted point. Its exact-time solve now uses the measured numbers,
    on which nothing beats all-max here: the plan keeps the top clocks."""
    path = tmp_path / "noisy.csv"
    path.write_text(NOISY)
    config = SessionConfig.from_keywords(
        num_stages=2, num_microbatches=2, p_block_w=85.0, switch_latency_s=0.0, out_dir=None
    )
    result = make_plan(config, [SavedProfile(stage=0, path=path)])
    assert isinstance(result, Planned)
    assert result.prediction is not None and result.prediction.saving_percent == 0.0


def test_a_plan_past_the_allowed_slowdown_is_refused() -> None:
    from powerlib.planning.perseus.frontier import FrontierSettings, compute_frontier

    profile = toy_profile(2)
    frontier = compute_frontier(
        profile,
        build_schedule("1f1b", 2, 2),
        settings=FrontierSettings(unit_time_s=0.001, p_block_w=80.0),
        schedule_name="1f1b",
        num_microbatches=2,
    )
    slowest = [frontier.options[(i.stage, i.kind)][-1] for i in frontier.dag.instructions]
    fastest = Policy(name="fastest", max_slowdown=0.001, switch_latency_s=0.0)
    min_energy = Policy(name="min-energy", max_slowdown=0.001, switch_latency_s=0.0)
    assert objection(frontier, fastest, frontier.planned_options(frontier.fastest)) is None
    refused = objection(frontier, min_energy, slowest)
    assert refused is None or "more than all maximum clocks" in refused  # no time limit
    refused = objection(frontier, fastest, slowest)
    assert refused is not None and "past the allowed" in refused and "max_slowdown 0.1 %" in refused


# -- examples/ddp.py with the simulated GPU's 100 ms counter -------------------------------------


def test_ddp_example_with_a_coarse_counter_warns_once_and_applies_nothing(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("POWERLIB_")} | {
        "POWERLIB_BACKEND": "simulated",
        "POWERLIB_SIM_GPUS": "2",
        "POWERLIB_STATE_DIR": str(state),
        "OMP_NUM_THREADS": "1",
    }
    settings = Settings(backend="simulated", sim_gpus=2, state_dir=state)
    with open_backend(settings=settings) as backend:
        before = [d.read_state() for d in backend.devices()]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(REPO / "examples" / "ddp.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    warned = [line for line in proc.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warned) == 1, proc.stderr  # one line, from rank 0, for the whole job
    assert (
        "energy counter" in warned[0]
        and "running at the baseline clocks, no plan applied" in warned[0]
    )
    assert "applying" not in proc.stderr
    assert not (tmp_path / "powerlib-out" / "plan.json").exists()
    with open_backend(settings=settings) as backend:
        after = [d.read_state() for d in backend.devices()]
    for b, a in zip(before, after):
        assert a.locked_sm_freqs_mhz == b.locked_sm_freqs_mhz and a.power_limit_w == b.power_limit_w
    assert list(list_journals(StateDir(state))) == []


# -- the counter-resolution estimate ---------------------------------------------------------------


def _reads(period_s: float, intervals_s: list[float], phase_s: float = 0.0123) -> list[bool]:
    """Whether a counter updating every ``period_s`` moved between consecutive reads."""
    t, moved = phase_s, []
    for length in intervals_s:
        moved.append(int((t + length) / period_s) != int(t / period_s))
        t += length
    return moved


@pytest.mark.parametrize("period_s", [0.1, 0.02, 0.001])
def test_the_counter_period_is_estimated_from_how_often_reads_saw_it_move(period_s: float) -> None:
    from powerlib.measurement.counter_period import estimate_counter_period_s

    rng = random.Random(7)
    intervals = [
        rng.choice((rng.uniform(1e-5, 1e-4), rng.uniform(1e-3, 5e-3))) for _ in range(4000)
    ]
    moved = _reads(period_s, intervals)
    estimate, at_most = estimate_counter_period_s(intervals, sum(moved))
    assert not at_most
    assert estimate == pytest.approx(period_s, rel=0.15)


def test_the_estimate_says_what_it_cannot_know() -> None:
    from powerlib.kareus.energy_counter import energy_error
    from powerlib.measurement.counter_period import estimate_counter_period_s

    assert estimate_counter_period_s([0.01] * 7, 3) is None  # too few reads
    assert estimate_counter_period_s([0.01, 0.02] * 10, 20) == (0.01, True)  # moved every time
    assert estimate_counter_period_s([0.01] * 10, 0) == (pytest.approx(0.1), False)  # never
    assert energy_error(0.05, 0.1, 24) == pytest.approx(0.5 / 0.5 / 24**0.5)
    assert energy_error(0.001, 0.1, 100) == pytest.approx(0.01**0.5 / 0.01 / 10)  # r < 1
    assert energy_error(0.0, 0.1, 4) == float("inf") and energy_error(0.01, 0.0, 4) == 0.0


def test_the_meter_watches_its_reads_of_a_ticking_counter() -> None:
    from powerlib.kareus.energy_counter import EnergyMeter

    emulator = make_emulator(toy_profile(1), 1, counter_period_s=0.05)
    device, clock = emulator.devices[0], emulator.clock
    meter = EnergyMeter(device, clock=clock)
    for _ in range(200):
        clock.now_s += 0.003
        meter.read_j()
    res = meter.resolution()
    assert res.intervals == 199 and not res.at_most
    assert res.period_s == pytest.approx(0.05, rel=0.15)
    meter.close()
