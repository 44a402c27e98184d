"""The amdsmi backend on powerlib's fake amdsmi, plus API parity with the real 7.0.2 wrapper.

The real ``amdsmi`` cannot be imported without ``libamd_smi.so``, so parity is checked against
``amdsmi_api_snapshot.json``, recorded from the wrapper's source by ``record_amdsmi_snapshot.py``.
"""

from __future__ import annotations

import ast
import inspect
import json
import logging
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

import powerlib.device
from powerlib import (
    BackendUnavailableError,
    ConfigError,
    DeviceBusyError,
    DeviceError,
    DeviceLostError,
    DeviceNotFoundError,
    InvalidArgumentError,
    NotSupportedError,
    PermissionDeniedError,
    PowerlibError,
    Settings,
    open_backend,
)
from powerlib.backends import _amd_api as amd_api
from powerlib.backends._amd_api import import_amdsmi
from powerlib.backends.amd import AmdBackend
from powerlib.cli import cli
from powerlib.device import ClockLockState
from powerlib.errors import TransientDeviceError
from powerlib.testing.fake_amdsmi import FakeAmdsmi, FakeGpu, make_fake_amdsmi

HERE = Path(__file__).resolve().parent
BACKEND_SOURCES = [
    HERE.parents[1] / "backends" / name for name in ("amd.py", "_amd_api.py", "_amd_enumeration.py")
]
SNAPSHOT = json.loads((HERE / "amdsmi_api_snapshot.json").read_text())


def _open(fake: FakeAmdsmi, settings: Settings, **changes: object) -> AmdBackend:
    return AmdBackend(settings.replace(backend="amd", **changes), smi=fake)


def _bdf(i: int) -> str:
    return f"0000:{0x05 + 0x20 * i:02x}:00.0"


def _gpus(n: int, **overrides: object) -> list[FakeGpu]:
    """``n`` GPUs in BDF order with distinct, readable ids; ``overrides`` maps field -> list."""
    gpus = []
    for i in range(n):
        fields: dict[str, object] = {
            "bdf": _bdf(i),
            "uuid": f"{i}{i}ff74a1-0000-1000-8000-00000000000{i}",
            "hip_uuid": f"GPU-{i}{i}a0c8bd5b3ab8a{i}",
            "hip_id": i,
            "kfd_node_id": 2 + i,
        }
        fields.update({key: values[i] for key, values in overrides.items()})  # type: ignore[index]
        gpus.append(FakeGpu(**fields))  # type: ignore[arg-type]
    return gpus


@pytest.fixture(autouse=True)
def _no_retry_delays(monkeypatch: pytest.MonkeyPatch) -> None:
    """Transient errors are retried by the device layer; no test needs the real back-off."""
    monkeypatch.setattr(powerlib.device, "TRANSIENT_RETRY_DELAYS_S", (0.0, 0.0, 0.0))


@pytest.fixture
def fake() -> FakeAmdsmi:
    return make_fake_amdsmi()


@pytest.fixture
def backend(fake: FakeAmdsmi, settings: Settings):
    with _open(fake, settings) as b:
        yield b


# -- parity with the real wrapper ----------------------------------------------------------------


def _names_used_by_backend() -> set[str]:
    """Function names passed to the backend's call helpers, plus any ``x.amdsmi_*`` attribute."""
    helpers = {"call", "soft", "_call", "_optional"}
    names = set()
    trees = [ast.parse(path.read_text()) for path in BACKEND_SOURCES]
    for node in (node for tree in trees for node in ast.walk(tree)):
        if isinstance(node, ast.Call):
            func = node.func
            helper = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if helper in helpers:
                name = next(
                    (
                        a.value
                        for a in node.args
                        if isinstance(a, ast.Constant) and isinstance(a.value, str)
                    ),
                    None,
                )
                if name is not None:  # None: a helper forwarding its own ``name`` argument
                    assert name.startswith("amdsmi_"), name
                    names.add(name)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("amdsmi_"):
            names.add(node.attr)
    return names


def test_every_amdsmi_function_the_backend_calls_exists_in_the_real_wrapper() -> None:
    used = _names_used_by_backend()
    assert {"amdsmi_init", "amdsmi_set_gpu_clk_range", "amdsmi_set_power_cap"} <= used
    missing = sorted(used - set(SNAPSHOT["functions"]))
    assert not missing, f"not in amdsmi {SNAPSHOT['wrapper_version']}: {missing}"


def test_fake_functions_have_the_real_parameter_names(fake: FakeAmdsmi) -> None:
    for name in sorted(_names_used_by_backend()):
        params = list(inspect.signature(getattr(fake, name)).parameters)
        assert params == SNAPSHOT["functions"][name], name


def test_fake_exceptions_mirror_the_real_classes(fake: FakeAmdsmi) -> None:
    for name in (
        "AmdSmiException",
        "AmdSmiLibraryException",
        "AmdSmiRetryException",
        "AmdSmiTimeoutException",
        "AmdSmiParameterException",
    ):
        cls = getattr(fake, name)
        assert name in SNAPSHOT["exceptions"]
        if SNAPSHOT["exceptions"][name] is not None:
            params = list(inspect.signature(cls.__init__).parameters)[1:]
            assert params == SNAPSHOT["exceptions"][name], name
    err = fake.AmdSmiLibraryException(-10)
    assert err.get_error_code() == err.err_code == 10
    assert issubclass(fake.AmdSmiRetryException, fake.AmdSmiLibraryException)
    assert fake.AmdSmiRetryException().get_error_code() == SNAPSHOT["status_codes"]["RETRY"]
    assert fake.AmdSmiTimeoutException().get_error_code() == SNAPSHOT["status_codes"]["TIMEOUT"]


