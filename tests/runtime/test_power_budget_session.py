"""The power-budget policy in a session, on emulated GPUs (issue 47, item 1; docs/perseus.md §7).

Rank 0 plans per-stage power limits inside the budget from the gathered profile; every rank
sets its stage's limit through the control session (never above the limit its GPU had when the
session started) and locks the plan's clocks; every limit is back when the session ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from pathlib import Path

import pytest
from runtime_helpers import emulated_sessions, make_emulator, toy_profile

from powerlib.errors import InvalidArgumentError, PlanError
from powerlib.planning.plan import FrequencyPlan
from powerlib.runtime.session import optimize

STAGES = 4
DEFAULT_LIMIT_W = 400.0  # the toy profile's highest power: the GPUs never throttle at it


def _with_power_limits(emulator):
    """The emulated GPUs with a settable power limit, as a real GPU's driver offers one.

    A set limit goes to the emulator's throttle model (``EmulatedDevice.power_limit_w``: the
    clock throttles to hold it); a read returns it (the default when none is set).
    """
    for dev in emulator.devices:
        info = dev.info
        dev._info = dataclasses.replace(
            info,
            power_limit_range_w=(100.0, DEFAULT_LIMIT_W),
            default_power_limit_w=DEFAULT_LIMIT_W,
            capabilities=dataclasses.replace(
                info.capabilities, can_set_power_limit=True, can_reset_power_limit=True
            ),
        )

        def set_limit(limit_w: float, dev=dev) -> float:
            dev.power_limit_w = None if limit_w >= DEFAULT_LIMIT_W else float(limit_w)
            return float(limit_w)

        def read(dev=dev, real=dev._read_state):
            limit_w = DEFAULT_LIMIT_W if dev.power_limit_w is None else dev.power_limit_w
            return dataclasses.replace(real(), power_limit_w=limit_w)

        dev._set_power_limit = set_limit
        dev._reset_power_limit = lambda dev=dev: setattr(dev, "power_limit_w", None)
        dev._read_state = read
    return emulator


def _emulator():
    return _with_power_limits(make_emulator(toy_profile(STAGES)))


def _limits_w(emulator) -> list[float]:
    return [d.read_state().power_limit_w for d in emulator.devices]


def _run(emulator, sessions, iterations: int) -> list:
    """Each iteration's result, with the limits the devices held while it ran."""
    results = []
    with contextlib.ExitStack() as stack:
        for s in sessions:
            stack.enter_context(s)
        for _ in range(iterations):
            result = emulator.run_iteration(sessions)
            results.append(Ran(result.phases, _limits_w(emulator), result.time_s))
    return results


@dataclasses.dataclass
class Ran:
    phases: tuple
    limits_w: list[float]
    time_s: float


