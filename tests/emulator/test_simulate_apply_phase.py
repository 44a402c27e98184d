"""`powerlib simulate` replays a plan through the session's own apply phase, not a copy of it."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner
from runtime_helpers import toy_profile

from powerlib.cli import cli
from powerlib.emulator.demo import simulate_plan
from powerlib.emulator.engine import NVML_LIKE_MODEL
from powerlib.runtime.apply_phase import ApplyPhase


@pytest.fixture(scope="module")
def toy_plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A fastest plan for the toy profile (4 stages x 4 microbatches) and the profile."""
    out = tmp_path_factory.mktemp("toy")
    profile = out / "profile.csv"
    toy_profile().write_csv(profile)
    plan = out / "plan.json"
    argv = ["plan", str(profile), "--stages", "4", "--microbatches", "4", "--p-block-w", "80"]
    result = CliRunner().invoke(cli, [*argv, "--unit-time-s", "0.001", "--plan-out", str(plan)])
    assert result.exit_code == 0, result.output
    return str(plan), str(profile)


# No thermal drift: all-max runs between the plan's blocks (paired, interleaved), so with drift
# its energy would carry the warming of a slightly different time when the plan's runs change.
_NO_DRIFT = dataclasses.replace(NVML_LIKE_MODEL, drift=0.0)


def _simulate(toy_plan: tuple[str, str]) -> dict:
    plan, profile = toy_plan
    return simulate_plan(
        plan,
        profile_path=profile,
        p_block_w=80.0,
        model=_NO_DRIFT,
        switch_latency_s=0.005,
        iterations=20,
    )


def test_another_clock_request_in_the_apply_phase_changes_the_result(
    toy_plan: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _simulate(toy_plan)
    assert before["saving_percent"] > 0.0

    def lowest_clock(self: ApplyPhase, freq_mhz: float) -> None:
        lowest = min(self.controller.device.info.supported_sm_freqs_mhz)
        if self.controller.last_requested != lowest:
            self.controller.request(lowest)

    monkeypatch.setattr(ApplyPhase, "request", lowest_clock)
    after = _simulate(toy_plan)
    assert after["baseline"] == before["baseline"]  # the all-max run does not use the phase
    assert after["plan_result"]["time_s"] > before["plan_result"]["time_s"] * 1.05


def test_no_prefetch_in_the_apply_phase_changes_the_result(
    toy_plan: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _simulate(toy_plan)
    monkeypatch.setattr(ApplyPhase, "end", lambda self: None)  # clocks only at each begin
    after = _simulate(toy_plan)
    assert after["baseline"] == before["baseline"]
    assert after["plan_result"] != before["plan_result"]