def test_fake_enums_have_the_real_values(fake: FakeAmdsmi) -> None:
    for enum_name, members in SNAPSHOT["enums"].items():
        for alias, value in getattr(fake, enum_name).__members__.items():  # aliases included
            assert members[alias] == value, f"{enum_name}.{alias}"
    source = "".join(path.read_text() for path in BACKEND_SOURCES)
    for enum_name, member in (
        ("AmdSmiInitFlags", "INIT_AMD_GPUS"),
        ("AmdSmiClkType", "GFX"),
        ("AmdSmiDevPerfLevel", "AUTO"),
        ("AmdSmiTemperatureMetric", "CURRENT"),
        ("AmdSmiTemperatureType", "HOTSPOT"),
        ("AmdSmiTemperatureType", "EDGE"),
    ):
        assert f'"{member}"' in source
        assert member in SNAPSHOT["enums"][enum_name]


def test_error_mapping_uses_the_real_status_codes() -> None:
    codes = SNAPSHOT["status_codes"]
    expected = {
        "INVAL": InvalidArgumentError,
        "NOT_SUPPORTED": NotSupportedError,
        "NOT_YET_IMPLEMENTED": NotSupportedError,
        "FAIL_LOAD_MODULE": BackendUnavailableError,
        "FAIL_LOAD_SYMBOL": BackendUnavailableError,
        "TIMEOUT": TransientDeviceError,
        "RETRY": TransientDeviceError,
        "NO_PERM": PermissionDeniedError,
        "INPUT_OUT_OF_BOUNDS": InvalidArgumentError,
        "INIT_ERROR": BackendUnavailableError,
        "BUSY": TransientDeviceError,
        "NOT_FOUND": DeviceNotFoundError,
        "NOT_INIT": BackendUnavailableError,
        "DRIVER_NOT_LOADED": BackendUnavailableError,
        "NO_ENERGY_DRV": BackendUnavailableError,
        "NO_DRV": BackendUnavailableError,
        "ARG_PTR_NULL": InvalidArgumentError,
        "SETTING_UNAVAILABLE": NotSupportedError,
    }
    for name, cls in expected.items():
        assert amd_api.STATUS[codes[name]][0] is cls, name
    assert amd_api.RETRY == codes["RETRY"] and amd_api.NOT_FOUND == codes["NOT_FOUND"]
    assert SNAPSHOT["wrapper_version"] == "7.0.2"


# -- import failures and the CLI --------------------------------------------------------------


_NOISE = (
    'print("/opt/rocm/lib/libamd_smi.so: cannot open shared object file: No such file or directory")\n'
    'print("Unable to find libamd_smi.so library try installing amd-smi-lib from your package manager")\n'
)


def _fake_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, name: str = "pkg"
) -> None:
    root = tmp_path / name
    (root / "amdsmi").mkdir(parents=True)
    (root / "amdsmi" / "__init__.py").write_text(body)
    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
    monkeypatch.syspath_prepend(str(root))


def test_import_without_the_library_is_clean_and_quiet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """amdsmi 7.0.2 without ROCm prints two lines to stdout, then raises KeyError('libamd_smi.so')."""
    _fake_package(tmp_path, monkeypatch, _NOISE + 'raise KeyError("libamd_smi.so")\n')
    with pytest.raises(BackendUnavailableError) as info:
        import_amdsmi()
    assert (
        "libamd_smi.so" in info.value.message and "cannot open shared object" in info.value.message
    )
    assert "powerlib[amd]" in info.value.message and "ROCM_PATH" in info.value.message
    assert isinstance(info.value.__cause__, KeyError)
    assert capsys.readouterr().out == ""


