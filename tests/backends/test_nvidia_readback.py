"""The NVML backend reads the clock lock back, retries transient codes, reads MIG mode through the
driver and says up front when it cannot change clocks (docs/real-gpu.md §1, §2, §4, §5).

On the fake pynvml (real nvidia-ml-py error types); nothing here ran on a real GPU. The last tests
check the device-level read-back on the simulated backend, whose driver reports the locked range.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from uid_helpers import NOBODY, as_uid

import powerlib.device
from powerlib import DeviceBusyError, DeviceError, Settings
from powerlib.backend import Backend
from powerlib.backends import amd as amd_backend
from powerlib.backends import nvidia as nvidia_backend
from powerlib.backends.amd import AmdBackend
from powerlib.backends.nvidia import NvidiaBackend
from powerlib.device import ClockLockState
from powerlib.errors import TransientDeviceError
from powerlib.testing.fake_amdsmi import make_fake_amdsmi
from powerlib.testing.fake_nvml import A100_SXM4_40GB, H100_SXM5_80GB, V100_SXM2_16GB, FakeNvml

pynvml = pytest.importorskip("pynvml")  # nvidia-ml-py, from the test extra

CAP_SYS_ADMIN_BIT = 1 << 21


@pytest.fixture(autouse=True)
def _no_retry_delays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(powerlib.device, "TRANSIENT_RETRY_DELAYS_S", (0.0, 0.0, 0.0))


def _open(settings: Settings, fake: FakeNvml) -> NvidiaBackend:
    return NvidiaBackend(settings.replace(cuda_device_order="PCI_BUS_ID"), nvml=fake)


# -- transient codes (issue 33 point 2) -----------------------------------------------------------


TRANSIENT_CODES = [pynvml.NVML_ERROR_TIMEOUT, pynvml.NVML_ERROR_IN_USE, pynvml.NVML_ERROR_NOT_READY]


@pytest.mark.parametrize("code", TRANSIENT_CODES)
def test_a_transient_code_is_retried_and_the_lock_lands(settings: Settings, code: int) -> None:
    fake = FakeNvml([H100_SXM5_80GB])
    dev = _open(settings, fake).device(0)
    fake.fail("nvmlDeviceSetGpuLockedClocks", code, times=2)
    assert dev.lock_sm_clocks(1200, 1500) == (1200.0, 1500.0)
    assert fake.calls.count("nvmlDeviceSetGpuLockedClocks") == 3
    assert fake.gpus[0].locked_mhz == (1200, 1500)


@pytest.mark.parametrize("code", TRANSIENT_CODES)
def test_a_transient_code_that_persists_is_transient_not_busy(
    settings: Settings, code: int
) -> None:
    fake = FakeNvml([H100_SXM5_80GB])
    dev = _open(settings, fake).device(0)
    fake.fail("nvmlDeviceSetGpuLockedClocks", code)
    with pytest.raises(TransientDeviceError) as info:
        dev.lock_sm_clocks(1200)
    assert not isinstance(info.value, DeviceBusyError)  # busy means "another controller owns it"
    assert info.value.vendor_code == code and info.value.operation == "lock_sm_clocks"
    assert "\n" not in str(info.value)
    assert fake.calls.count("nvmlDeviceSetGpuLockedClocks") == 1 + len(
        powerlib.device.TRANSIENT_RETRY_DELAYS_S
    )
    assert fake.gpus[0].locked_mhz is None


# -- read-back (issue 33 point 1) -------------------------------------------------------------------


def test_the_lock_reads_back_from_the_event_reasons_never_as_unlocked(settings: Settings) -> None:
    fake = FakeNvml([H100_SXM5_80GB])
    gpu = fake.gpus[0]
    dev = _open(settings, fake).device(0)
    idle = dev.read_sm_lock()
    assert idle == ClockLockState(locked=None, running_mhz=345.0, reasons=("gpu_idle",))
    assert idle.idle and idle.range_mhz is None
    gpu.busy = True
    dev.lock_sm_clocks(1200, 1500)
    after = dev.last_sm_readback
    assert after is not None and after.locked is True and after.range_mhz is None
    assert after.running_mhz == 1500.0 and after.reasons == ("clocks_locked_or_app_clocks",)
    assert not after.limited
    dev.reset_sm_clocks()
    assert dev.last_sm_readback == ClockLockState(locked=None, running_mhz=1980.0)
    assert dev.details()["clock_event_reasons"] == []


def test_someone_elses_lock_shows_as_locked(settings: Settings) -> None:
    fake = FakeNvml([H100_SXM5_80GB])
    dev = _open(settings, fake).device(0)
    fake.gpus[0].locked_mhz = (1000, 1000)  # an administrator's nvidia-smi -lgc
    fake.gpus[0].busy = True
    state = dev.read_sm_lock()
    assert state.locked is True and state.running_mhz == 1000.0
    assert dev.read_state().locked_sm_freqs_mhz is None  # this process's record knows nothing


def test_a_lock_the_driver_ignores_reads_back_as_unknown_at_the_unlocked_clock(
    settings: Settings,
) -> None:
    """NVML cannot say "not locked", so the write is not refused: the read-back shows it."""
    fake = FakeNvml([H100_SXM5_80GB])
    gpu = fake.gpus[0]
    gpu.ignores_lock = gpu.busy = True
    dev = _open(settings, fake).device(0)
    assert dev.lock_sm_clocks(1200) == (1200.0, 1200.0)
    assert gpu.locked_mhz is None
    assert dev.last_sm_readback == ClockLockState(locked=None, running_mhz=1980.0)


def test_a_reset_the_driver_ignores_is_an_error(settings: Settings) -> None:
    fake = FakeNvml([H100_SXM5_80GB])
    gpu = fake.gpus[0]
    gpu.locked_mhz, gpu.ignores_lock = (1000, 1000), True
    dev = _open(settings, fake).device(0)
    with pytest.raises(DeviceError, match="still in force after a reset") as info:
        dev.reset_sm_clocks()
    assert info.value.operation == "reset_sm_clocks"


def test_a_reason_that_clears_shortly_after_a_reset_is_not_an_error(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVML's reasons describe the clock now: the lock's may outlive the reset by a moment."""
    fake = FakeNvml([H100_SXM5_80GB])
    dev = _open(settings, fake).device(0)
    dev.lock_sm_clocks(1000)
    reads = {"n": 0}
    real = fake.nvmlDeviceGetCurrentClocksEventReasons

    def lagging(handle: object) -> int:
        reads["n"] += 1
        return real(handle) | (0x2 if reads["n"] <= 3 else 0)  # the first reads still see it

    monkeypatch.setattr(fake, "nvmlDeviceGetCurrentClocksEventReasons", lagging)
    dev.reset_sm_clocks()  # no DeviceError: read again until the reason clears
    assert fake.gpus[0].locked_mhz is None and reads["n"] == 4
    assert dev.last_sm_readback is not None and dev.last_sm_readback.locked is None


