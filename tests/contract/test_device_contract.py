"""One contract, every backend that can be built here.

Targets: the simulated backend (in-memory virtual clock, and persisted state), the sysfs backend
over fake trees with kernel semantics (Intel RAPL + acpi-cpufreq, AMD Zen energy-only zones,
intel_pstate without a frequency table), the NVML backend on a fake pynvml that raises
nvidia-ml-py's real error types (A100 + H100 + a counter-less V100), and the amdsmi backend on a
fake amdsmi mirroring the 7.0.2 wrapper (two MI300X-like GPUs).
"""

from __future__ import annotations

import errno
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from powerlib import (
    Backend,
    DeviceKind,
    DeviceLostError,
    DeviceNotFoundError,
    InvalidArgumentError,
    NotSupportedError,
    PermissionDeniedError,
    PowerlibError,
    Settings,
)


@dataclass
class Target:
    """A backend under test plus a way to make time and energy pass on it."""

    open: Callable[[], Backend]
    advance: Callable[[float], None]  # seconds of activity
    kind: DeviceKind
    # Makes the fake fail the next operations with one kind of fault; False if it cannot.
    inject: Callable[[str], bool] = lambda kind: False


def _simulated(settings: Settings, persist: bool) -> Target:
    from powerlib.backends.simulated import SimulatedBackend, VirtualClock

    clock = VirtualClock(start_s=1000.0)
    s = settings.replace(backend="simulated", sim_gpus=2)
    return Target(
        open=lambda: SimulatedBackend(s, clock=clock, persist=persist),
        advance=clock.advance,
        kind=DeviceKind.GPU,
    )


def _sysfs(settings: Settings, flavour: str) -> Target:
    from powerlib.backends.sysfs import SysfsBackend
    from powerlib.testing.sysfs import FakeKernel, make_cpufreq_tree, make_powercap_tree

    root = settings.sysfs_root
    if flavour == "intel":
        # A small wrap range so that advancing forces a wraparound within the test.
        make_powercap_tree(
            root,
            packages=2,
            vendor="intel",
            max_energy_range_uj=5_000_000,
            start_energy_uj=4_000_000,
        )
        make_cpufreq_tree(root, packages=2, driver="acpi-cpufreq")
    elif flavour == "amd":
        make_powercap_tree(root, packages=2, vendor="amd")
        make_cpufreq_tree(root, packages=2, driver="amd-pstate")
    else:
        make_cpufreq_tree(root, packages=1, driver="intel_pstate")
    kernel = FakeKernel(root)
    zones = (
        sorted(
            p.name
            for p in (root / "class" / "powercap").glob("intel-rapl:*")
            if p.name.count(":") == 1
        )
        if (root / "class" / "powercap").exists()
        else []
    )

    def advance(seconds: float) -> None:
        for zone in zones:
            kernel.advance_energy(zone, int(seconds * 2 * 1e6))  # 2 W: several steps per wrap

    def inject(kind: str) -> bool:
        if kind != "no_permission":
            return False
        kernel.inject("*scaling_m??_freq", "write", errno.EACCES)
        kernel.inject("*power_limit_uw", "write", errno.EACCES)
        return True

    return Target(
        open=lambda: SysfsBackend(settings.replace(backend="sysfs"), io=kernel),
        advance=advance,
        kind=DeviceKind.CPU,
        inject=inject,
    )


def _nvidia(settings: Settings) -> Target:
    pytest.importorskip("pynvml")
    from powerlib.backends.nvidia import NvidiaBackend
    from powerlib.testing.fake_nvml import A100_SXM4_40GB, H100_SXM5_80GB, V100_SXM2_16GB, FakeNvml

    fake = FakeNvml([A100_SXM4_40GB, H100_SXM5_80GB, V100_SXM2_16GB])
    faults = {
        "no_permission": ("nvmlDeviceSet*", fake.NVML_ERROR_NO_PERMISSION),
        "not_supported": ("nvmlDeviceSet*", fake.NVML_ERROR_NOT_SUPPORTED),
        "lost": ("nvmlDevice*", fake.NVML_ERROR_GPU_IS_LOST),
    }

    def inject(kind: str) -> bool:
        fake.fail(*faults[kind])
        return True

    return Target(
        open=lambda: NvidiaBackend(settings.replace(backend="nvidia"), nvml=fake),
        advance=fake.advance,
        kind=DeviceKind.GPU,
        inject=inject,
    )


