"""The power-budget policy end to end on the simulated backend's wall-clock GPUs (issue 47).

The user's path without a GPU (``POWERLIB_BACKEND=simulated``): two pipeline stages, one
simulated A100 each, whose clocks throttle to hold the power limit they are given and whose
power and time follow the session's instructions (backends/_simulated_work.py). An
administrator has lowered stage 1's limit before the job. The sessions profile, rank 0 plans
per-stage limits within the budget (docs/perseus.md §7), each rank sets its own through the
control session; afterwards every limit and clock is what it was before the job.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from pathlib import Path

import pytest
from runtime_helpers import EXACT_SWEEP

from powerlib.config import Settings
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.profile import Profile
from powerlib.planning.schedules import build_schedule
from powerlib.registry import open_backend
from powerlib.runtime.coordination import LocalGroup
from powerlib.runtime.session import Session, optimize

STAGES = 2
MICROBATCHES = 2
FORWARD_S = 0.008  # what the host takes per instruction at the top clock; backward twice
ADMIN_W = 250.0  # below the A100's 400 W default and its ~284 W at the top clock: it throttles
BUDGET_W = 400.0  # of the 650 W they start with: GPU 0 gets at most 400 - ~150 W, below 1410 MHz


def _snapshot(settings: Settings) -> list[tuple[float | None, object, object]]:
    """Each GPU's power limit and clock lock (as set, and as the device reports it)."""
    with open_backend(settings=settings) as backend:
        return [
            (
                d.read_state().power_limit_w,
                d.read_state().locked_sm_freqs_mhz,
                d.read_sm_lock().locked,
            )
            for d in backend.devices()
        ]


def _sessions(out: Path) -> list[Session]:
    group = LocalGroup(STAGES)
    return [
        optimize(
            num_stages=STAGES,
            num_microbatches=MICROBATCHES,
            stage=s,
            device=s,
            coordinator=group.member(s),
            policy="power-budget",
            budget_w=BUDGET_W,
            freqs_mhz=[1410, 1200, 990],
            warmup_iterations=1,
            settle_iterations=1,
            iterations_per_freq=1,
            **EXACT_SWEEP,
            target_error=0.2,  # wall-clock hooks on a loaded CPU: looser than the default 2 %
            # check_rounds left at its default: a plan with limits runs no closed loop
            out_dir=out,
            progress=False,
        )
        for s in range(STAGES)
    ]


def _limit_w(session: Session) -> float | None:
    """The power limit the session's GPU holds now, read from the device."""
    assert session.device is not None
    return session.device.read_state().power_limit_w


def _train(
    sessions: list[Session], applied_iterations: int
) -> tuple[list[list[float | None]], set[str]]:
    """Run the 1F1B pipeline, stage after stage in each iteration, until the plan has run
    ``applied_iterations`` times; each applied iteration's limits, read from the devices, and
    every phase the sessions were in."""
    order = build_schedule("1f1b", STAGES, MICROBATCHES)
    applied: list[list[float | None]] = []
    phases: set[str] = set()
    with contextlib.ExitStack() as stack:
        for session in sessions:
            stack.enter_context(session)
        for _ in range(40):
            for s, session in enumerate(sessions):
                for ins in order[s]:
                    with session.instruction(ins.kind, ins.microbatch):
                        time.sleep(FORWARD_S * (1 + 0.5 * s) * (1 if ins.kind == "forward" else 2))
                session.step()
                phases.add(str(session.phase))
            if all(session.phase == "apply" for session in sessions):
                applied.append([_limit_w(session) for session in sessions])
                if len(applied) == applied_iterations:
                    break
    return applied, phases


def test_a_budget_session_on_simulated_gpus_holds_the_budget_and_restores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POWERLIB_BACKEND", "simulated")  # the state dir: conftest's, per test
    monkeypatch.setenv("POWERLIB_SIM_GPUS", str(STAGES))
    monkeypatch.setenv("POWERLIB_SIM_ENERGY_PERIOD_S", "0.001")  # fine enough for 8-24 ms work
    settings = Settings.from_env()
    with open_backend(settings=settings) as backend:  # the administrator, before the job
        backend.devices()[1].set_power_limit(ADMIN_W)
    before = _snapshot(settings)
    assert before == [(400.0, None, False), (ADMIN_W, None, False)]
    start_w = [400.0, ADMIN_W]
    sessions = _sessions(tmp_path / "out")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        applied, phases = _train(sessions, 3)
    assert not caught, [str(w.message) for w in caught]
    assert len(applied) == 3, [session.phase for session in sessions]
    plan = FrequencyPlan.read(tmp_path / "out" / "plan.json")
    assert plan.policy == "power-budget"
    # what `powerlib plan profile.csv --policy power-budget` re-plans from, P_block included
    assert Profile.read(tmp_path / "out" / "profile.csv").p_block_w is not None
    assert "check" not in phases  # no closed loop: its all-max windows would break the budget
    planned = [plan.power_limit_w(s) for s in range(STAGES)]
    for limits_w in applied:  # what the GPUs held while the plan ran
        assert limits_w == pytest.approx(planned, abs=0.01)
        assert all(w is not None and w <= w0 + 1e-9 for w, w0 in zip(limits_w, start_w))
        assert sum(w for w in limits_w if w is not None) <= BUDGET_W + 1e-9
        assert limits_w != pytest.approx(start_w)  # the plan changed a limit
    for s, session in enumerate(sessions):  # and locked the clocks its limits run at
        assert [f for _, f in session.first_apply_requests] == plan.frequencies(s)
    assert min(plan.frequencies(0)) < 1410.0
    assert _snapshot(settings) == before  # the administrator's 250 W stays, GPU 0 back at 400 W