def test_import_with_a_missing_symbol_is_clean_and_quiet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wrapper newer than libamd_smi.so raises AttributeError (undefined symbol) at import."""
    body = 'raise AttributeError("libamd_smi.so: undefined symbol: amdsmi_free_name_value_pairs")\n'
    _fake_package(tmp_path, monkeypatch, 'print("noise")\n' + body)
    with pytest.raises(BackendUnavailableError, match="does not match") as info:
        import_amdsmi()
    assert "amdsmi_free_name_value_pairs" in info.value.message
    assert capsys.readouterr().out == ""
    result = AmdBackend.probe(Settings())
    assert not result.is_available and "does not match" in result.reason
    assert capsys.readouterr().out == ""


def test_not_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    with pytest.raises(BackendUnavailableError, match=r"not installed.*powerlib\[amd\]"):
        AmdBackend(settings)
    result = AmdBackend.probe(settings)
    assert not result.is_available and "not installed" in result.reason


def test_cli_devices_without_amdsmi_prints_one_line_to_stderr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    result = CliRunner().invoke(cli, ["devices"], env={"POWERLIB_BACKEND": "amd"})
    assert result.exit_code == 3
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "amdsmi" in lines[0] and "ROCm" in lines[0]


def test_registry_and_probe_use_amdsmi_from_sys_modules(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    fake = make_fake_amdsmi(devices=2)
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    result = AmdBackend.probe(settings)
    assert result.is_available and result.num_devices == 2 and "hip_id" in result.reason
    assert fake.init_count == 0
    with open_backend(settings=settings.replace(backend="amd")) as b:
        assert [d.info.vendor for d in b.devices()] == ["amd", "amd"]


# -- lifecycle --------------------------------------------------------------------------------------


def test_close_shuts_amdsmi_down_once(fake: FakeAmdsmi, settings: Settings) -> None:
    b = _open(fake, settings)
    assert fake.init_count == 1
    b.close()
    b.close()
    assert fake.count("amdsmi_shut_down") == 1 and fake.init_count == 0


def test_a_probe_or_second_backend_does_not_shut_down_an_open_one(
    fake: FakeAmdsmi, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    with _open(fake, settings) as first:
        assert AmdBackend.probe(settings).is_available
        with _open(fake, settings) as second:
            second.devices()[0].read_state()
        first.devices()[0].read_state()  # amdsmi still initialised
        assert fake.count("amdsmi_init") == 1 and fake.count("amdsmi_shut_down") == 0
    assert fake.count("amdsmi_shut_down") == 1


@pytest.mark.parametrize("code", [18, 34, 10, 4])
def test_init_failure_is_backend_unavailable(
    fake: FakeAmdsmi, settings: Settings, code: int
) -> None:
    fake.fail("amdsmi_init", code)
    with pytest.raises(BackendUnavailableError, match="amdsmi could not start") as info:
        _open(fake, settings)
    assert info.value.vendor_code == code
    if code == 10:
        assert "/dev/kfd" in info.value.message
    assert fake.init_count == 0


def test_failure_while_opening_releases_amdsmi(fake: FakeAmdsmi, settings: Settings) -> None:
    fake.fail("amdsmi_get_gpu_device_bdf", 12)
    with pytest.raises(DeviceError):
        _open(fake, settings)
    assert fake.init_count == 0 and fake.count("amdsmi_shut_down") == 1


def test_no_gpu_is_backend_unavailable(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = make_fake_amdsmi(devices=0)
    with pytest.raises(BackendUnavailableError, match="no AMD GPU"):
        _open(fake, settings)
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    result = AmdBackend.probe(settings)
    assert not result.is_available and "no AMD GPU" in result.reason


# -- order and visibility ---------------------------------------------------------------------------


def _ids(b: AmdBackend) -> list[str]:
    assert [d.index for d in b.devices()] == list(range(len(b.devices())))
    return [d.device_id for d in b.devices()]


def test_hip_visible_devices_ordinals(settings: Settings) -> None:
    gpus = _gpus(4)
    with _open(make_fake_amdsmi(gpus), settings, hip_visible_devices="2,0") as b:
        assert _ids(b) == [gpus[2].uuid, gpus[0].uuid]


def test_hip_visible_devices_uuid_prefixes_match_hips_uuid(settings: Settings) -> None:
    gpus = _gpus(4)
    with _open(make_fake_amdsmi(gpus), settings, hip_visible_devices="GPU-33a0,gpu-11") as b:
        assert _ids(b) == [gpus[3].uuid, gpus[1].uuid]
    with pytest.raises(ConfigError, match="matches no GPU"):
        _open(make_fake_amdsmi(gpus), settings, hip_visible_devices="GPU-99")


def test_amd_smi_uuid_is_matched_when_hip_uuid_is_unknown(settings: Settings) -> None:
    gpus = _gpus(3, hip_uuid=["", "", ""])
    with _open(make_fake_amdsmi(gpus), settings, hip_visible_devices="22ff") as b:
        assert _ids(b) == [gpus[2].uuid]


def test_rocr_applies_first_then_hip_relative_to_it(settings: Settings) -> None:
    gpus = _gpus(4)
    fake = make_fake_amdsmi(gpus)
    with _open(fake, settings, rocr_visible_devices="1,2,3", hip_visible_devices="2,0") as b:
        assert _ids(b) == [gpus[3].uuid, gpus[1].uuid]
    with _open(fake, settings, rocr_visible_devices="GPU-22,GPU-00") as b:
        assert _ids(b) == [gpus[2].uuid, gpus[0].uuid]
    with pytest.raises(ConfigError, match="HIP_VISIBLE_DEVICES entry 2 is out of range"):
        _open(fake, settings, rocr_visible_devices="0,1", hip_visible_devices="2")


@pytest.mark.parametrize("variable", ["hip_visible_devices", "rocr_visible_devices"])
def test_empty_visibility_means_no_devices(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    fake = make_fake_amdsmi(devices=2)
    with _open(fake, settings, **{variable: ""}) as b:
        assert b.devices() == ()
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    result = AmdBackend.probe(settings.replace(**{variable: ""}))
    assert not result.is_available and "hide all" in result.reason


def test_mig_style_and_bad_tokens_are_config_errors(settings: Settings) -> None:
    fake = make_fake_amdsmi(devices=2)
    for value in ("MIG-1", "5", "0,0"):
        with pytest.raises(ConfigError):
            _open(fake, settings, hip_visible_devices=value)
    assert fake.init_count == 0


def test_hip_order_differs_from_bdf_order(settings: Settings) -> None:
    """MI350X nodes: HIP device 0 is amd-smi GPU 3 (Zeus documents this), so order by hip_id."""
    gpus = _gpus(4, hip_id=[1, 2, 3, 0])
    with _open(make_fake_amdsmi(list(reversed(gpus))), settings) as b:
        assert _ids(b) == [gpus[3].uuid, gpus[0].uuid, gpus[1].uuid, gpus[2].uuid]
        first = b.devices()[0].details()
        assert first["amdsmi_index"] == 3 and first["hip_index"] == 0 and first["bdf"] == _bdf(3)
        assert "hip_id" in str(first["device_order"])
    with _open(make_fake_amdsmi(gpus), settings, hip_visible_devices="0") as b:
        assert _ids(b) == [gpus[3].uuid]


def test_kfd_node_order_when_hip_ids_are_unknown(settings: Settings) -> None:
    """ROCm before 6.4 has no enumeration info: KFD node ids give the ROCr order."""
    gpus = _gpus(3, hip_id=[None, None, None], kfd_node_id=[9, 5, 7])
    with _open(make_fake_amdsmi(gpus), settings) as b:
        assert _ids(b) == [gpus[1].uuid, gpus[2].uuid, gpus[0].uuid]
        assert "KFD" in str(b.devices()[0].details()["device_order"])


def test_a_wrapper_without_enumeration_info_falls_back_to_kfd(settings: Settings) -> None:
    gpus = _gpus(2, kfd_node_id=[4, 3])
    fake = make_fake_amdsmi(gpus)
    fake.missing.add("amdsmi_get_gpu_enumeration_info")
    with _open(fake, settings) as b:
        assert _ids(b) == [gpus[1].uuid, gpus[0].uuid]


def test_bdf_order_is_the_last_resort_and_warns(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    gpus = _gpus(2, hip_id=[None, None], kfd_node_id=[None, None])
    with caplog.at_level(logging.WARNING, logger="powerlib.backends.amd"):
        with _open(make_fake_amdsmi(gpus), settings) as b:
            assert _ids(b) == [gpus[0].uuid, gpus[1].uuid]
            assert "BDF" in str(b.devices()[0].details()["device_order"])
    assert "HIP may not follow" in caplog.text


def test_device_id_falls_back_to_bdf(settings: Settings) -> None:
    gpus = _gpus(3, uuid=["same", "same", "unique-uuid"])
    fake = make_fake_amdsmi(gpus)
    fake.fail("amdsmi_get_gpu_device_uuid", 2, device=2)
    with _open(fake, settings) as b:
        assert _ids(b) == [_bdf(0), _bdf(1), _bdf(2)]
        assert b.device(_bdf(1)).index == 1


# -- error translation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (10, PermissionDeniedError),
        (2, NotSupportedError),
        (3, NotSupportedError),
        (55, NotSupportedError),
        (1, InvalidArgumentError),
        (17, InvalidArgumentError),
        (53, InvalidArgumentError),
        (8, TransientDeviceError),
        (30, TransientDeviceError),
        (4, BackendUnavailableError),
        (5, BackendUnavailableError),
        (18, BackendUnavailableError),
        (32, BackendUnavailableError),
        (34, BackendUnavailableError),
        (45, BackendUnavailableError),
        (51, BackendUnavailableError),
        (31, DeviceLostError),
        (12, DeviceError),
        (0xFFFFFFFF, DeviceError),
    ],
)
def test_status_codes_map_onto_the_hierarchy(
    fake: FakeAmdsmi, backend: AmdBackend, code: int, error: type[PowerlibError]
) -> None:
    dev = backend.devices()[0]
    fake.fail("amdsmi_set_power_cap", code)
    with pytest.raises(error) as info:
        dev.set_power_limit(300.0)
    err = info.value
    assert type(err) is error
    assert err.vendor_code == code and err.device == dev.device_id
    assert err.operation == "set_power_limit"
    assert isinstance(err.__cause__, fake.AmdSmiLibraryException)
    assert "\n" not in str(err) and "amdsmi_set_power_cap" in str(err)
    assert fake.gpus[0].power_cap_uw == 750_000_000


def test_no_permission_says_what_is_needed(fake: FakeAmdsmi, backend: AmdBackend) -> None:
    fake.is_root = False
    dev = backend.devices()[0]
    for call in (
        lambda: dev.lock_sm_clocks(1000.0),
        dev.reset_sm_clocks,
        lambda: dev.set_power_limit(300.0),
    ):
        with pytest.raises(PermissionDeniedError) as info:
            call()
        message = info.value.message
        assert "root" in message and "/dev/kfd" in message and "/dev/dri" in message
        assert "/sys" in message
    assert dev.read_state().locked_sm_freqs_mhz is None  # reads need no privilege


def test_not_found_is_device_not_found_while_enumerating(
    fake: FakeAmdsmi, settings: Settings
) -> None:
    fake.fail("amdsmi_get_gpu_device_bdf", 31)
    with pytest.raises(DeviceNotFoundError):
        _open(fake, settings)


def test_a_gpu_that_disappears_is_device_lost(fake: FakeAmdsmi, backend: AmdBackend) -> None:
    fake.fail("amdsmi_*", 31)
    with pytest.raises(DeviceLostError) as info:
        backend.devices()[0].read_state()
    assert info.value.vendor_code == 31 and info.value.operation == "read_state"


def test_retry_is_retried_once(fake: FakeAmdsmi, backend: AmdBackend) -> None:
    dev = backend.devices()[0]
    fake.fail("amdsmi_get_power_info", 9, times=1)
    before = fake.count("amdsmi_get_power_info")
    assert dev.read_state().power_w == 150.0
    assert fake.count("amdsmi_get_power_info") - before == 2
    fake.fail("amdsmi_get_power_info", 9, times=2)
    with pytest.raises(TransientDeviceError) as info:
        dev.read_state()
    assert info.value.vendor_code == 9
    assert isinstance(info.value.__cause__, fake.AmdSmiRetryException)


def test_timeout_and_busy_are_not_retried(fake: FakeAmdsmi, backend: AmdBackend) -> None:
    dev = backend.devices()[0]
    for code in (8, 30):
        fake.fail("amdsmi_get_power_info", code, times=1)
        before = fake.count("amdsmi_get_power_info")
        with pytest.raises(TransientDeviceError):
            dev.read_state()
        assert fake.count("amdsmi_get_power_info") - before == 1


def test_parameter_exceptions_are_invalid_arguments(fake: FakeAmdsmi, backend: AmdBackend) -> None:
    handle = fake.amdsmi_get_processor_handles()[0]
    with pytest.raises(InvalidArgumentError) as info:
        amd_api.call(fake, "amdsmi_set_power_cap", handle, 0, 1.5, device="x", operation="op")
    assert isinstance(info.value.__cause__, fake.AmdSmiParameterException)


def test_a_missing_function_is_not_supported(fake: FakeAmdsmi, backend: AmdBackend) -> None:
    fake.missing.add("amdsmi_get_clk_freq")
    with pytest.raises(NotSupportedError, match="has no amdsmi_get_clk_freq"):
        amd_api.call(fake, "amdsmi_get_clk_freq", None)
    assert backend.devices()[0].details()["gfx_dpm_levels_mhz"] is None


def test_unexpected_wrapper_exceptions_become_device_errors(
    fake: FakeAmdsmi, backend: AmdBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 7.0.2 wrapper can raise KeyError or UnboundLocalError from its own bugs."""

    def broken(processor_handle: object) -> dict[str, object]:
        raise KeyError("AMDSMI_DEV_PERF_LEVEL_42")

    monkeypatch.setattr(fake, "amdsmi_get_power_info", broken)
    with pytest.raises(DeviceError, match="KeyError") as info:
        backend.devices()[0].read_state()
    assert isinstance(info.value.__cause__, KeyError)


