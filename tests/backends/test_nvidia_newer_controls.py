"""NVIDIA's newer controls on the fake pynvml (issue 47, docs/real-gpu.md §8).

CUDA 13 deprecates application clocks, ``nvmlDeviceGetTemperature`` and the throttle-reason
calls; CUDA 14 removes them (``NVML_ERROR_DEPRECATED``). Blackwell adds power smoothing and
workload power profiles; a facility or another tool can hold a power limit powerlib did not set.
Nothing here ran on a real NVIDIA GPU: the fake raises nvidia-ml-py's real error types.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from powerlib.backends.nvidia import NvidiaBackend
from powerlib.cli import cli
from powerlib.config import Settings
from powerlib.control import ControlSession
from powerlib.node_check.check import check_node
from powerlib.testing.fake_nvml import A100_SXM4_40GB, H100_SXM5_80GB, FakeNvml

pynvml = pytest.importorskip("pynvml")

# The calls CUDA 14 removes that powerlib ever used (kept here, not imported: the test must run
# on the code before the change, where the backend had no such list).
REMOVED = (
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetApplicationsClock",
    "nvmlDeviceGetDefaultApplicationsClock",
    "nvmlDeviceSetApplicationsClocks",
    "nvmlDeviceResetApplicationsClocks",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetSupportedClocksThrottleReasons",
)
VOLATILE = ("energy_counter", "duration_s")  # measured timings: differ run to run


def _blackwell_like(fake: FakeNvml) -> None:
    """GPU 0: smoothing on (420 W floor) and LLM training; GPU 1: a facility's 500 W limit."""
    gpu = fake.gpus[0]
    gpu.power_smoothing, gpu.power_floor_w, gpu.smoothing_preset = True, 420.0, 1
    gpu.workload_profiles = (7,)  # NVML_POWER_PROFILE_LLM_TRAINING
    fake.gpus[1].facility_limit_mw = 500_000


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeNvml:
    nvml = FakeNvml([H100_SXM5_80GB, H100_SXM5_80GB, A100_SXM4_40GB])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("POWERLIB_STATE_DIR", str(tmp_path / "state"))
    return nvml


def _cli(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args), env={"POWERLIB_BACKEND": "nvidia"})


def _check_json() -> dict[str, Any]:
    result = _cli("check", "--duration-s", "0.02", "--json")
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def test_check_json_reports_smoothing_profile_and_foreign_limit(fake: FakeNvml) -> None:
    _blackwell_like(fake)
    smoothing, facility, a100 = _check_json()["devices"]
    assert smoothing["power_smoothing"] == {"enabled": True, "floor_w": 420.0, "preset_profile": 1}
    assert smoothing["workload_power_profiles"] == ["llm_training"]
    assert "power smoothing holds the GPU's power at or above 420 W" in " ".join(
        smoothing["warnings"]
    )
    assert "foreign_power_limit" not in smoothing  # its limit is the default
    limit = facility["foreign_power_limit"]
    assert (limit["limit_w"], limit["default_w"]) == (500.0, 700.0)
    assert limit["set_by"].startswith("out of band")
    # a GPU without them (A100) has no such keys at all, not null
    for key in ("power_smoothing", "workload_power_profiles", "foreign_power_limit"):
        assert key not in a100
    assert "power_smoothing" not in facility and "workload_power_profiles" not in facility

    text = _cli("check", "--duration-s", "0.02").stdout
    assert "power smoothing   on, floor 420 W (preset profile 1)" in text
    assert "power profile     llm_training" in text
    assert "foreign limit     500 W (default 700 W), set out of band" in text


def test_status_reports_smoothing_and_profile_where_the_gpu_has_them(fake: FakeNvml) -> None:
    _blackwell_like(fake)
    result = _cli("status", "--json")
    assert result.exit_code == 0, result.output
    smoothing, facility, a100 = (d["details"] for d in json.loads(result.stdout)["devices"])
    assert smoothing["power_smoothing"]["floor_w"] == 420.0
    assert smoothing["workload_power_profiles"] == ["llm_training"]
    assert facility["enforced_power_limit_w"] == 500.0
    assert "power_smoothing" not in a100 and "workload_power_profiles" not in a100
    # the facility's limit, as `check` reports it; absent where the limit is powerlib's or default
    devices = json.loads(result.stdout)["devices"]
    assert devices[1]["foreign_power_limit"]["limit_w"] == 500.0
    assert "foreign_power_limit" not in devices[0] and "foreign_power_limit" not in devices[2]
    text = _cli("status").stdout
    assert text.count("foreign limit") == 1
    assert "500 W (default 700 W), set out of band" in text
    assert '"floor_w": 420.0' in _cli("status", "--device", "0").stdout