def test_application_clocks_make_the_lock_reason_prove_nothing(settings: Settings) -> None:
    """Legacy application clocks set the same reason: no lock is claimed, a reset still works."""
    fake = FakeNvml([H100_SXM5_80GB])
    fake.gpus[0].app_clock_mhz = 1410
    dev = _open(settings, fake).device(0)
    assert dev.read_sm_lock().locked is None
    dev.reset_sm_clocks()  # the reason stays set, but it is the application clocks'
    assert "clocks_locked_or_app_clocks" in dev.read_sm_lock().reasons


def test_at_the_power_cap_the_top_locks_run_at_one_clock(settings: Settings) -> None:
    fake = FakeNvml([H100_SXM5_80GB])
    gpu = fake.gpus[0]
    gpu.busy = True
    dev = _open(settings, fake).device(0)
    dev.set_power_limit(500)  # 73 W idle + 0.3 W/MHz: 1410 MHz is the highest clock under 500 W
    running = {}
    for mhz in (1500, 1800, 1980):
        dev.lock_sm_clocks(mhz)
        state = dev.last_sm_readback
        assert state is not None and state.locked is True
        assert state.limited == ("sw_power_cap",)
        running[mhz] = state.running_mhz
    assert running == {1500: 1410.0, 1800: 1410.0, 1980: 1410.0}
    assert "sw_power_cap" in dev.details()["clock_event_reasons"]
    assert dev.read_state().power_w <= 500.0
    dev.lock_sm_clocks(1200)
    below = dev.read_sm_lock()
    assert below.running_mhz == 1200.0 and not below.limited


# -- MIG through the driver (issue 33 point 4) ------------------------------------------------------


def test_mig_mode_is_read_from_the_driver(settings: Settings) -> None:
    fake = FakeNvml([A100_SXM4_40GB, H100_SXM5_80GB, V100_SXM2_16GB])
    fake.gpus[0].mig_mode = pynvml.NVML_DEVICE_MIG_ENABLE
    fake.gpus[1].mig_mode_pending = pynvml.NVML_DEVICE_MIG_ENABLE  # only after a GPU reset
    a100, h100, v100 = _open(settings, fake).devices()
    assert (a100.mig_enabled(), h100.mig_enabled(), v100.mig_enabled()) == (True, False, None)
    assert [d.details()["mig_enabled"] for d in (a100, h100, v100)] == [True, False, None]
    assert "nvmlDeviceGetMigMode" in fake.calls
    json.dumps(a100.details())


