"""``powerlib check`` on the fakes: root, no root, an existing lock, MIG, a lost GPU, --load.

The NVIDIA cases run the real NVIDIA backend on powerlib's fake pynvml (``sys.modules["pynvml"]``,
nvidia-ml-py's real error types); the rest run the simulated backend. Durations are a few tens
of milliseconds: what is asserted is what the check reports, never how fast it ran.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner
from uid_helpers import NOBODY, NOGROUP, as_uid

from powerlib.backends.simulated import SimulatedBackend
from powerlib.cli import cli
from powerlib.config import Settings
from powerlib.measurement.counter_period import measure_counter
from powerlib.node_check.check import check_node
from powerlib.node_check.report import SCHEMA

pytest.importorskip("pynvml")

from powerlib.backends.nvidia import NvidiaBackend  # noqa: E402
from powerlib.testing.fake_nvml import A100_SXM4_40GB, FakeNvml  # noqa: E402

NVIDIA = {"POWERLIB_BACKEND": "nvidia"}
SIM = {"POWERLIB_BACKEND": "simulated", "POWERLIB_SIM_GPUS": "2"}
SHORT = ("--duration-s", "0.02")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (and CAP_SYS_ADMIN)")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    nvml = FakeNvml([A100_SXM4_40GB, A100_SXM4_40GB])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def run(*args: str, env: dict[str, str]) -> Any:
    return CliRunner().invoke(cli, ["check", *args], env=env, catch_exceptions=False)


def run_json(*args: str, env: dict[str, str]) -> tuple[int, dict[str, Any]]:
    result = run(*args, "--json", env=env)
    return result.exit_code, json.loads(result.stdout)


def sets_clocks(nvml: FakeNvml) -> list[str]:
    return [c for c in nvml.calls if "LockedClocks" in c or "SetPowerManagement" in c]


@needs_root
def test_root_nvidia_node_is_ready_with_versions_scope_and_measured_reads(fake: FakeNvml) -> None:
    code, data = run_json(*SHORT, env=NVIDIA)
    assert code == 0 and data["schema"] == SCHEMA == "powerlib.check.v1"
    assert data["ready"] is True and data["exit_code"] == 0
    versions = data["backend"]["versions"]
    assert data["backend"]["name"] == "nvidia"
    assert versions["driver"] == "550.54.15" and versions["nvml"] == "12.550.54.15"
    assert [d["index"] for d in data["devices"]] == [0, 1]
    for dev in data["devices"]:
        assert dev["verdict"] == "ready" and dev["exit_code"] == 0 and dev["reasons"] == []
        assert dev["permission"] == "root" and dev["control_refusal"] is None
        assert dev["persistence_mode"] is True and dev["mig_enabled"] is False
        assert dev["power_scope"].startswith("board")
        assert dev["power_limit_w"] == dev["default_power_limit_w"] == 400.0
        counter = dev["energy_counter"]
        assert counter["has_counter"] is True and counter["reads"] >= 9
        assert 0 < counter["read_cost_median_s"] <= counter["read_cost_p99_s"]
        # The fake's counter moves only when a test advances it: the period is only bounded.
        assert counter["changes"] == 0 and counter["period_bound"] == "at_least"
        assert dev["warnings"] == []  # 20 ms without a change says nothing yet
        assert dev["landing_latency"] is None
    assert sets_clocks(fake) == []  # without --load nothing is changed

    text = run("--duration-s", "0.5", "--device", "0", env=NVIDIA)
    assert text.exit_code == 0
    assert text.stdout.count("verdict           ready") == 1
    assert "warning           the energy counter did not change in" in text.stdout
    assert "driver 550.54.15" in text.stdout and "node: ready" in text.stdout


def test_without_root_every_device_is_not_ready_with_the_ways_out() -> None:
    # pytest's tmp_path lies under a folder only root may enter: nobody gets one in /tmp.
    state = Path(tempfile.mkdtemp(prefix="powerlib-check-"))
    os.chown(state, NOBODY, NOGROUP)

    def check_as_nobody() -> dict[str, Any]:
        nvml = FakeNvml([A100_SXM4_40GB, A100_SXM4_40GB])
        with NvidiaBackend(Settings(backend="nvidia", state_dir=state), nvml=nvml) as backend:
            report = check_node(backend, duration_s=0.02, load=True)
        sim = Settings(backend="simulated", state_dir=state, sim_gpus=1)
        with SimulatedBackend(sim) as backend:  # needs no privilege: changed directly
            simulated = check_node(backend, duration_s=0.02)
        return {
            "report": report.to_json(),
            "writes": sets_clocks(nvml),
            "simulated": simulated.to_json(),
        }

    try:
        out = as_uid(NOBODY, check_as_nobody, timeout_s=30.0)
    finally:
        shutil.rmtree(state)
    assert out["ok"], out
    report, writes = out["value"]["report"], out["value"]["writes"]
    assert report["exit_code"] == 4 and report["ready"] is False
    for dev in report["devices"]:
        assert dev["permission"] == "none" and dev["exit_code"] == 4
        assert "not root (uid 65534)" in dev["control_refusal"]
        assert "POWERLIB_BACKEND=agent" in dev["control_refusal"]
        assert dev["verdict"] == "not ready: " + dev["control_refusal"]
        assert dev["landing_latency"]["measured"] is False  # --load changes nothing then
    assert writes == []
    simulated = out["value"]["simulated"]
    assert simulated["exit_code"] == 0
    assert simulated["devices"][0]["permission"] == "direct"


@needs_root
def test_an_existing_lock_and_limit_are_reported_and_load_leaves_them_alone(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # GPU 1 gets no load: nothing is changed
    fake.gpus[0].locked_mhz = (900, 1200)  # an administrator's lock, set before powerlib opens
    fake.gpus[1].power_limit_mw = 300_000
    code, data = run_json(*SHORT, "--load", env=NVIDIA)
    assert code == 0  # warnings, not reasons: a session can still run
    locked, limited = data["devices"]
    assert locked["clock_lock"]["locked"] is True  # NVML: event reason 0x2
    assert "clocks_locked_or_app_clocks" in locked["clock_lock"]["reasons"]
    assert (
        "a clock lock is already in force (range not reported by the driver)" in locked["warnings"]
    )
    assert locked["landing_latency"] == {
        "measured": False,
        "reason": "a clock lock is already in force (measuring would replace it)",
        "load": None,
        "low_mhz": None,
        "high_mhz": None,
        "samples_s": [],
        "missed": 0,
        "median_s": None,
        "max_s": None,
    }
    assert limited["clock_lock"]["locked"] is not True
    assert "the power limit is 300 W, not the default 400 W" in limited["warnings"]
    assert fake.gpus[0].locked_mhz == (900, 1200) and fake.gpus[1].power_limit_mw == 300_000
    assert sets_clocks(fake) == []


def test_an_existing_lock_on_the_simulator_is_reported_with_its_range() -> None:
    set_ = CliRunner().invoke(
        cli, ["set", "--device", "1", "--freq-range-mhz", "900", "1200"], env=SIM
    )
    assert set_.exit_code == 0, set_.output
    code, data = run_json(*SHORT, env=SIM)
    assert code == 0
    free, locked = data["devices"]
    assert free["clock_lock"]["locked"] is False and free["warnings"] == []
    assert locked["clock_lock"]["range_mhz"] == [900.0, 1200.0]
    assert "a clock lock is already in force (900-1200 MHz)" in locked["warnings"]
    assert locked["verdict"] == "ready" and locked["power_scope"] == "simulated"


@needs_root
def test_mig_makes_that_gpu_not_ready_with_exit_5(fake: FakeNvml) -> None:
    fake.gpus[1].mig_mode = 1
    code, data = run_json(*SHORT, env=NVIDIA)
    assert code == 5 and data["exit_code"] == 5
    ok, mig = data["devices"]
    assert ok["verdict"] == "ready" and ok["mig_enabled"] is False
    assert mig["mig_enabled"] is True and mig["exit_code"] == 5
    assert mig["verdict"].startswith("not ready: MIG is enabled")
    text = run(*SHORT, env=NVIDIA)
    assert text.exit_code == 5 and "not ready: MIG is enabled" in text.stdout
    assert "node: not ready (1 of 2 device(s) ready; exit 5)" in text.stdout


@needs_root
def test_a_lost_gpu_is_its_own_verdict_and_the_others_are_still_checked(
    fake: FakeNvml, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    with NvidiaBackend(settings, nvml=fake) as backend:  # GPU 0 falls off the bus once open
        fake.fail("nvmlDeviceGetTotalEnergyConsumption", fake.NVML_ERROR_GPU_IS_LOST, device=0)
        report = check_node(backend, duration_s=0.02)
    lost, ok = report.devices
    assert lost.exit_code == 9 and lost.verdict.startswith("not ready: device lost: ")
    assert "fell off the bus" in lost.verdict
    assert ok.ready and ok.counter is not None and ok.counter.reads >= 9
    assert report.exit_code == 9

    # Through the CLI: the lost GPU is the second one, the first still gets its verdict.
    fake = FakeNvml([A100_SXM4_40GB, A100_SXM4_40GB])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    fake.fail("nvmlDeviceGetClockInfo", fake.NVML_ERROR_GPU_IS_LOST, device=1)
    result = run(*SHORT, env=NVIDIA)
    assert result.exit_code == 9
    assert result.stdout.count("verdict           ready") == 1
    assert "not ready: device lost: nvmlDeviceGetClockInfo" in result.stdout


def test_json_is_one_object_and_device_selects_one() -> None:
    result = run(*SHORT, "--device", "1", "--json", env=SIM)
    data = json.loads(result.stdout)  # the whole of stdout is one JSON document
    assert result.exit_code == data["exit_code"] == 0
    assert set(data) == {"schema", "ready", "exit_code", "backend", "duration_s", "load", "devices"}
    assert data["duration_s"] == 0.02 and data["load"] is False
    assert [d["index"] for d in data["devices"]] == [1]
    assert data["backend"]["versions"]["model"].startswith("a100")
    bad = run("--device", "7", env=SIM)
    assert bad.exit_code == 6 and bad.stderr.startswith("powerlib: error: no device with index 7")


def test_an_unavailable_backend_exits_3_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    code, data = run_json(env=NVIDIA)
    assert code == 3 and data["exit_code"] == 3 and data["devices"] == []
    assert data["backend"]["available"] is False and "pynvml" in data["backend"]["error"]
    text = run(env=NVIDIA)
    assert text.exit_code == 3 and "the nvidia backend cannot start" in text.stdout


def test_load_on_the_simulator_measures_the_configured_landing_latency() -> None:
    env = {
        **SIM,
        "POWERLIB_SIM_GPUS": "1",
        "POWERLIB_SIM_SWITCH_LATENCY_S": "0.03",
        "POWERLIB_SIM_LATENCY_SPREAD": "0",
    }
    code, data = run_json(*SHORT, "--load", env=env)
    assert code == 0, data
    latency = data["devices"][0]["landing_latency"]
    assert latency["measured"] is True and latency["load"] == "simulated work"
    assert (latency["low_mhz"], latency["high_mhz"]) == (510.0, 1110.0)
    assert len(latency["samples_s"]) == 6 and latency["missed"] == 0
    # A change cannot show before it lands; the bound above only says it is that change, not
    # the 1 s timeout, that was timed.
    assert all(s >= 0.03 for s in latency["samples_s"])
    assert 0.03 <= latency["median_s"] <= latency["max_s"] < 0.5
    status = CliRunner().invoke(cli, ["status", "--json"], env=env)
    device = json.loads(status.stdout)["devices"][0]
    assert device["locked_sm_freqs_mhz"] is None  # the session put the clock back
    state_dir = Path(os.environ["POWERLIB_STATE_DIR"])
    assert list((state_dir / "journal").iterdir()) == []


@needs_root
def test_load_without_torch_on_nvidia_is_skipped_and_changes_nothing(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # as on a node without torch
    code, data = run_json(*SHORT, "--load", env=NVIDIA)
    assert code == 0
    for dev in data["devices"]:
        assert dev["landing_latency"]["measured"] is False
        assert dev["landing_latency"]["reason"] == "no load: torch is not installed"
    assert sets_clocks(fake) == []


def test_counter_period_and_read_cost_are_measured_from_the_reads(settings: Settings) -> None:
    sim = Settings(
        backend="simulated",
        state_dir=settings.state_dir,
        sim_clock="virtual",
        sim_read_cost_s=0.004,
        sim_energy_period_s=0.1,
    )
    with SimulatedBackend(sim) as backend:
        counter = measure_counter(backend.device(0), 2.0, clock=backend.clock.now)
    assert counter.read_cost_median_s == pytest.approx(0.004)
    assert counter.read_cost_p99_s == pytest.approx(0.004)
    assert counter.reads == 500 and counter.changes == 20
    assert counter.period_bound == "estimate"
    assert counter.period_s == pytest.approx(0.1, rel=0.05)


def test_the_load_runs_on_the_cuda_device_with_the_nvml_uuid(fake: FakeNvml, settings) -> None:
    from powerlib.node_check.landing import _cuda_ordinal

    def torch_with(uuids: list[str | None]) -> Any:
        props = [SimpleNamespace(uuid=u) for u in uuids]
        cuda = SimpleNamespace(
            device_count=lambda: len(props), get_device_properties=props.__getitem__
        )
        return SimpleNamespace(cuda=cuda)

    with NvidiaBackend(settings, nvml=fake) as backend:
        first, second = backend.devices()
        bare = [
            d.device_id.removeprefix("GPU-") for d in (second, first)
        ]  # CUDA lists them swapped
        assert _cuda_ordinal(torch_with(bare), first, backend) == 1
        assert _cuda_ordinal(torch_with(bare), second, backend) == 0
        assert _cuda_ordinal(torch_with([None, None]), second, backend) == 1  # no UUIDs: by index
        with pytest.raises(Exception, match="no CUDA device has this GPU's UUID"):
            _cuda_ordinal(torch_with([bare[0]]), first, backend)