# -- clocks -----------------------------------------------------------------------------------------


def test_supported_clocks_are_a_50_mhz_grid_over_the_gfx_range(backend: AmdBackend) -> None:
    freqs = backend.devices()[0].info.supported_sm_freqs_mhz
    assert freqs[0] == 500.0 and freqs[-1] == 2100.0 and len(freqs) == 33
    assert all(isinstance(f, float) and f % 50 == 0 for f in freqs)


def test_grid_keeps_ends_that_are_off_the_grid() -> None:
    assert amd_api.gfx_grid_mhz(505.0, 660.0) == (505.0, 550.0, 600.0, 650.0, 660.0)
    assert amd_api.gfx_grid_mhz(800.0, 800.0) == (800.0,)


def test_lock_sets_the_gfx_range_and_auto_resets_it(fake: FakeAmdsmi, backend: AmdBackend) -> None:
    dev = backend.devices()[0]
    gpu = fake.gpus[0]
    assert dev.lock_sm_clocks(1000.3, 1499.0) == (1000.0, 1500.0)
    assert (gpu.soft_min_mhz, gpu.soft_max_mhz) == (1000, 1500)
    assert gpu.perf_level == fake.AmdSmiDevPerfLevel.MANUAL
    state = dev.read_state()
    assert state.locked_sm_freqs_mhz == (1000.0, 1500.0)
    assert 1000.0 <= state.sm_freq_mhz <= 1500.0  # type: ignore[operator]
    details = dev.details()
    assert details["perf_level"] == "manual" and "note" not in details
    assert details["clock_lock"] == {"mode": "clk_range", "min_mhz": 1000.0, "max_mhz": 1500.0}
    dev.reset_sm_clocks()
    assert gpu.perf_level == fake.AmdSmiDevPerfLevel.AUTO and gpu.soft_max_mhz is None
    assert dev.read_state().locked_sm_freqs_mhz is None and dev.details()["clock_lock"] is None
    assert fake.calls[-1][0] != "amdsmi_set_gpu_clk_range"