def _amd(settings: Settings) -> Target:
    from powerlib.backends.amd import AmdBackend
    from powerlib.testing.fake_amdsmi import make_fake_amdsmi

    fake = make_fake_amdsmi(2)
    faults = {  # amdsmi status codes: NO_PERM 10, NOT_SUPPORTED 2, NOT_FOUND 31 (on an open GPU)
        "no_permission": ("amdsmi_set_*", 10),
        "not_supported": ("amdsmi_set_*", 2),
        "lost": ("amdsmi_*", 31),
    }

    def inject(kind: str) -> bool:
        fake.fail(*faults[kind])
        return True

    return Target(
        open=lambda: AmdBackend(settings.replace(backend="amd"), smi=fake),
        advance=fake.advance,
        kind=DeviceKind.GPU,
        inject=inject,
    )


TARGETS = {
    "simulated-memory": lambda s: _simulated(s, persist=False),
    "simulated-persisted": lambda s: _simulated(s, persist=True),
    "sysfs-intel": lambda s: _sysfs(s, "intel"),
    "sysfs-amd": lambda s: _sysfs(s, "amd"),
    "sysfs-intel_pstate": lambda s: _sysfs(s, "pstate"),
    "nvidia-fake": _nvidia,
    "amd-fake": _amd,
}


@pytest.fixture(params=sorted(TARGETS))
def target(request: pytest.FixtureRequest, settings: Settings) -> Target:
    return TARGETS[request.param](settings)


@pytest.fixture
def backend(target: Target) -> Iterator[Backend]:
    with target.open() as b:
        yield b


def test_enumeration_is_stable_and_unique(target: Target, backend: Backend) -> None:
    ids = [d.device_id for d in backend.devices()]
    assert ids, "a backend that opened must have devices"
    assert len(set(ids)) == len(ids)
    assert [d.index for d in backend.devices()] == list(range(len(ids)))
    with target.open() as again:
        assert [d.device_id for d in again.devices()] == ids
    assert backend.device(0).device_id == ids[0]
    assert backend.device(ids[-1]).device_id == ids[-1]
    assert backend.device(str(len(ids) - 1)).device_id == ids[-1]
    with pytest.raises(DeviceNotFoundError):
        backend.device(len(ids))
    with pytest.raises(DeviceNotFoundError):
        backend.device("no-such-device")


def test_static_facts_are_well_formed(target: Target, backend: Backend) -> None:
    for dev in backend.devices():
        info = dev.info
        assert info.kind is target.kind
        assert info.backend == backend.name
        assert info.name and info.vendor
        freqs = info.supported_sm_freqs_mhz
        assert all(isinstance(f, float) for f in freqs)
        assert list(freqs) == sorted(set(freqs))
        assert bool(freqs) == info.capabilities.can_lock_sm_clocks
        if info.power_limit_range_w is not None:
            lo, hi = info.power_limit_range_w
            assert 0 <= lo <= hi
            if info.default_power_limit_w is not None:
                assert lo <= info.default_power_limit_w <= hi
        assert info.capabilities.can_reset_power_limit == (info.default_power_limit_w is not None)
        json.dumps(dict(dev.details()))  # details are JSON-serialisable


def test_state_snapshot_has_units_and_honours_capabilities(
    target: Target, backend: Backend
) -> None:
    for dev in backend.devices():
        caps = dev.info.capabilities
        dev.read_state()
        target.advance(0.5)
        time.sleep(0.02)  # sysfs derives power from two counter reads >= 10 ms apart
        st = dev.read_state()
        assert st.device_id == dev.device_id
        assert isinstance(st.timestamp_s, float)
        for value in (st.power_w, st.energy_j, st.sm_freq_mhz, st.power_limit_w, st.temperature_c):
            assert value is None or (isinstance(value, float) and math.isfinite(value))
        if caps.has_energy_counter:
            assert st.energy_j is not None
        if st.energy_j is not None and not caps.has_energy_counter:
            assert caps.has_power_reading  # integrated from power readings (documented fallback)
        assert (st.temperature_c is not None) == caps.has_temperature
        if caps.has_power_reading:
            assert st.power_w is not None and st.power_w >= 0
        if caps.can_lock_sm_clocks:
            assert st.sm_freq_mhz is not None and st.sm_freq_mhz > 0
        if caps.can_set_power_limit:
            assert st.power_limit_w is not None and st.power_limit_w > 0


def test_unsupported_operations_raise_not_supported(backend: Backend) -> None:
    for dev in backend.devices():
        caps = dev.info.capabilities
        if not caps.can_lock_sm_clocks:
            with pytest.raises(NotSupportedError):
                dev.lock_sm_clocks(1000.0)
            with pytest.raises(NotSupportedError):
                dev.reset_sm_clocks()
        if not caps.can_set_power_limit:
            with pytest.raises(NotSupportedError):
                dev.set_power_limit(100.0)
        if not caps.can_reset_power_limit:
            with pytest.raises(NotSupportedError):
                dev.reset_power_limit()