def test_a_limit_set_by_another_tool_is_foreign_until_a_powerlib_journal_holds_it(
    fake: FakeNvml, tmp_path: Path
) -> None:
    fake.gpus[0].power_limit_mw = 450_000  # nvidia-smi -pl 450, before powerlib opens
    first = _check_json()["devices"][0]["foreign_power_limit"]
    assert first["limit_w"] == 450.0 and first["set_by"].startswith("by another tool")
    settings = Settings(backend="nvidia", state_dir=tmp_path / "state")
    with NvidiaBackend(settings, nvml=fake) as backend:
        with ControlSession(backend, guardian=False, handle_signals=False) as session:
            session.set_power_limit(1, 600.0)  # powerlib's own change: journaled
            report = check_node(backend, duration_s=0.02).to_json()["devices"]
    assert [d.get("foreign_power_limit") is None for d in report] == [False, True, True]


def test_the_default_path_calls_nothing_cuda_13_deprecates(fake: FakeNvml) -> None:
    fake.nvml_version = "13.580.65"
    fake.gpus[0].locked_mhz = (900, 1200)  # the event reason that used to ask app clocks
    assert len(_check_json()["devices"]) == 3
    assert _cli("status", "--json").exit_code == 0
    assert _cli("devices", "--json").exit_code == 0
    called = [c for c in fake.calls if c in REMOVED]
    assert called == [], called


def _user_view(fake: FakeNvml) -> dict[str, Any]:
    check = _check_json()
    for dev in check["devices"]:
        for key in VOLATILE:
            dev.pop(key, None)
    check.pop("duration_s")
    status = json.loads(_cli("status", "--json").stdout)
    for dev in status["devices"]:
        dev.pop("timestamp_s", None)
        dev.pop("energy_j", None)
    return {"check": check, "status": status}


def test_cuda_14_removals_change_nothing_a_user_sees(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    views = []
    for removed in (False, True):
        fake = FakeNvml([H100_SXM5_80GB, A100_SXM4_40GB])
        fake.gpus[0].locked_mhz = (900, 1200)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        monkeypatch.setenv("POWERLIB_STATE_DIR", str(tmp_path / f"state-{removed}"))
        if removed:
            for name in REMOVED:  # what a CUDA 14 driver answers
                fake.fail(name, pynvml.NVML_ERROR_DEPRECATED)
        views.append(_user_view(fake))
    assert views[0]["status"]["devices"][0]["temperature_c"] is not None
    assert views[1] == views[0]


def test_the_fakes_cuda_14_mode_raises_deprecated_for_the_removals() -> None:
    fake = FakeNvml([H100_SXM5_80GB])
    fake.cuda14 = True
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError) as info:
        fake.nvmlDeviceGetTemperature(handle, 0)
    assert info.value.value == pynvml.NVML_ERROR_DEPRECATED
    assert fake.nvmlDeviceGetTemperatureV(handle, 0) > 0


def test_an_older_binding_or_driver_falls_back_to_the_deprecated_names(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fake, "nvmlDeviceGetTemperatureV", None)  # a binding before R575
    fake.fail("nvmlDeviceGetCurrentClocksEventReasons", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    fake.gpus[0].locked_mhz = (900, 1200)
    with NvidiaBackend(Settings(backend="nvidia"), nvml=fake) as backend:
        dev = backend.device(0)
        assert dev.read_state().temperature_c is not None
        assert dev.read_sm_lock().locked is True
    assert "nvmlDeviceGetTemperature" in fake.calls
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" in fake.calls


@pytest.mark.parametrize(
    "name",
    [
        "nvmlDeviceGetTemperatureV",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceSetApplicationsClocks",
        "nvmlDeviceResetApplicationsClocks",
        "nvmlDeviceWorkloadPowerProfileGetCurrentProfiles",
    ],
)
def test_the_fakes_newer_calls_have_nvidia_ml_pys_signature(name: str) -> None:
    def required(fn: Any) -> list[str]:
        params = inspect.signature(fn).parameters.values()
        return [p.name for p in params if p.default is p.empty]

    assert required(getattr(FakeNvml(), name)) == required(getattr(pynvml, name))