def test_single_clock_falls_back_to_performance_determinism(settings: Settings) -> None:
    fake = make_fake_amdsmi([FakeGpu(supports_clk_range=False)])
    with _open(fake, settings) as b:
        dev = b.devices()[0]
        assert dev.lock_sm_clocks(1200.0) == (1200.0, 1200.0)
        gpu = fake.gpus[0]
        assert gpu.perf_level == fake.AmdSmiDevPerfLevel.DETERMINISM and gpu.soft_max_mhz == 1200
        assert dev.read_state().locked_sm_freqs_mhz == (1200.0, 1200.0)
        assert dev.details()["clock_lock"]["mode"] == "determinism"  # type: ignore[index]
        with pytest.raises(NotSupportedError, match="only a single clock"):
            dev.lock_sm_clocks(1000.0, 1500.0)
        assert dev.read_state().locked_sm_freqs_mhz == (1200.0, 1200.0)
        dev.reset_sm_clocks()
        assert gpu.perf_level == fake.AmdSmiDevPerfLevel.AUTO


def test_the_lock_is_read_back_from_the_driver(fake: FakeAmdsmi, backend: AmdBackend) -> None:
    dev = backend.devices()[0]
    gpu = fake.gpus[0]
    assert dev.read_sm_lock() == ClockLockState(locked=False, running_mhz=2100.0)
    dev.lock_sm_clocks(1000.0, 1500.0)
    assert dev.last_sm_readback == ClockLockState(locked=True, running_mhz=1500.0)
    dev.reset_sm_clocks()
    assert dev.last_sm_readback == ClockLockState(locked=False, running_mhz=2100.0)
    gpu.perf_level, gpu.soft_max_mhz = fake.AmdSmiDevPerfLevel.DETERMINISM, 1300  # someone else
    assert dev.read_sm_lock().locked is True and dev.read_state().locked_sm_freqs_mhz is None
    gpu.perf_level = fake.AmdSmiDevPerfLevel.UNKNOWN  # then clk_locked decides
    assert dev.read_sm_lock() == ClockLockState(locked=True, running_mhz=1300.0)
    gpu.soft_max_mhz = None
    assert dev.read_sm_lock().locked is None


