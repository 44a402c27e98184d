"""One nested configuration in: ``Session(config)`` runs exactly as ``powerlib.optimize``'s flat
keywords do, and every keyword is one field, declared and documented once."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from pathlib import Path

import pytest
from runtime_helpers import emulated_sessions, make_emulator, toy_profile

import powerlib
from powerlib.errors import InvalidArgumentError, PlanError
from powerlib.runtime import (
    ApplyConfig,
    PolicyConfig,
    RunConfig,
    Session,
    SessionConfig,
    SweepConfig,
    WorkloadConfig,
    optimize,
)
from powerlib.runtime.coordination import LocalGroup
from powerlib.runtime.session_config import Layout, Mode, keywords_of_parts


def _results(emulator, sessions, iterations: int) -> list[tuple[float, float, tuple[str, ...]]]:
    with contextlib.ExitStack() as stack:
        for session in sessions:
            stack.enter_context(session)
        runs = [emulator.run_iteration(sessions) for _ in range(iterations)]
    return [(r.time_s, r.energy_j, r.phases) for r in runs]


def test_a_nested_config_runs_exactly_as_the_flat_keywords() -> None:
    flat_emulator = make_emulator(toy_profile(), 4)
    flat = emulated_sessions(flat_emulator, None, schedule="1f1b", num_chunks=1, placement="looped")
    emulator = make_emulator(toy_profile(), 4)
    group = LocalGroup(4)
    sessions = [
        Session(
            SessionConfig(
                workload=WorkloadConfig(
                    num_stages=4, num_microbatches=4, schedule="1f1b", num_chunks=1,
                    placement="looped",
                ),
                sweep=SweepConfig(
                    warmup_iterations=1, settle_iterations=1, iterations_per_freq=1,
                    reference_iterations=1, rotating_reference=False, target_time_error=0.5,
                ),  # fmt: skip
                apply=ApplyConfig(threaded=False, check_rounds=0),  # as emulated_sessions
                run=RunConfig(
                    stage=s,
                    backend=emulator.backend,
                    device=s,
                    coordinator=group.member(s),
                    clock=emulator.clock,
                    progress=False,
                    out_dir=None,
                ),
            )
        )
        for s in range(4)
    ]  # fmt: skip
    assert sessions[0].config.workload == flat[0].config.workload
    assert sessions[0].config.sweep == flat[0].config.sweep
    expected = _results(flat_emulator, flat, 20)
    assert expected[-1][2] == ("apply",) * 4
    assert _results(emulator, sessions, 20) == expected


def test_the_configs_are_checked_when_they_are_made() -> None:
    with pytest.raises(InvalidArgumentError, match="mode must be one of"):
        RunConfig(mode="train")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="needs plan_path"):
        RunConfig(mode=Mode.APPLY)
    with pytest.raises(InvalidArgumentError, match="warmup_iterations"):
        SweepConfig(warmup_iterations=-1)
    with pytest.raises(PlanError, match="unknown policy"):
        PolicyConfig(policy="cheapest")
    with pytest.raises(PlanError, match="v placement needs num_chunks=2"):
        WorkloadConfig(num_stages=2, num_microbatches=2, placement="v")
    assert SweepConfig(freqs_mhz=(1410.0, 990.0)).freqs_mhz == (1410.0, 990.0)
    assert RunConfig(mode="plan", profile_path="p.csv").mode is Mode.PLAN  # type: ignore[arg-type]
    assert RunConfig().out_dir == Path("powerlib-out")


def test_the_adapter_maps_every_keyword_onto_one_field() -> None:
    config = SessionConfig.from_keywords(
        num_stages=2, num_microbatches=3, schedule="gpipe", policy="min-energy",
        freqs_mhz=[990, 1410], prefetch=False, mode="profile", out_dir="here",
    )  # fmt: skip
    assert config.workload == WorkloadConfig(num_stages=2, num_microbatches=3, schedule="gpipe")
    assert config.policy == PolicyConfig(policy="min-energy")
    assert config.sweep.freqs_mhz == (1410.0, 990.0)
    assert config.apply == ApplyConfig(prefetch=False)
    assert config.run.mode is Mode.PROFILE and config.run.out_dir == Path("here")
    # an empty list of clocks: every supported one, as before
    assert (
        SessionConfig.from_keywords(num_stages=1, num_microbatches=1, freqs_mhz=[]).sweep.freqs_mhz
        is None
    )
    # layout not stated stays None (a saved plan is checked against the stated parts only)
    layout = SessionConfig.from_keywords(num_stages=1, num_microbatches=1).workload
    assert (layout.schedule, layout.num_chunks, layout.placement) == (None, None, None)
    assert layout.layout == Layout("1f1b", 1, "looped")
    with pytest.raises(TypeError, match="num_stage"):
        optimize(num_stage=2, num_microbatches=1)
    with pytest.raises(TypeError, match="num_microbatches"):
        optimize(num_stages=2)


def test_each_field_is_declared_once_and_optimize_spells_out_every_keyword() -> None:
    names = [name for name, _, _ in keywords_of_parts()]
    assert len(names) == len(set(names))  # one field per keyword, across the parts
    signature = inspect.signature(optimize)
    assert list(signature.parameters) == names
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in signature.parameters.values())
    assert signature.parameters["max_slowdown"].default == 0.001
    assert signature.parameters["warmup_iterations"].default == 2
    assert signature.parameters["out_dir"].default == Path("powerlib-out")
    assert signature.parameters["num_stages"].default is inspect.Parameter.empty
    assert powerlib.optimize is optimize
    kinds = {"workload": WorkloadConfig, "policy": PolicyConfig, "sweep": SweepConfig,
             "apply": ApplyConfig, "run": RunConfig}  # fmt: skip
    for name, part, _ in keywords_of_parts():
        assert f"        {name}: " in (kinds[part].__doc__ or ""), name  # documented in its part
    for kind in kinds.values():
        assert kind.__name__ in (optimize.__doc__ or "")  # and optimize points there


def test_session_takes_one_config() -> None:
    with pytest.raises(TypeError, match="unexpected keyword"):
        Session(num_stages=2, num_microbatches=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="one SessionConfig"):
        Session({"num_stages": 2})  # type: ignore[arg-type]
    config = SessionConfig(workload=WorkloadConfig(num_stages=2, num_microbatches=2))
    assert Session(config).config is config
    assert dataclasses.replace(config, policy=PolicyConfig(policy="deadline", deadline_ratio=1.1))
