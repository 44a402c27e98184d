"""The NVML backend on a fake pynvml that raises nvidia-ml-py's real error types.

Nothing here ran on a real NVIDIA GPU; tests/hardware/ holds the check for one.
"""

from __future__ import annotations

import ast
import inspect
import json
import logging
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from powerlib import (
    BackendUnavailableError,
    ConfigError,
    DeviceError,
    DeviceLostError,
    InvalidArgumentError,
    NotSupportedError,
    PermissionDeniedError,
    Settings,
)
from powerlib.backends.nvidia import NvidiaBackend
from powerlib.cli import cli
from powerlib.testing.fake_nvml import A100_SXM4_40GB, H100_SXM5_80GB, V100_SXM2_16GB, FakeNvml

pynvml = pytest.importorskip("pynvml")  # nvidia-ml-py, from the test extra
BACKEND_SOURCES = [
    Path(__file__).resolve().parents[2] / "backends" / name
    for name in ("nvidia.py", "_nvml_api.py")
]


def _open(settings: Settings, fake: FakeNvml, **changes: object) -> NvidiaBackend:
    return NvidiaBackend(settings.replace(**changes) if changes else settings, nvml=fake)


def _nvml_calls_in_backend() -> set[str]:
    return {
        node.attr
        for path in BACKEND_SOURCES
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and re.match(r"^nvml(Init|Shutdown|Device|System)", node.attr)
    }


def test_every_nvml_call_exists_in_nvidia_ml_py_with_the_fakes_signature() -> None:
    """Parity: catches NVML API drift at a dependency bump, without hardware."""
    called = _nvml_calls_in_backend()
    assert len(called) >= 20, called
    fake = FakeNvml()
    for name in sorted(called):
        real = getattr(pynvml, name, None)
        assert real is not None, f"pynvml has no {name}"
        real_params = [
            p.name for p in inspect.signature(real).parameters.values() if p.default is p.empty
        ]
        fake_params = [
            p.name
            for p in inspect.signature(getattr(fake, name)).parameters.values()
            if p.default is p.empty
        ]
        assert fake_params == real_params, f"{name}: fake {fake_params} != real {real_params}"


def test_real_error_types_are_raised_and_translated(settings: Settings) -> None:
    fake = FakeNvml()
    assert fake.NVMLError is pynvml.NVMLError
    b = _open(settings, fake)
    fake.fail("nvmlDeviceSetGpuLockedClocks", pynvml.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(PermissionDeniedError, match="root") as info:
        b.device(0).lock_sm_clocks(1200)
    assert info.value.vendor_code == 4 and info.value.operation == "lock_sm_clocks"
    assert isinstance(info.value.__cause__, pynvml.NVMLError_NoPermission)


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (pynvml.NVML_ERROR_NOT_SUPPORTED, NotSupportedError),
        (pynvml.NVML_ERROR_NO_PERMISSION, PermissionDeniedError),
        (pynvml.NVML_ERROR_GPU_IS_LOST, DeviceLostError),
        (pynvml.NVML_ERROR_UNKNOWN, DeviceError),
        (pynvml.NVML_ERROR_INVALID_ARGUMENT, InvalidArgumentError),
    ],
)
def test_error_codes_map_onto_the_hierarchy(settings: Settings, code: int, error: type) -> None:
    fake = FakeNvml()
    dev = _open(settings, fake).device(1)
    fake.fail("nvmlDeviceGetClockInfo", code, device=1)
    with pytest.raises(error) as info:
        dev.read_state()
    assert info.value.vendor_code == code


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "install the NVIDIA driver"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "versions differ"),
    ],
)
def test_init_failures_say_what_is_missing(settings: Settings, code: int, words: str) -> None:
    fake = FakeNvml()
    fake.init_error = code
    with pytest.raises(BackendUnavailableError, match=words):
        _open(settings, fake)
    assert not NvidiaBackend.probe(settings).is_available


def test_static_facts_and_units(settings: Settings) -> None:
    fake = FakeNvml([A100_SXM4_40GB, H100_SXM5_80GB])
    a100, h100 = _open(settings, fake).devices()
    assert a100.device_id == fake.gpus[0].uuid and a100.info.name == "NVIDIA A100-SXM4-40GB"
    assert a100.info.supported_sm_freqs_mhz[0] == 210.0 and a100.info.max_sm_freq_mhz == 1410.0
    assert len(a100.info.supported_sm_freqs_mhz) == 81
    assert (
        a100.info.power_limit_range_w == (100.0, 400.0) and a100.info.default_power_limit_w == 400.0
    )
    assert h100.info.supported_mem_freqs_mhz == (1593.0, 2619.0)
    fake.advance(2.0)
    st = a100.read_state()
    assert st.power_w == pytest.approx(57.0) and st.energy_j == pytest.approx(114.0)
    assert st.power_limit_w == 400.0 and st.sm_freq_mhz == 210.0 and st.temperature_c is not None
    assert h100.read_state().power_w == pytest.approx(73.0)  # through the instant-power field
    assert h100.details()["power_reading"].startswith("instantaneous")
    assert a100.details()["power_reading"] == "nvmlDeviceGetPowerUsage"
    json.dumps(h100.details())


