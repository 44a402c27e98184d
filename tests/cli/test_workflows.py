"""Every command's workflow, called from Python without click."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from powerlib.config import Settings
from powerlib.control import reset_devices, set_device
from powerlib.errors import PlanError, PowerlibError
from powerlib.inspection import env_report, state_json, status_json, watch_samples
from powerlib.planning.perseus.report import PlanOutputs
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.profile import Profile
from powerlib.planning.workflow import PlanRequest, plan_profile
from powerlib.registry import open_backend

PROFILE = Path(__file__).parents[2] / "powerlib/emulator/data/gpt3-175b_a100_sxm.csv"


def _settings(tmp_path: Path) -> Settings:
    return Settings.from_env().replace(backend="simulated", state_dir=tmp_path / "state")


REQUEST = PlanRequest(num_stages=8, num_microbatches=12, p_block_w=83.64, unit_time_s=0.001)


def test_plan_profile_chooses_a_plan_that_saves_energy(tmp_path: Path) -> None:
    result = plan_profile(Profile.read(PROFILE), REQUEST)
    assert result.summary.num_points == len(result.frontier.points) > 1
    assert result.choice.point.time_s == pytest.approx(result.summary.chosen.time_s)
    assert result.summary.saving_percent is not None and result.summary.saving_percent > 0
    result.write(PlanOutputs.files(plan=tmp_path / "plan.json", frontier=tmp_path / "f.csv"))
    assert FrequencyPlan.read(tmp_path / "plan.json").num_stages == 8
    assert (tmp_path / "f.csv").read_text().count("\n") == len(result.frontier.points) + 1


def test_plan_profile_refuses_a_deadline_below_t_min() -> None:
    with pytest.raises(PlanError):
        plan_profile(Profile.read(PROFILE), replace(REQUEST, policy="deadline", deadline_s=0.01))


def test_plan_profile_refuses_too_much_work_before_solving() -> None:
    with pytest.raises(PlanError, match="max-work"):
        plan_profile(Profile.read(PROFILE), replace(REQUEST, max_work=10))


def test_env_report_names_the_explicit_backend(tmp_path: Path) -> None:
    report = env_report(_settings(tmp_path))
    assert report.chosen_backend == "simulated"
    assert "simulated" in [p.backend for p in report.probes]
    assert report.to_json()["schema"] == "powerlib.env.v1"


def test_device_records_watch_and_manual_changes(tmp_path: Path) -> None:
    with open_backend(settings=_settings(tmp_path)) as backend:
        dev = backend.device("0")
        st = dev.read_state()
        assert state_json(dev, st)["device_id"] == dev.device_id
        assert "capabilities" in status_json(dev, st)
        samples = list(watch_samples([dev], 0.01, count=2))
        assert [s.sample for s in samples] == [0, 1]
        assert samples[0].avg_power_w is None
        freqs = dev.info.supported_sm_freqs_mhz
        with pytest.raises(PowerlibError):
            set_device(backend, "0", sm_clocks_mhz=(freqs[0], freqs[0]), power_limit_w=1e9)
        assert dev.read_state().locked_sm_freqs_mhz is None  # validated before any change
        done = set_device(backend, "0", sm_clocks_mhz=(freqs[0], freqs[0]))
        assert done.applied == {"locked_sm_freqs_mhz": [freqs[0], freqs[0]]}
        assert done.state.locked_sm_freqs_mhz == (freqs[0], freqs[0])
        reset = reset_devices(backend, None)
        assert reset.ok and all(o.sm_clocks == "reset" for o in reset.outcomes)
        assert dev.read_state().locked_sm_freqs_mhz is None