def _budget_run(tmp_path: Path, iterations: int = 30, **options: object):
    emulator = _emulator()
    before = _limits_w(emulator)
    sessions = emulated_sessions(
        emulator, tmp_path / "out", switch_latency_s=0.0, policy="power-budget", **options
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = _run(emulator, sessions, iterations)
    return emulator, before, sessions, results, [str(w.message) for w in caught]


def test_a_budget_session_sets_limits_within_the_budget_and_restores_them(tmp_path: Path) -> None:
    budget_w = 1100.0
    emulator, before, sessions, results, said = _budget_run(tmp_path, budget_w=budget_w)
    assert not said, said
    plan = FrequencyPlan.read(tmp_path / "out" / "plan.json")
    assert plan.policy == "power-budget"
    planned = [plan.power_limit_w(s) for s in range(STAGES)]
    assert all(w is not None for w in planned) and sum(planned) <= budget_w * (1 + 1e-9)
    assert any(w < b for w, b in zip(planned, before))  # the budget binds
    applied = [r for r in results if r.phases == ("apply",) * STAGES]
    assert applied, [r.phases for r in results]
    for r in applied:  # what the devices held while the plan ran: the plan's limits
        assert r.limits_w == pytest.approx(planned, abs=0.01)
        assert sum(r.limits_w) <= budget_w + 0.01
    # each stage's first applied iteration locked the plan's clocks
    for s, session in enumerate(sessions):
        assert [f for _, f in session.first_apply_requests] == plan.frequencies(s)
    assert _limits_w(emulator) == pytest.approx(before)  # every limit put back at exit
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["powerlib"]["time_s"] <= summary["uniform_cap"]["time_s"] * (1 + 1e-9)


def test_a_fraction_is_a_share_of_the_limits_the_gpus_had(tmp_path: Path) -> None:
    emulator, before, _, results, said = _budget_run(tmp_path, budget_fraction=0.7)
    assert not said, said
    plan = FrequencyPlan.read(tmp_path / "out" / "plan.json")
    planned = [plan.power_limit_w(s) for s in range(STAGES)]
    assert sum(planned) <= 0.7 * sum(before) * (1 + 1e-9)
    assert results[-1].limits_w == pytest.approx(planned, abs=0.01)
    assert _limits_w(emulator) == pytest.approx(before)


def test_an_administrators_lower_limit_is_never_raised(tmp_path: Path) -> None:
    emulator = _emulator()
    device = emulator.devices[3]  # the heaviest stage: the plan would give it the most
    low, high = device.info.power_limit_range_w
    admin_w = 330.0
    assert low <= admin_w < device.read_state().power_limit_w
    device.set_power_limit(admin_w)  # an administrator's, before the job (not journaled)
    before = _limits_w(emulator)
    sessions = emulated_sessions(
        emulator, tmp_path / "out", switch_latency_s=0.0, policy="power-budget", budget_w=1500.0
    )
    results = _run(emulator, sessions, 30)
    plan = FrequencyPlan.read(tmp_path / "out" / "plan.json")
    assert plan.power_limit_w(3) <= admin_w + 1e-9
    assert all(r.limits_w[3] <= admin_w + 0.01 for r in results)
    assert _limits_w(emulator) == pytest.approx(before)  # the administrator's limit is back


def test_a_saved_plan_above_the_limit_at_the_start_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    emulator, before, _, _, _ = _budget_run(tmp_path, budget_w=1100.0)
    plan = FrequencyPlan.read(tmp_path / "out" / "plan.json")
    emulator.devices[0].set_power_limit(plan.power_limit_w(0) - 20.0)  # lowered since
    lowered = _limits_w(emulator)
    sessions = emulated_sessions(
        emulator, tmp_path / "again", mode="apply", plan_path=tmp_path / "out" / "plan.json"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = _run(emulator, sessions, 3)
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "never raises it" in said[0], said
    assert said[0].count("stage 0") == 1
    assert results[-1].limits_w[0] == pytest.approx(lowered[0])  # never raised, on any rank
    assert _limits_w(emulator) == pytest.approx(lowered)  # and the others' back at exit
    assert before[0] != lowered[0]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"policy": "power-budget"}, "needs one budget"),
        ({"policy": "power-budget", "budget_w": 0.0}, "budget_w must be > 0"),
        ({"policy": "power-budget", "budget_w": float("nan")}, "budget_w must be > 0"),
        ({"policy": "power-budget", "budget_fraction": 1.5}, "at most 1"),
        ({"policy": "power-budget", "budget_w": 900, "budget_fraction": 0.8}, "one budget"),
        ({"policy": "fastest", "budget_w": 900}, "needs policy 'power-budget'"),
    ],
)
def test_a_bad_budget_is_one_clear_error_before_anything_opens(options: dict, match: str) -> None:
    with pytest.raises(PlanError, match=match) as err:
        optimize(num_stages=2, num_microbatches=2, backend="no-such-backend", **options)
    assert "\n" not in str(err.value)


def test_a_budget_below_the_lowest_clocks_changes_nothing_and_says_why(tmp_path: Path) -> None:
    emulator, before, _, results, said = _budget_run(tmp_path, budget_w=300.0)
    assert len(said) == 1 and "power budget of 300 W is below" in said[0], said
    assert all(r.limits_w == pytest.approx(before) for r in results)


def test_the_control_session_refuses_a_limit_above_the_ceiling(tmp_path: Path) -> None:
    from powerlib.control import ControlSession

    emulator = _emulator()
    device = emulator.devices[0]
    start_w = device.read_state().power_limit_w
    with ControlSession(emulator.backend) as control:
        with pytest.raises(InvalidArgumentError, match="never raises it"):
            control.set_power_limit(device, start_w - 10.0, ceiling_w=start_w - 50.0)
        assert control.controlled_devices == []  # refused before any journal
        assert control.set_power_limit(device, start_w - 50.0, ceiling_w=start_w - 50.0)
    assert device.read_state().power_limit_w == pytest.approx(start_w)


def test_the_launch_options_carry_the_budget_as_every_other_keyword() -> None:
    """The integrations pass optimize keywords: Megatron's as JSON in POWERLIB_MEGATRON_OPTIONS."""
    from powerlib.runtime.session_config import SessionConfig

    options = json.loads('{"policy": "power-budget", "budget_fraction": 0.8}')
    config = SessionConfig.from_keywords(num_stages=4, num_microbatches=8, **options)
    assert (config.policy.policy, config.policy.budget_fraction) == ("power-budget", 0.8)
    config = SessionConfig.from_keywords(
        num_stages=4, num_microbatches=8, policy="power-budget", budget_w=2400
    )
    assert config.policy.budget_w == 2400