# -- control_refusal (issue 33 point 5) ------------------------------------------------------------


def _nvidia(settings: Settings) -> Backend:
    return _open(settings, FakeNvml([H100_SXM5_80GB]))


def _amd(settings: Settings) -> Backend:
    return AmdBackend(settings.replace(backend="amd"), smi=make_fake_amdsmi())


BACKENDS = [
    pytest.param(_nvidia, nvidia_backend, "NVIDIA GPU clocks", id="nvidia"),
    pytest.param(_amd, amd_backend, "AMD GPU clocks", id="amd"),
]


def _status_file(tmp_path: Path, cap_eff: int) -> Path:
    path = tmp_path / "status"
    path.write_text(f"Name:\tpython3\nUid:\t0\t0\t0\t0\nCapEff:\t{cap_eff:016x}\n")
    return path


@pytest.mark.skipif(os.geteuid() != 0, reason="forks a child that drops from root to nobody")
@pytest.mark.parametrize(("open_backend", "module", "what"), BACKENDS)
def test_a_non_root_process_is_refused_with_the_ways_out(
    settings: Settings, tmp_path: Path, open_backend, module, what: str
) -> None:
    with open_backend(settings) as backend:
        out = as_uid(NOBODY, backend.control_refusal)
        assert out["ok"], out
        line = out["value"]
        assert line is not None and "\n" not in line
        assert what in line and f"not root (uid {NOBODY})" in line
        assert "POWERLIB_BACKEND=agent" in line and "run the job as root" in line


@pytest.mark.skipif(os.geteuid() != 0, reason="root is checked for CAP_SYS_ADMIN")
@pytest.mark.parametrize(("open_backend", "module", "what"), BACKENDS)
def test_root_without_cap_sys_admin_is_refused(
    settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    open_backend,
    module,
    what: str,
) -> None:
    full = 0x1FFFFFFFFFF
    with open_backend(settings) as backend:
        monkeypatch.setattr(module, "_PROC_STATUS_PATH", _status_file(tmp_path, full))
        assert backend.control_refusal() is None
        monkeypatch.setattr(
            module, "_PROC_STATUS_PATH", _status_file(tmp_path, full & ~CAP_SYS_ADMIN_BIT)
        )
        line = backend.control_refusal()
        assert line is not None and "\n" not in line
        assert what in line and "CAP_SYS_ADMIN" in line and "POWERLIB_BACKEND=agent" in line


# -- the device-level check, on a driver that reports the locked range ----------------------------


@pytest.fixture
def sim_device(settings: Settings):
    from powerlib.backends.simulated import SimulatedBackend, VirtualClock

    with SimulatedBackend(
        settings.replace(backend="simulated", sim_gpus=1), clock=VirtualClock(), persist=False
    ) as backend:
        yield backend.device(0)


def test_a_driver_that_applies_another_range_fails_the_lock(
    sim_device, monkeypatch: pytest.MonkeyPatch
) -> None:
    freqs = sim_device.info.supported_sm_freqs_mhz
    apply = sim_device._lock_sm_clocks
    monkeypatch.setattr(sim_device, "_lock_sm_clocks", lambda lo, hi: apply(freqs[-2], freqs[-2]))
    with pytest.raises(DeviceError, match=f"applied {freqs[-2]:g}-{freqs[-2]:g} MHz, not the"):
        sim_device.lock_sm_clocks(freqs[-1])


def test_a_driver_that_drops_the_write_fails_lock_and_reset(
    sim_device, monkeypatch: pytest.MonkeyPatch
) -> None:
    freqs = sim_device.info.supported_sm_freqs_mhz
    apply, drop = sim_device._lock_sm_clocks, [True]
    monkeypatch.setattr(
        sim_device, "_lock_sm_clocks", lambda lo, hi: None if drop[0] else apply(lo, hi)
    )
    with pytest.raises(DeviceError, match="did not take effect"):
        sim_device.lock_sm_clocks(freqs[0])
    drop[0] = False
    sim_device.lock_sm_clocks(freqs[0])
    assert sim_device.last_sm_readback.range_mhz == (freqs[0], freqs[0])
    monkeypatch.setattr(sim_device, "_reset_sm_clocks", lambda: None)
    with pytest.raises(DeviceError, match="still in force after a reset"):
        sim_device.reset_sm_clocks()