def test_lock_reset_and_power_limit_reach_nvml(settings: Settings) -> None:
    fake = FakeNvml([H100_SXM5_80GB])
    dev = _open(settings, fake).device(0)
    assert dev.lock_sm_clocks(1201, 1500) == (1200.0, 1500.0)
    assert fake.gpus[0].locked_mhz == (1200, 1500)
    assert "clocks_locked_or_app_clocks" in dev.details()["clock_event_reasons"]
    dev.reset_sm_clocks()
    assert fake.gpus[0].locked_mhz is None and dev.read_state().locked_sm_freqs_mhz is None
    assert dev.lock_memory_clocks(2619) == (2619.0, 2619.0)
    assert fake.gpus[0].mem_locked_mhz == (2619, 2619)
    dev.reset_memory_clocks()
    assert dev.set_power_limit(450.5) == 450.5
    assert fake.gpus[0].power_limit_mw == 450_500  # W -> mW once, at the edge
    dev.reset_power_limit()
    assert fake.gpus[0].power_limit_mw == 700_000


def test_a_power_limit_that_does_not_take_effect_is_an_error(settings: Settings) -> None:
    fake = FakeNvml()
    fake.gpus[0].ignores_power_limit = True
    with pytest.raises(DeviceError, match="did not take effect"):
        _open(settings, fake).device(0).set_power_limit(300)


def test_volta_has_no_memory_lock_and_no_counter_so_energy_is_integrated(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeNvml([V100_SXM2_16GB])
    now = [0.0]
    backend = _open(settings, fake)
    with caplog.at_level(logging.WARNING):
        from powerlib.backends.nvidia import NvidiaDevice

        dev = NvidiaDevice(fake, fake.nvmlDeviceGetHandleByIndex(0), 0, monotonic=lambda: now[0])
    assert "no energy counter" in caplog.text
    caps = dev.info.capabilities
    assert (
        caps.can_lock_sm_clocks and not caps.can_lock_memory_clocks and not caps.has_energy_counter
    )
    with pytest.raises(NotSupportedError):
        dev.lock_memory_clocks(877)
    first = dev.read_state().energy_j
    now[0] = 10.0
    assert dev.read_state().energy_j - first == pytest.approx(400.0)  # 40 W for 10 s
    with caplog.at_level(logging.WARNING):
        dev.lock_sm_clocks(1000)
    assert "persistence mode is off" in caplog.text
    backend.close()


def test_pre_volta_clock_locking_is_not_supported(settings: Settings) -> None:
    from dataclasses import replace

    pascal = replace(V100_SXM2_16GB, name="Tesla P100", architecture=4)
    dev = _open(settings, FakeNvml([pascal])).device(0)
    assert not dev.info.capabilities.can_lock_sm_clocks and dev.info.supported_sm_freqs_mhz == ()
    with pytest.raises(NotSupportedError):
        dev.lock_sm_clocks(1000)


# -- CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER ---------------------------------------------------


def test_visible_devices_by_uuid_prefix_and_ordinal(settings: Settings) -> None:
    fake = FakeNvml([A100_SXM4_40GB] * 4)
    prefix = fake.gpus[2].uuid[:14]  # "GPU-00000002-f"
    b = _open(settings, fake, cuda_visible_devices=f"{prefix},0", cuda_device_order="PCI_BUS_ID")
    assert [d.device_id for d in b.devices()] == [fake.gpus[2].uuid, fake.gpus[0].uuid]
    assert [d.index for d in b.devices()] == [0, 1]
    b = _open(settings, fake, cuda_visible_devices="3, 1")
    assert [d.device_id for d in b.devices()] == [fake.gpus[3].uuid, fake.gpus[1].uuid]
    b = _open(settings, fake, cuda_visible_devices=fake.gpus[1].uuid.removeprefix("GPU-")[:10])
    assert [d.device_id for d in b.devices()] == [fake.gpus[1].uuid]


def test_empty_visibility_means_no_devices(settings: Settings) -> None:
    fake = FakeNvml()
    assert _open(settings, fake, cuda_visible_devices="").devices() == []
    probe = NvidiaBackend.probe(settings.replace(cuda_visible_devices=""))
    assert not probe.is_available  # the real binding is present but finds no driver here


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("MIG-6b3a1f2e-1111-2222-3333-444455556666", "MIG"),
        ("5", "out of range"),
        ("GPU-ffff", "matches no GPU"),
        ("GPU-0000000", "ambiguous"),
        ("0,0", "twice"),
    ],
)
def test_bad_visibility_entries_are_clear_errors(
    settings: Settings, value: str, words: str
) -> None:
    fake = FakeNvml()
    with pytest.raises(ConfigError, match=words):
        _open(settings, fake, cuda_visible_devices=value)
    assert fake.init_count == 0  # NVML shut down again


