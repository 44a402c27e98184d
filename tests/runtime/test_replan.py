"""Re-planning at run time: a new straggler deadline, solved off the training thread."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from runtime_helpers import emulated_sessions, make_emulator, toy_profile

from powerlib.errors import InvalidArgumentError


def _planned(tmp_path: Path, **kwargs):
    profile = toy_profile()
    profile.write_csv(tmp_path / "profile.csv")
    emulator = make_emulator(profile, 4)
    sessions = emulated_sessions(
        emulator,
        None,
        mode="plan",
        profile_path=tmp_path / "profile.csv",
        p_block_w=80.0,
        switch_latency_s=0.0,
        **kwargs,
    )
    return emulator, sessions


def test_every_rank_switches_to_the_new_deadline_at_the_same_boundary(tmp_path: Path) -> None:
    emulator, sessions = _planned(tmp_path)
    with contextlib.ExitStack() as stack:
        for s in sessions:
            stack.enter_context(s)
        first = [emulator.run_iteration(sessions) for _ in range(2)]
        fastest_s = first[-1].time_s
        old = [s.plan for s in sessions]
        deadline_s = fastest_s * 1.25
        for s in sessions:
            s.replan(deadline_s)
        with pytest.raises(InvalidArgumentError, match="still pending"):
            sessions[1].replan(deadline_s)
        sessions[0]._flow.pending_replan.solve.result(
            timeout=60
        )  # rank 0's planning thread is done
        after = [emulator.run_iteration(sessions) for _ in range(3)]
    switched = [s.replans for s in sessions]
    assert all(len(r) == 1 for r in switched)
    assert len({r[0].iteration for r in switched}) == 1  # the same boundary on every rank
    assert all(r[0].deadline_s == deadline_s for r in switched)
    for s, before in zip(sessions, old):
        assert s.plan is not before and s.plan.policy == "deadline"
        assert s.plan.workload["deadline_s"] == pytest.approx(deadline_s)
    # the new plan runs slower, within the deadline, for less energy
    assert fastest_s < after[-1].time_s <= deadline_s * 1.001
    assert after[-1].energy_j < first[-1].energy_j
    ran = {
        (ex.instruction.stage, ex.instruction.kind, ex.instruction.microbatch): ex.segments[-1][2]
        for ex in after[-1].executed
    }
    for s in sessions:
        for p in s.plan.stages[s.stage]:
            ins = p.instruction
            assert ran[(ins.stage, ins.kind, ins.microbatch)] == p.freq_mhz


def test_replan_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    emulator, sessions = _planned(tmp_path)
    with pytest.raises(InvalidArgumentError, match="before it was entered"):
        sessions[0].replan(1.0)
    with contextlib.ExitStack() as stack:
        for s in sessions:
            stack.enter_context(s)
        emulator.run_iteration(sessions)
        for bad in (0.0, -1.0, float("nan"), "3"):
            with pytest.raises(InvalidArgumentError, match="positive number"):
                sessions[0].replan(bad)  # type: ignore[arg-type]
        assert all(s.replans == () for s in sessions)


def test_the_megatron_helper_needs_an_attached_session() -> None:
    from powerlib.integrations import megatron

    with pytest.raises(InvalidArgumentError, match="no powerlib session is attached"):
        megatron.replan(3.0)
