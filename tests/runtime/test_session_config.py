"""Configuration objects in: ``Session.from_config`` runs as the flat keywords do."""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path

import pytest
from runtime_helpers import emulated_sessions, make_emulator, toy_profile

import powerlib
from powerlib.errors import InvalidArgumentError
from powerlib.runtime import ApplyConfig, ProfileConfig, RunConfig, Session, optimize
from powerlib.runtime.coordination import LocalGroup
from powerlib.runtime.planning_step import PlanSpec


def _results(emulator, sessions, iterations: int) -> list[tuple[float, float, tuple[str, ...]]]:
    with contextlib.ExitStack() as stack:
        for session in sessions:
            stack.enter_context(session)
        runs = [emulator.run_iteration(sessions) for _ in range(iterations)]
    return [(r.time_s, r.energy_j, r.phases) for r in runs]


def test_from_config_runs_exactly_as_the_flat_keywords() -> None:
    flat_emulator = make_emulator(toy_profile(), 4)
    flat = emulated_sessions(flat_emulator, None, schedule="1f1b", num_chunks=1, placement="looped")
    emulator = make_emulator(toy_profile(), 4)
    group = LocalGroup(4)
    spec = PlanSpec(num_stages=4, num_microbatches=4)
    profile = ProfileConfig(warmup_iterations=1, settle_iterations=1, iterations_per_freq=1)
    sessions = [
        Session.from_config(
            spec,
            profile=profile,
            apply=ApplyConfig(threaded=False, check_rounds=0),  # as emulated_sessions
            run=RunConfig(
                stage=s,
                backend=emulator.backend,
                device=s,
                coordinator=group.member(s),
                clock=emulator.clock,
                progress=False,
            ),
        )
        for s in range(4)
    ]
    assert sessions[0].spec == flat[0].spec
    expected = _results(flat_emulator, flat, 20)
    assert expected[-1][2] == ("apply",) * 4
    assert _results(emulator, sessions, 20) == expected


def test_the_configs_are_checked_when_they_are_made() -> None:
    with pytest.raises(InvalidArgumentError, match="mode must be one of"):
        RunConfig(mode="train")
    with pytest.raises(InvalidArgumentError, match="needs plan_path"):
        RunConfig(mode="apply")
    with pytest.raises(InvalidArgumentError, match="warmup_iterations"):
        ProfileConfig(warmup_iterations=-1)
    assert ProfileConfig(freqs_mhz=[1410.0, 990.0]).freqs_mhz == (1410.0, 990.0)


def test_optimize_spells_out_every_session_keyword(tmp_path: Path) -> None:
    signature = inspect.signature(optimize)
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in signature.parameters.values())
    assert list(signature.parameters) == list(inspect.signature(Session).parameters)
    assert powerlib.optimize is optimize
    for name in signature.parameters:
        assert f"        {name}: " in (optimize.__doc__ or ""), name