def test_mixed_models_under_fastest_first_warn(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeNvml([A100_SXM4_40GB, H100_SXM5_80GB])
    with caplog.at_level(logging.WARNING):
        _open(settings, fake)
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _open(settings, fake, cuda_device_order="PCI_BUS_ID")
    assert caplog.text == ""


def test_visibility_comes_from_the_environment(tmp_path: Path) -> None:
    s = Settings.from_env(
        {
            "CUDA_VISIBLE_DEVICES": "1",
            "CUDA_DEVICE_ORDER": "pci_bus_id",
            "POWERLIB_STATE_DIR": str(tmp_path),
        }
    )
    assert (s.cuda_visible_devices, s.cuda_device_order) == ("1", "PCI_BUS_ID")
    assert (
        Settings.from_env(
            {"CUDA_VISIBLE_DEVICES": "", "POWERLIB_STATE_DIR": str(tmp_path)}
        ).cuda_visible_devices
        == ""
    )
    assert Settings.from_env({"POWERLIB_STATE_DIR": str(tmp_path)}).cuda_visible_devices is None


def test_close_shuts_nvml_down_once(settings: Settings) -> None:
    fake = FakeNvml()
    b = _open(settings, fake)
    assert fake.init_count == 1
    b.close()
    b.close()
    assert fake.init_count == 0


# -- the CLI, unchanged, on the NVML backend -------------------------------------------------------


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_cli_without_the_binding_is_one_line_naming_the_package(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    result = runner.invoke(cli, ["devices"], env={"POWERLIB_BACKEND": "nvidia"})
    assert result.exit_code == 3 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert "nvidia-ml-py" in line


def test_cli_with_the_real_binding_and_no_driver_names_the_driver(runner: CliRunner) -> None:
    """The real nvidia-ml-py on this GPU-less machine: nvmlInit fails with LIBRARY_NOT_FOUND."""
    result = runner.invoke(cli, ["devices", "--json"], env={"POWERLIB_BACKEND": "nvidia"})
    assert result.exit_code == 3 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert "NVIDIA driver" in line


def test_cli_commands_work_on_the_nvidia_backend(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeNvml([A100_SXM4_40GB, H100_SXM5_80GB])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    env = {"POWERLIB_BACKEND": "nvidia", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    devices = json.loads(runner.invoke(cli, ["devices", "--json"], env=env).stdout)["devices"]
    assert [d["name"] for d in devices] == ["NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3"]
    assert (
        runner.invoke(
            cli, ["set", "--device", "1", "--freq-mhz", "1410", "--power-limit-w", "500"], env=env
        ).exit_code
        == 0
    )
    assert fake.gpus[1].locked_mhz == (1410, 1410) and fake.gpus[1].power_limit_mw == 500_000
    status = runner.invoke(cli, ["status", "--device", "1"], env=env)
    assert "memory clock lock: yes" in status.stdout and "energy counter: yes" in status.stdout
    watch = runner.invoke(cli, ["watch", "--count", "2", "--interval-s", "0.01", "--json"], env=env)
    assert watch.exit_code == 0 and len(watch.stdout.splitlines()) == 4
    assert runner.invoke(cli, ["reset", "--all"], env=env).exit_code == 0
    assert fake.gpus[1].locked_mhz is None and fake.gpus[1].power_limit_mw == 700_000
    fake.fail("nvmlDeviceSetGpuLockedClocks", pynvml.NVML_ERROR_NO_PERMISSION)
    denied = runner.invoke(cli, ["set", "--device", "0", "--freq-mhz", "1200"], env=env)
    assert (
        denied.exit_code == 4
        and "CAP_SYS_ADMIN" in denied.stderr
        and denied.stderr.count("\n") == 1
    )


def test_the_hardware_check_itself_passes_on_the_fake(
    monkeypatch: pytest.MonkeyPatch, hardware_check
) -> None:
    """Dry run of tests/hardware on the fake, so the script a GPU owner runs is known to work."""
    fake = FakeNvml([H100_SXM5_80GB])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(
        hardware_check, "_ENV", {"POWERLIB_BACKEND": "nvidia", "POWERLIB_STATE_DIR": "/tmp"}
    )
    hardware_check.test_read_lock_limit_restore_on_a_real_gpu()
    gpu = fake.gpus[0]
    assert gpu.locked_mhz is None and gpu.power_limit_mw == 700_000
    assert (
        "nvmlDeviceSetGpuLockedClocks" in fake.calls
        and "nvmlDeviceSetPowerManagementLimit" in fake.calls
    )