def test_a_clock_write_the_driver_drops_is_an_error(settings: Settings) -> None:
    fake = make_fake_amdsmi([FakeGpu(ignores_clock_writes=True)])
    with _open(fake, settings) as b:
        dev = b.devices()[0]
        with pytest.raises(DeviceError, match="did not take effect") as info:
            dev.lock_sm_clocks(1000.0, 1500.0)
        assert info.value.operation == "lock_sm_clocks"
        fake.gpus[0].perf_level = fake.AmdSmiDevPerfLevel.MANUAL  # a lock the reset cannot lift
        with pytest.raises(DeviceError, match="still in force after a reset"):
            dev.reset_sm_clocks()


@pytest.mark.parametrize("code", [8, 9, 30])
def test_a_transient_status_on_a_write_is_retried_by_the_device(
    fake: FakeAmdsmi, backend: AmdBackend, code: int
) -> None:
    dev = backend.devices()[0]
    per_try = 2 if code == 9 else 1  # amdsmi's own RETRY is retried once at the call point
    fake.fail("amdsmi_set_gpu_clk_range", code, times=2 * per_try)
    assert dev.lock_sm_clocks(1000.0, 1500.0) == (1000.0, 1500.0)
    assert fake.count("amdsmi_set_gpu_clk_range") == 2 * per_try + 1  # two failed tries, one good
    fake.fail("amdsmi_set_gpu_clk_range", code)
    before = fake.count("amdsmi_set_gpu_clk_range")
    with pytest.raises(TransientDeviceError) as info:
        dev.lock_sm_clocks(1200.0)
    assert not isinstance(info.value, DeviceBusyError) and info.value.vendor_code == code
    tries = 1 + len(powerlib.device.TRANSIENT_RETRY_DELAYS_S)
    assert fake.count("amdsmi_set_gpu_clk_range") - before == tries * per_try
    assert fake.gpus[0].soft_max_mhz == 1500


def test_no_clock_range_means_no_clock_locking(settings: Settings) -> None:
    fake = make_fake_amdsmi()
    fake.fail("amdsmi_get_clock_info", 2)
    with _open(fake, settings) as b:
        dev = b.devices()[0]
        assert (
            dev.info.supported_sm_freqs_mhz == () and not dev.info.capabilities.can_lock_sm_clocks
        )
        assert dev.read_state().sm_freq_mhz is None
        with pytest.raises(NotSupportedError):
            dev.lock_sm_clocks(1000.0)


def test_memory_clocks_are_not_offered(backend: AmdBackend) -> None:
    dev = backend.devices()[0]
    assert not dev.info.capabilities.can_lock_memory_clocks
    with pytest.raises(NotSupportedError):
        dev.lock_memory_clocks(1300.0)


def test_a_perf_level_set_elsewhere_shows_in_details(settings: Settings) -> None:
    fake = make_fake_amdsmi()
    fake.gpus[0].perf_level = fake.AmdSmiDevPerfLevel.STABLE_PEAK
    with _open(fake, settings) as b:
        dev = b.devices()[0]
        assert dev.read_state().locked_sm_freqs_mhz is None
        details = dev.details()
        assert details["perf_level"] == "stable_peak" and "stable_peak" in str(details["note"])
        json.dumps(details)