def test_clock_lock_snaps_applies_and_resets(backend: Backend) -> None:
    for dev in backend.devices():
        freqs = dev.info.supported_sm_freqs_mhz
        if not freqs:
            continue
        mid = freqs[len(freqs) // 2]
        assert dev.lock_sm_clocks(mid + 0.3) == (mid, mid)  # snapped to the supported list
        st = dev.read_state()
        assert st.locked_sm_freqs_mhz == (mid, mid)
        lo, hi = dev.lock_sm_clocks(freqs[0], freqs[-2])
        assert (lo, hi) == (freqs[0], freqs[-2])
        assert dev.read_state().locked_sm_freqs_mhz == (freqs[0], freqs[-2])
        dev.reset_sm_clocks()
        dev.reset_sm_clocks()  # idempotent
        assert dev.read_state().locked_sm_freqs_mhz is None


def test_bad_clock_requests_change_nothing(backend: Backend) -> None:
    for dev in backend.devices():
        freqs = dev.info.supported_sm_freqs_mhz
        if not freqs:
            continue
        dev.lock_sm_clocks(freqs[1])
        before = dev.read_state().locked_sm_freqs_mhz
        for bad in (
            (freqs[-1], freqs[0]),
            (freqs[-1] + 500, None),
            (freqs[0] - 500, None),
            (float("nan"), None),
            (float("inf"), None),
        ):
            with pytest.raises(InvalidArgumentError):
                dev.lock_sm_clocks(*bad)
            assert dev.read_state().locked_sm_freqs_mhz == before
        dev.reset_sm_clocks()


def test_power_limit_set_validate_reset(backend: Backend) -> None:
    for dev in backend.devices():
        info = dev.info
        if not info.capabilities.can_set_power_limit:
            continue
        limits = info.power_limit_range_w
        assert limits is not None
        target_w = round((limits[0] + limits[1]) / 2)
        assert dev.set_power_limit(target_w) == pytest.approx(target_w, abs=1e-3)
        assert dev.read_state().power_limit_w == pytest.approx(target_w, abs=1e-3)
        for bad in (limits[1] + 1, limits[0] - 1, float("nan")):
            with pytest.raises(InvalidArgumentError):
                dev.set_power_limit(bad)
            assert dev.read_state().power_limit_w == pytest.approx(target_w, abs=1e-3)
        if info.capabilities.can_reset_power_limit:
            dev.reset_power_limit()
            dev.reset_power_limit()
            assert dev.read_state().power_limit_w == pytest.approx(info.default_power_limit_w)


def test_energy_counter_never_decreases(target: Target, backend: Backend) -> None:
    for dev in backend.devices():
        if not dev.info.capabilities.has_energy_counter:
            continue
        readings = [dev.read_state().energy_j]
        for _ in range(4):  # the sysfs-intel tree wraps within these steps
            target.advance(0.5)
            readings.append(dev.read_state().energy_j)
        assert all(
            b is not None and a is not None and b > a for a, b in zip(readings, readings[1:])
        )


def test_every_error_is_a_powerlib_error(backend: Backend) -> None:
    dev = backend.devices()[0]
    calls: list[Callable[[], object]] = [
        lambda: dev.lock_sm_clocks(-1.0),
        lambda: dev.set_power_limit(-1.0),
        lambda: backend.device(99),
    ]
    for call in calls:
        with pytest.raises(PowerlibError):
            call()


@pytest.mark.parametrize(
    ("kind", "error", "operation"),
    [
        ("no_permission", PermissionDeniedError, "write"),
        ("not_supported", NotSupportedError, "write"),
        ("lost", DeviceLostError, "read"),
    ],
)
def test_injected_faults_map_onto_the_hierarchy(
    target: Target, backend: Backend, kind: str, error: type[PowerlibError], operation: str
) -> None:
    dev = backend.devices()[0]
    before = dev.read_state()
    if not target.inject(kind):
        pytest.skip(f"this target's fake cannot inject {kind!r}")
    with pytest.raises(error) as info:
        if operation == "write":
            dev.lock_sm_clocks(dev.info.supported_sm_freqs_mhz[0])
        else:
            dev.read_state()
    assert info.value.vendor_code is not None
    assert info.value.device == dev.device_id
    if operation == "write":
        assert dev.read_state().locked_sm_freqs_mhz == before.locked_sm_freqs_mhz