def test_details_show_index_spaces_and_dpm_levels(backend: AmdBackend) -> None:
    details = backend.devices()[0].details()
    json.dumps(details)
    assert details["amdsmi_index"] == 0 and details["hip_index"] == 0
    assert details["gfx_dpm_levels_mhz"] == [500.0, 1300.0, 2100.0]  # the fake reports Hz
    assert details["num_compute_units"] == 304 and details["target_graphics_version"] == "gfx942"
    assert details["power_cap_w"] == {"current": 750.0, "default": 750.0, "min": 0.0, "max": 750.0}
    assert details["amdsmi_wrapper_version"] == "7.0.2"
    assert details["temperature_sensor"] == "hotspot"


# -- power cap --------------------------------------------------------------------------------------


def test_power_cap_is_converted_to_and_from_microwatts(
    fake: FakeAmdsmi, backend: AmdBackend
) -> None:
    dev = backend.devices()[0]
    assert dev.info.power_limit_range_w == (0.0, 750.0)
    assert dev.info.default_power_limit_w == 750.0
    assert dev.set_power_limit(300.0) == 300.0
    assert fake.gpus[0].power_cap_uw == 300_000_000
    assert dev.read_state().power_limit_w == 300.0
    dev.reset_power_limit()
    assert fake.gpus[0].power_cap_uw == 750_000_000


def test_power_cap_is_read_back_and_rounded_by_the_driver(
    fake: FakeAmdsmi, backend: AmdBackend
) -> None:
    assert backend.devices()[0].set_power_limit(300.6) == 300.0  # amdgpu keeps whole watts


def test_a_power_cap_that_does_not_take_effect_is_an_error(
    fake: FakeAmdsmi, backend: AmdBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    def ignored(processor_handle: object, sensor_ind: int, cap: int) -> None:
        return None

    monkeypatch.setattr(fake, "amdsmi_set_power_cap", ignored)
    with pytest.raises(DeviceError, match="did not take effect") as info:
        backend.devices()[0].set_power_limit(300.0)
    assert type(info.value) is DeviceError and info.value.operation == "set_power_limit"


def test_caps_in_an_implausible_unit_disable_capping(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Host builds document the caps in W; a 750 'µW' maximum must not become a 0.00075 W range."""
    fake = make_fake_amdsmi(
        [FakeGpu(power_cap_uw=750, default_power_cap_uw=750, max_power_cap_uw=750)]
    )
    with caplog.at_level(logging.WARNING, logger="powerlib.backends.amd"):
        with _open(fake, settings) as b:
            info = b.devices()[0].info
            assert info.power_limit_range_w is None and not info.capabilities.can_set_power_limit
            assert b.devices()[0].read_state().power_limit_w is None
    assert "plausible" in caplog.text


def test_no_power_cap_info_means_no_capping(settings: Settings) -> None:
    fake = make_fake_amdsmi()
    fake.fail("amdsmi_get_power_cap_info", 2)
    with _open(fake, settings) as b:
        dev = b.devices()[0]
        assert not dev.info.capabilities.can_set_power_limit
        assert not dev.info.capabilities.can_reset_power_limit
        with pytest.raises(NotSupportedError):
            dev.set_power_limit(300.0)


# -- power, energy, temperature ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("current", "average", "expected_w"),
    [
        (None, 0xFFFF, 150.0),  # MI300: current only ("N/A" average)
        (0xFFFF, 210, 210.0),  # "N/A" current: the average
        (0xFFFFFFFF, 220, 220.0),  # the 7.2 header's sentinel, passed through by 7.0.2
        (0, 230, 230.0),  # 0 current with a valid average
        (180, 230, 180.0),
    ],
)
def test_power_prefers_a_valid_current_reading(
    settings: Settings, current: int | None, average: int, expected_w: float
) -> None:
    fake = make_fake_amdsmi(
        [FakeGpu(current_socket_power_raw=current, average_socket_power_raw=average)]
    )
    with _open(fake, settings) as b:
        dev = b.devices()[0]
        assert dev.info.capabilities.has_power_reading
        assert dev.read_state().power_w == expected_w


@pytest.mark.parametrize("sentinel", [0xFFFF, 0xFFFFFFFF])
def test_no_valid_power_field_means_no_power_reading(settings: Settings, sentinel: int) -> None:
    fake = make_fake_amdsmi(
        [FakeGpu(current_socket_power_raw=sentinel, average_socket_power_raw=sentinel)]
    )
    with _open(fake, settings) as b:
        dev = b.devices()[0]
        assert not dev.info.capabilities.has_power_reading
        assert dev.read_state().power_w is None


def test_energy_is_accumulator_times_resolution(settings: Settings) -> None:
    fake = make_fake_amdsmi([FakeGpu(energy_accumulator=2_000_000, counter_resolution_uj=15.0)])
    with _open(fake, settings) as b:
        dev = b.devices()[0]
        assert dev.read_state().energy_j == pytest.approx(30.0)
        fake.advance(2.0)  # 150 W
        assert dev.read_state().energy_j == pytest.approx(330.0, abs=15e-6)


def test_energy_under_the_pre_6_2_key(settings: Settings) -> None:
    fake = make_fake_amdsmi([FakeGpu(energy_key="power", energy_accumulator=1000)])
    with _open(fake, settings) as b:
        assert b.devices()[0].read_state().energy_j == pytest.approx(1000 * 15.259e-6)


def test_no_energy_counter(settings: Settings) -> None:
    fake = make_fake_amdsmi([FakeGpu(has_energy_counter=False)])
    with _open(fake, settings) as b:
        dev = b.devices()[0]
        assert not dev.info.capabilities.has_energy_counter
        assert dev.read_state().energy_j is None


def test_a_counter_that_goes_backwards_never_decreases_energy(
    fake: FakeAmdsmi, backend: AmdBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """ROCm/amdsmi#115: the energy counter can go backwards."""
    dev = backend.devices()[0]
    first = dev.read_state().energy_j
    fake.gpus[0].energy_accumulator -= 500
    with caplog.at_level(logging.WARNING, logger="powerlib.backends.amd"):
        assert dev.read_state().energy_j == first
    assert "went backwards" in caplog.text
    fake.advance(1.0)
    assert dev.read_state().energy_j == pytest.approx(first + 150.0, abs=1e-4)  # type: ignore[operator]


def test_temperature_hotspot_then_edge_then_none(settings: Settings) -> None:
    cases = [({"HOTSPOT": 61, "EDGE": 40}, 61.0, "hotspot"), ({"EDGE": 40}, 40.0, "edge")]
    for temps, expected_c, sensor in cases:
        with _open(make_fake_amdsmi([FakeGpu(temperatures_c=temps)]), settings) as b:
            dev = b.devices()[0]
            assert dev.read_state().temperature_c == expected_c
            assert dev.details()["temperature_sensor"] == sensor
    with _open(make_fake_amdsmi([FakeGpu(temperatures_c={})]), settings) as b:
        dev = b.devices()[0]
        assert not dev.info.capabilities.has_temperature
        assert dev.read_state().temperature_c is None


def test_millidegree_temperatures_are_converted(settings: Settings) -> None:
    with _open(make_fake_amdsmi([FakeGpu(temperatures_c={"HOTSPOT": 45_000})]), settings) as b:
        assert b.devices()[0].read_state().temperature_c == 45.0


# -- the amdsmi lock --------------------------------------------------------------------------------


def _hammer(workers: int, work: object) -> None:
    barrier = threading.Barrier(workers)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            barrier.wait()
            work()  # type: ignore[operator]
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_every_amdsmi_call_is_serialised(settings: Settings) -> None:
    """libamd_smi before ROCm 7.2 is not thread-safe: no two calls may overlap."""
    fake = make_fake_amdsmi(devices=4)
    fake.entry_delay_s = 0.0005
    with _open(fake, settings) as b:

        def work() -> None:
            for _ in range(5):
                for dev in b.devices():
                    dev.read_state()
                b.devices()[0].details()

        _hammer(6, work)
    assert len(fake.calls) > 500
    assert fake.concurrent_entries == 0


def test_the_fake_detects_overlapping_calls() -> None:
    fake = make_fake_amdsmi()
    fake.amdsmi_init()
    fake.entry_delay_s = 0.002
    handle = fake.amdsmi_get_processor_handles()[0]
    _hammer(4, lambda: [fake.amdsmi_get_power_info(handle) for _ in range(5)])
    assert fake.concurrent_entries > 0


# -- the CLI, unchanged, and the hardware check, on the amdsmi backend ------------------------------


def test_cli_commands_work_on_the_amd_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = make_fake_amdsmi(2)
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    runner, env = CliRunner(), {"POWERLIB_BACKEND": "amd"}
    devices = json.loads(runner.invoke(cli, ["devices", "--json"], env=env).stdout)["devices"]
    assert [d["backend"] for d in devices] == ["amd", "amd"]
    assert all(
        isinstance(d["power_w"], float) and isinstance(d["energy_j"], float) for d in devices
    )
    result = runner.invoke(
        cli, ["set", "--device", "1", "--freq-mhz", "1500", "--power-limit-w", "600"], env=env
    )
    assert result.exit_code == 0, result.output
    gpu = fake.gpus[1]
    assert (gpu.soft_min_mhz, gpu.soft_max_mhz) == (1500, 1500) and gpu.power_cap_uw == 600_000_000
    status = runner.invoke(cli, ["status", "--device", "1"], env=env).stdout
    assert "memory clock lock: no" in status and "energy counter: yes" in status
    watch = runner.invoke(cli, ["watch", "--count", "2", "--interval-s", "0.01", "--json"], env=env)
    assert watch.exit_code == 0 and len(watch.stdout.splitlines()) == 4
    assert runner.invoke(cli, ["reset", "--all"], env=env).exit_code == 0
    assert gpu.soft_max_mhz is None and gpu.power_cap_uw == gpu.default_power_cap_uw


def test_the_hardware_check_itself_passes_on_the_fake(
    monkeypatch: pytest.MonkeyPatch, hardware_check
) -> None:
    """Dry run of tests/hardware on the fake amdsmi, so the script an AMD owner runs is known to work."""
    fake = make_fake_amdsmi(1)
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    monkeypatch.setattr(
        hardware_check, "_ENV", {"POWERLIB_BACKEND": "amd", "POWERLIB_STATE_DIR": "/tmp"}
    )
    hardware_check.test_read_lock_limit_restore_on_a_real_gpu()
    gpu = fake.gpus[0]
    assert gpu.soft_max_mhz is None and gpu.power_cap_uw == gpu.default_power_cap_uw
    assert fake.count("amdsmi_set_gpu_clk_range") == 1 and fake.count("amdsmi_set_power_cap") == 2
