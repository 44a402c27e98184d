"""The sysfs backend (powercap/RAPL + cpufreq) against fake trees with kernel semantics.

Every tree lives under ``tmp_path``; errors are injected through ``FakeKernel`` (tests run as root,
and root ignores file modes), so nothing patches ``open``, ``glob`` or ``os.path.exists``.
"""

from __future__ import annotations

import ast
import errno
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

import powerlib
from powerlib.backends._sysfs_io import SysfsIO
from powerlib.backends.sysfs import SysfsBackend, SysfsCpuPackage
from powerlib.config import Settings
from powerlib.device import Device, DeviceKind
from powerlib.errors import (
    BackendUnavailableError,
    DeviceError,
    InvalidArgumentError,
    NotSupportedError,
    PermissionDeniedError,
    PowerlibError,
)
from powerlib.registry import open_backend
from powerlib.testing.sysfs import FakeKernel, make_cpufreq_tree, make_powercap_tree

BACKENDS_DIR = Path(__file__).resolve().parents[2] / "backends"
RAPL = "devices/virtual/powercap/intel-rapl"
CPUFREQ = "devices/system/cpu/cpufreq"


class FakeClock:
    """A monotonic clock that only moves when told to."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def settings_for(root: Path) -> Settings:
    return Settings(backend="sysfs", sysfs_root=root, state_dir=root / "state")


def open_sysfs(
    root: Path, kernel: FakeKernel | None = None, clock: FakeClock | None = None
) -> tuple[SysfsBackend, FakeKernel]:
    kernel = FakeKernel(root) if kernel is None else kernel
    backend = SysfsBackend(settings_for(root), io=kernel, monotonic=clock or FakeClock())
    return backend, kernel


def read(root: Path, rel: str) -> str:
    return (root / rel).read_text().strip()


def details_of(dev: Device) -> dict[str, Any]:
    details: dict[str, Any] = json.loads(json.dumps(dev.details()))
    return details


def policy_names(dev: Device) -> list[str]:
    return [p["policy"] for p in details_of(dev)["cpufreq_policies"]]


@pytest.fixture
def intel_root(tmp_path: Path) -> Path:
    """Two Intel packages with dram subzones, two acpi-cpufreq policies (policy0, policy2)."""
    make_powercap_tree(tmp_path, packages=2)
    make_cpufreq_tree(tmp_path, packages=2, cpus_per_package=2, cpus_per_policy=2)
    return tmp_path


# -- enumeration ---------------------------------------------------------------------------------


def test_two_intel_packages_are_two_devices(intel_root: Path) -> None:
    backend, _ = open_sysfs(intel_root)
    devices = backend.devices()
    assert [d.device_id for d in devices] == ["intel-rapl:0", "intel-rapl:1"]
    assert [d.info.name for d in devices] == ["package-0", "package-1"]
    assert [d.index for d in devices] == [0, 1]
    for dev in devices:
        assert isinstance(dev, SysfsCpuPackage)
        info = dev.info
        assert (info.vendor, info.kind, info.backend) == ("intel", DeviceKind.CPU, "sysfs")
        assert info.supported_sm_freqs_mhz == (1200.0, 1800.0, 2400.0, 3000.0)
        assert info.power_limit_range_w == (1.0, 150.0)
        assert info.default_power_limit_w == 150.0
        assert info.capabilities.names() == (
            "can_lock_sm_clocks",
            "can_set_power_limit",
            "can_reset_power_limit",
            "has_energy_counter",
            "has_power_reading",
        )
    assert backend.device("intel-rapl:1") is devices[1]
    policies = [policy_names(d) for d in devices]
    assert policies == [["policy0"], ["policy2"]]


def test_read_state_reports_units(intel_root: Path) -> None:
    backend, _ = open_sysfs(intel_root)
    state = backend.devices()[0].read_state()
    assert state.device_id == "intel-rapl:0"
    assert state.energy_j == pytest.approx(1.0)  # start_energy_uj = 1_000_000 µJ
    assert state.memory_energy_j == pytest.approx(0.1)  # dram subzone
    assert state.power_limit_w == 150.0
    assert state.sm_freq_mhz == 2400.0
    assert state.temperature_c is None
    assert state.locked_sm_freqs_mhz is None
    assert state.power_w is None  # no interval yet


def test_details_are_json_serialisable(intel_root: Path) -> None:
    backend, _ = open_sysfs(intel_root)
    details = backend.devices()[0].details()
    assert json.loads(json.dumps(details)) == details
    assert [c["name"] for c in details_of(backend.devices()[0])["constraints"]] == [
        "long_term",
        "short_term",
    ]
    assert details["subzones"] == [{"zone": "intel-rapl:0:0", "name": "dram"}]
    policy = details_of(backend.devices()[0])["cpufreq_policies"][0]
    assert policy["driver"] == "acpi-cpufreq" and policy["max_mhz"] == 3000.0


def test_hex_zone_ids_are_ordered_by_package_number(tmp_path: Path) -> None:
    make_powercap_tree(tmp_path, packages=12)
    make_cpufreq_tree(tmp_path, packages=12)
    backend, _ = open_sysfs(tmp_path)
    devices = backend.devices()
    assert [d.info.name for d in devices] == [f"package-{n}" for n in range(12)]
    assert devices[10].device_id == "intel-rapl:a"
    assert devices[11].device_id == "intel-rapl:b"
    assert policy_names(devices[10]) == ["policy20"]


def test_zones_are_identified_by_name_not_index(tmp_path: Path) -> None:
    """A client part's psys zone (top-level, not a package) is not a device; mmio is ignored."""
    make_powercap_tree(tmp_path, packages=2)
    (tmp_path / RAPL / "intel-rapl:1" / "name").write_text("psys\n")
    (tmp_path / "class/powercap/intel-rapl-mmio:0").mkdir(parents=True)
    (tmp_path / "class/powercap/intel-rapl-mmio:0/name").write_text("package-0\n")
    backend, _ = open_sysfs(tmp_path)
    assert [d.device_id for d in backend.devices()] == ["intel-rapl:0"]


def test_die_zones_are_one_device_each(tmp_path: Path) -> None:
    make_powercap_tree(tmp_path, packages=1, dies_per_package=2)
    make_cpufreq_tree(tmp_path, packages=1, cpus_per_package=4, dies_per_package=2)
    backend, _ = open_sysfs(tmp_path)
    devices = backend.devices()
    assert [d.info.name for d in devices] == ["package-0-die-0", "package-0-die-1"]
    policies = [policy_names(d) for d in devices]
    assert policies == [["policy0"], ["policy2"]]


def test_powercap_only_without_class_symlinks(tmp_path: Path) -> None:
    """A container bind-mounts only devices/virtual/powercap: zones are found there."""
    make_powercap_tree(tmp_path, packages=2)
    for link in (tmp_path / "class/powercap").iterdir():
        link.unlink()
    backend, kernel = open_sysfs(tmp_path)
    dev = backend.devices()[0]
    assert dev.device_id == "intel-rapl:0"
    assert not dev.info.capabilities.can_lock_sm_clocks
    assert dev.info.supported_sm_freqs_mhz == ()
    before_j = dev.read_state().energy_j
    assert before_j is not None
    kernel.advance_energy("intel-rapl:0", 500_000)
    assert dev.read_state().energy_j == pytest.approx(before_j + 0.5)


def test_cpufreq_only_package_is_a_clock_device(tmp_path: Path) -> None:
    make_cpufreq_tree(tmp_path, packages=1, driver="amd-pstate-epp")
    backend, _ = open_sysfs(tmp_path)
    (dev,) = backend.devices()
    assert (dev.device_id, dev.info.name, dev.info.vendor) == (
        "cpufreq-package-0",
        "package-0",
        "amd",
    )
    caps = dev.info.capabilities
    assert caps.can_lock_sm_clocks and not caps.can_set_power_limit and not caps.has_energy_counter
    state = dev.read_state()
    assert state.energy_j is None and state.power_w is None and state.power_limit_w is None
    with pytest.raises(NotSupportedError):
        dev.set_power_limit(100.0)


def test_missing_topology_puts_every_policy_in_package_0(tmp_path: Path) -> None:
    make_cpufreq_tree(tmp_path, packages=2)
    for cpu in range(4):
        (tmp_path / f"devices/system/cpu/cpu{cpu}/topology/physical_package_id").unlink()
    backend, _ = open_sysfs(tmp_path)
    (dev,) = backend.devices()
    assert policy_names(dev) == ["policy0", "policy2"]


# -- energy --------------------------------------------------------------------------------------


def test_energy_wraparound_adds_the_wrapped_delta(tmp_path: Path) -> None:
    make_powercap_tree(tmp_path, packages=1, max_energy_range_uj=1_000_000, start_energy_uj=900_000)
    backend, kernel = open_sysfs(tmp_path)
    dev = backend.devices()[0]
    first_j = dev.read_state().energy_j
    assert first_j is not None and first_j == pytest.approx(0.9)
    kernel.advance_energy("intel-rapl:0", 200_000)
    assert read(tmp_path, f"{RAPL}/intel-rapl:0/energy_uj") == "100000"  # the raw counter wrapped
    assert dev.read_state().energy_j == pytest.approx(first_j + 0.2)


def test_energy_never_decreases_across_several_wraps(tmp_path: Path) -> None:
    make_powercap_tree(tmp_path, packages=1, max_energy_range_uj=1_000_000, start_energy_uj=0)
    backend, kernel = open_sysfs(tmp_path)
    dev = backend.devices()[0]
    readings: list[float] = []
    for delta_uj in (0, 400_000, 700_000, 999_999, 1, 300_000):
        kernel.advance_energy("intel-rapl:0", delta_uj)
        kernel.advance_energy("intel-rapl:0:0", delta_uj // 2)
        energy_j = dev.read_state().energy_j
        assert energy_j is not None
        readings.append(energy_j)
    assert readings == sorted(readings)
    assert readings[-1] == pytest.approx(2.4)


def test_power_is_derived_from_energy_over_at_least_10_ms(intel_root: Path) -> None:
    clock = FakeClock()
    backend, kernel = open_sysfs(intel_root, clock=clock)
    dev = backend.devices()[0]
    clock.advance(2.0)
    kernel.advance_energy("intel-rapl:0", 200_000_000)  # 200 J in 2 s
    assert dev.read_state().power_w == pytest.approx(100.0)
    clock.advance(0.005)
    kernel.advance_energy("intel-rapl:0", 1_000)
    assert dev.read_state().power_w is None  # under 10 ms apart


def test_long_gap_between_reads_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Range 1 J at 500 W wraps every 2 ms: reads 1 s apart may have missed wraps."""
    make_powercap_tree(tmp_path, packages=1, max_energy_range_uj=1_000_000)
    clock = FakeClock()
    backend, _ = open_sysfs(tmp_path, clock=clock)
    dev = backend.devices()[0]
    with caplog.at_level(logging.WARNING, logger="powerlib.backends.sysfs"):
        for _ in range(3):
            clock.advance(1.0)
            dev.read_state()
    wrap_warnings = [r for r in caplog.records if "wrap" in r.getMessage()]
    assert len(wrap_warnings) == 2  # once per counter: package and dram


def test_missing_energy_file_means_no_counter(intel_root: Path) -> None:
    (intel_root / RAPL / "intel-rapl:0" / "energy_uj").unlink()
    backend, _ = open_sysfs(intel_root)
    dev = backend.devices()[0]
    assert not dev.info.capabilities.has_energy_counter
    assert not dev.info.capabilities.has_power_reading
    state = dev.read_state()
    assert state.energy_j is None and state.power_w is None
    assert state.memory_energy_j == pytest.approx(0.1)


def test_unreadable_energy_counter_is_a_missing_capability(intel_root: Path) -> None:
    """energy_uj is root-only since Linux 5.10: a non-root process still gets a device."""
    kernel = FakeKernel(intel_root)
    kernel.inject("*intel-rapl:0/energy_uj", "read", errno.EACCES)
    backend, _ = open_sysfs(intel_root, kernel)
    dev = backend.devices()[0]
    assert not dev.info.capabilities.has_energy_counter
    assert dev.read_state().power_limit_w == 150.0


def test_eio_on_read_is_a_device_error(intel_root: Path) -> None:
    backend, kernel = open_sysfs(intel_root)
    kernel.inject("class/powercap/intel-rapl:0/energy_uj", "read", errno.EIO)
    with pytest.raises(DeviceError) as info:
        backend.devices()[0].read_state()
    assert info.value.vendor_code == "EIO"
    assert info.value.device == "intel-rapl:0"
    assert isinstance(info.value.__cause__, OSError)
    backend.devices()[1].read_state()  # the other package is unaffected


# -- power limits --------------------------------------------------------------------------------


def test_set_power_limit_writes_long_term_in_microwatts(intel_root: Path) -> None:
    backend, kernel = open_sysfs(intel_root)
    dev = backend.devices()[1]
    assert dev.set_power_limit(120.5) == 120.5
    assert read(intel_root, f"{RAPL}/intel-rapl:1/constraint_0_power_limit_uw") == "120500000"
    assert read(intel_root, f"{RAPL}/intel-rapl:1/constraint_1_power_limit_uw") == "180000000"
    assert dev.read_state().power_limit_w == 120.5
    assert kernel.writes == [
        ("class/powercap/intel-rapl:1/constraint_0_power_limit_uw", "120500000")
    ]
    dev.reset_power_limit()
    assert read(intel_root, f"{RAPL}/intel-rapl:1/constraint_0_power_limit_uw") == "150000000"


def test_constraint_is_selected_by_name(tmp_path: Path) -> None:
    """constraint_0 is short_term here; PL1 is constraint_1."""
    make_powercap_tree(tmp_path, packages=1, constraint_order=("short_term", "long_term"))
    backend, kernel = open_sysfs(tmp_path)
    dev = backend.devices()[0]
    assert dev.read_state().power_limit_w == 150.0
    assert dev.info.default_power_limit_w == 150.0
    dev.set_power_limit(100.0)
    assert read(tmp_path, f"{RAPL}/intel-rapl:0/constraint_1_power_limit_uw") == "100000000"
    assert read(tmp_path, f"{RAPL}/intel-rapl:0/constraint_0_power_limit_uw") == "180000000"


def test_set_power_limit_enables_a_disabled_zone(intel_root: Path) -> None:
    (intel_root / RAPL / "intel-rapl:0" / "enabled").write_text("0\n")
    kernel = FakeKernel(intel_root, bios_locked_zones=())  # disabled, but not locked
    backend, _ = open_sysfs(intel_root, kernel)
    backend.devices()[0].set_power_limit(90.0)
    assert kernel.writes == [
        ("class/powercap/intel-rapl:0/constraint_0_power_limit_uw", "90000000"),
        ("class/powercap/intel-rapl:0/enabled", "1"),
    ]


def test_out_of_range_power_limit_changes_nothing(intel_root: Path) -> None:
    backend, kernel = open_sysfs(intel_root)
    dev = backend.devices()[0]
    for bad_w in (200.0, 0.5, -10.0, float("nan")):
        with pytest.raises(InvalidArgumentError):
            dev.set_power_limit(bad_w)
    assert read(intel_root, f"{RAPL}/intel-rapl:0/constraint_0_power_limit_uw") == "150000000"
    assert kernel.writes == []


def test_eacces_on_write_is_permission_denied_and_reads_still_work(intel_root: Path) -> None:
    backend, kernel = open_sysfs(intel_root)
    kernel.inject("*/constraint_*_power_limit_uw", "write", errno.EACCES)
    dev = backend.devices()[0]
    with pytest.raises(PermissionDeniedError) as info:
        dev.set_power_limit(100.0)
    err = info.value
    assert err.vendor_code == "EACCES" and err.operation == "set_power_limit"
    assert "constraint_0_power_limit_uw" in str(err) and "CAP_SYS_ADMIN" in str(err)
    assert "monitoring only" not in str(err)  # enabled reads 1: not a BIOS lock
    assert dev.read_state().power_limit_w == 150.0
    assert read(intel_root, f"{RAPL}/intel-rapl:0/constraint_0_power_limit_uw") == "150000000"


def test_bios_locked_zone_says_so(tmp_path: Path) -> None:
    make_powercap_tree(tmp_path, packages=1, bios_locked=True)
    backend, kernel = open_sysfs(tmp_path)
    assert "intel-rapl:0" in kernel.bios_locked_zones
    dev = backend.devices()[0]
    with pytest.raises(PermissionDeniedError) as info:
        dev.set_power_limit(100.0)
    assert "BIOS" in str(info.value) and info.value.vendor_code == "EACCES"
    assert read(tmp_path, f"{RAPL}/intel-rapl:0/constraint_0_power_limit_uw") == "150000000"
    assert dev.read_state().power_limit_w == 150.0  # monitoring still works


def test_amd_zones_have_energy_but_no_limits(tmp_path: Path) -> None:
    make_powercap_tree(tmp_path, packages=2, vendor="amd")
    backend, kernel = open_sysfs(tmp_path)
    dev = backend.devices()[0]
    assert dev.info.vendor == "amd"
    assert dev.info.power_limit_range_w is None and dev.info.default_power_limit_w is None
    caps = dev.info.capabilities
    assert caps.has_energy_counter and not caps.can_set_power_limit
    assert not caps.can_reset_power_limit and not caps.can_lock_sm_clocks
    with pytest.raises(NotSupportedError):
        dev.set_power_limit(100.0)
    with pytest.raises(NotSupportedError):
        dev.reset_power_limit()
    state = dev.read_state()
    assert state.energy_j == pytest.approx(1.0) and state.power_limit_w is None
    assert state.memory_energy_j is None  # AMD has core subzones, no dram
    assert dev.details()["max_energy_range_j"] == pytest.approx(65_532.610987)
    assert kernel.writes == []


def test_unknown_max_power_means_no_range_and_no_reset(tmp_path: Path) -> None:
    make_powercap_tree(tmp_path, packages=1)
    (tmp_path / RAPL / "intel-rapl:0" / "constraint_0_max_power_uw").unlink()
    backend, _ = open_sysfs(tmp_path)
    dev = backend.devices()[0]
    assert dev.info.power_limit_range_w is None and dev.info.default_power_limit_w is None
    assert dev.info.capabilities.can_set_power_limit
    assert not dev.info.capabilities.can_reset_power_limit
    assert dev.set_power_limit(400.0) == 400.0
    with pytest.raises(InvalidArgumentError):
        dev.set_power_limit(0.0)


# -- clocks --------------------------------------------------------------------------------------


def test_pstate_without_frequency_table_gets_a_100_mhz_grid(tmp_path: Path) -> None:
    make_cpufreq_tree(tmp_path, packages=1, driver="intel_pstate", freqs_khz=(800_000, 3_450_000))
    assert not (tmp_path / CPUFREQ / "policy0" / "scaling_available_frequencies").exists()
    backend, _ = open_sysfs(tmp_path)
    (dev,) = backend.devices()
    freqs = dev.info.supported_sm_freqs_mhz
    assert freqs[:3] == (800.0, 900.0, 1000.0)
    assert freqs[-2:] == (3400.0, 3450.0)  # both ends included
    assert len(freqs) == 28
    assert dev.info.vendor == "intel"


def test_lock_write_order_raising_and_lowering(intel_root: Path) -> None:
    backend, kernel = open_sysfs(intel_root)
    dev = backend.devices()[0]
    policy = f"{CPUFREQ}/policy0"
    assert dev.lock_sm_clocks(1200.0, 1800.0) == (1200.0, 1800.0)
    kernel.writes.clear()
    # Raising above the current max (1800): max first, or the kernel rejects min > max.
    dev.lock_sm_clocks(2400.0, 3000.0)
    assert kernel.writes == [
        (f"{policy}/scaling_max_freq", "3000000"),
        (f"{policy}/scaling_min_freq", "2400000"),
    ]
    assert dev.read_state().locked_sm_freqs_mhz == (2400.0, 3000.0)
    kernel.writes.clear()
    # Lowering below the current min (2400): min first.
    dev.lock_sm_clocks(1200.0)
    assert kernel.writes == [
        (f"{policy}/scaling_min_freq", "1200000"),
        (f"{policy}/scaling_max_freq", "1200000"),
    ]
    state = dev.read_state()
    assert state.locked_sm_freqs_mhz == (1200.0, 1200.0)
    assert state.sm_freq_mhz == 1200.0  # the fake kernel moves the current clock into the window
    assert read(intel_root, f"{CPUFREQ}/policy2/scaling_max_freq") == "3000000"  # other package


def test_fake_kernel_rejects_a_bad_order(intel_root: Path) -> None:
    """The ordering test above would be vacuous if the fake accepted min > max."""
    kernel = FakeKernel(intel_root)
    kernel.write_text(f"{CPUFREQ}/policy0/scaling_max_freq", "1800000")
    with pytest.raises(InvalidArgumentError) as info:
        kernel.write_text(f"{CPUFREQ}/policy0/scaling_min_freq", "2400000")
    assert info.value.vendor_code == "EINVAL"
    kernel.write_text(f"{CPUFREQ}/policy0/scaling_max_freq", "9999999")  # clamped
    assert read(intel_root, f"{CPUFREQ}/policy0/scaling_max_freq") == "3000000"


def test_reset_restores_cpuinfo_bounds(intel_root: Path) -> None:
    backend, kernel = open_sysfs(intel_root)
    dev = backend.devices()[1]
    dev.lock_sm_clocks(1800.0, 2400.0)
    kernel.writes.clear()
    dev.reset_sm_clocks()
    policy = f"{CPUFREQ}/policy2"
    assert kernel.writes == [
        (f"{policy}/scaling_max_freq", "3000000"),
        (f"{policy}/scaling_min_freq", "1200000"),
    ]
    assert read(intel_root, f"{policy}/scaling_min_freq") == "1200000"
    assert dev.read_state().locked_sm_freqs_mhz is None
    dev.reset_sm_clocks()  # idempotent


def test_lock_snaps_and_rejects_out_of_range(intel_root: Path) -> None:
    backend, kernel = open_sysfs(intel_root)
    dev = backend.devices()[0]
    assert dev.lock_sm_clocks(1500.0, 2500.0) == (1200.0, 2400.0)
    kernel.writes.clear()
    with pytest.raises(InvalidArgumentError):
        dev.lock_sm_clocks(500.0, 1200.0)
    assert kernel.writes == []


def test_permission_denied_on_clock_write(intel_root: Path) -> None:
    backend, kernel = open_sysfs(intel_root)
    kernel.inject("*/scaling_m*_freq", "write", errno.EPERM)
    dev = backend.devices()[0]
    with pytest.raises(PermissionDeniedError) as info:
        dev.lock_sm_clocks(1800.0)
    assert info.value.vendor_code == "EPERM" and info.value.operation == "lock_sm_clocks"
    assert "scaling_min_freq" in str(info.value)


# -- SysfsIO and errno translation ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (errno.EACCES, PermissionDeniedError),
        (errno.EPERM, PermissionDeniedError),
        (errno.ENODATA, NotSupportedError),
        (errno.ENOSYS, NotSupportedError),
        (errno.EOPNOTSUPP, NotSupportedError),
        (errno.EINVAL, InvalidArgumentError),
        (errno.ERANGE, InvalidArgumentError),
        (errno.EIO, DeviceError),
        (errno.EBUSY, DeviceError),
        (errno.ENXIO, DeviceError),
    ],
)
@pytest.mark.parametrize("op", ["read", "write"])
def test_errno_translation(
    intel_root: Path, code: int, expected: type[PowerlibError], op: str
) -> None:
    kernel = FakeKernel(intel_root)
    kernel.inject("*intel-rapl:0/constraint_0_power_limit_uw", op, code)
    rel = "class/powercap/intel-rapl:0/constraint_0_power_limit_uw"
    with pytest.raises(expected) as info:
        if op == "read":
            kernel.read_int(rel)
        else:
            kernel.write_text(rel, "1000000")
    err = info.value
    assert isinstance(err, PowerlibError)
    assert err.vendor_code == errno.errorcode[code]
    assert isinstance(err.__cause__, OSError) and err.__cause__.errno == code
    assert rel in str(err)


def test_missing_file_is_not_supported(intel_root: Path) -> None:
    io = SysfsIO(intel_root)
    with pytest.raises(NotSupportedError) as info:
        io.read_text("class/powercap/intel-rapl:0/power_uw")
    assert info.value.vendor_code == "ENOENT"
    with pytest.raises(NotSupportedError):
        io.write_text("class/powercap/intel-rapl:0/constraint_5_power_limit_uw", "1")
    assert not (intel_root / RAPL / "intel-rapl:0" / "constraint_5_power_limit_uw").exists()
    assert io.listdir("class/nothing-here") == []


def test_read_only_sysfs_is_permission_denied(intel_root: Path) -> None:
    kernel = FakeKernel(intel_root)
    kernel.inject("*/scaling_max_freq", "write", errno.EROFS)
    with pytest.raises(PermissionDeniedError, match="read-only"):
        kernel.write_text(f"{CPUFREQ}/policy0/scaling_max_freq", "1800000")


def test_non_integer_file_is_a_device_error(intel_root: Path) -> None:
    (intel_root / RAPL / "intel-rapl:0" / "energy_uj").write_text("garbage\n")
    with pytest.raises(DeviceError, match="not an integer"):
        SysfsIO(intel_root).read_int("class/powercap/intel-rapl:0/energy_uj")


def test_fake_kernel_write_semantics(intel_root: Path) -> None:
    kernel = FakeKernel(intel_root)
    zone = "class/powercap/intel-rapl:0"
    kernel.write_text(f"{zone}/energy_uj", "0")  # accepted, ignored: RAPL cannot reset
    assert read(intel_root, f"{RAPL}/intel-rapl:0/energy_uj") == "1000000"
    with pytest.raises(InvalidArgumentError):
        kernel.write_text(f"{zone}/constraint_0_power_limit_uw", "lots")
    with pytest.raises(PermissionDeniedError):
        kernel.write_text(f"{zone}/name", "package-9")  # read-only attribute, even for root
    with pytest.raises(InvalidArgumentError):
        kernel.write_text(f"{CPUFREQ}/policy0/scaling_governor", "turbo")
    kernel.write_text(f"{CPUFREQ}/policy0/scaling_governor", "powersave")
    assert kernel.writes == [
        (f"{zone}/energy_uj", "0"),
        (f"{CPUFREQ}/policy0/scaling_governor", "powersave"),
    ]


def test_paths_escaping_the_root_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    make_powercap_tree(root, packages=1)
    secret = tmp_path / "secret"
    secret.write_text("42\n")
    os.symlink(secret, root / "class/powercap/intel-rapl:0/escape")
    io = SysfsIO(root)
    for rel in (
        "../secret",
        "/etc/hostname",
        "class/../../secret",
        "class/powercap/intel-rapl:0/escape",
    ):
        with pytest.raises(PowerlibError, match="outside|under the root"):
            io.read_text(rel)
    with pytest.raises(PermissionDeniedError):
        io.write_text("../secret", "0")
    with pytest.raises(PermissionDeniedError):
        io.listdir("..")
    assert secret.read_text() == "42\n"
    assert io.read_int("class/powercap/intel-rapl:0/energy_uj") == 1_000_000  # in-root links work


def test_backends_contain_no_sys_literal() -> None:
    """Every path is relative to the injected root; the only allowed mention is in prose."""
    for name in ("sysfs.py", "_sysfs_io.py", "_sysfs_topology.py"):
        source = (BACKENDS_DIR / name).read_text()
        assert '"/sys' not in source and "'/sys" not in source, name
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not node.value.lstrip().startswith("/sys"), (name, node.value)


# -- backend, probe, registry --------------------------------------------------------------------


def test_probe_on_empty_root(tmp_path: Path) -> None:
    result = SysfsBackend.probe(settings_for(tmp_path))
    assert (result.backend, result.is_available, result.num_devices) == ("sysfs", False, 0)
    assert result.reason == (
        f"no powercap zones under {tmp_path}/class/powercap and no cpufreq policies under "
        f"{tmp_path}/devices/system/cpu/cpufreq"
    )


def test_probe_on_populated_root(intel_root: Path) -> None:
    result = SysfsBackend.probe(settings_for(intel_root))
    assert result.is_available and result.num_devices == 2
    assert result.reason == (
        f"found 2 RAPL package zone(s) and 2 cpufreq policy(ies) under {intel_root}"
    )


def test_probe_never_raises(intel_root: Path) -> None:
    name = intel_root / RAPL / "intel-rapl:0" / "name"
    name.unlink()
    name.mkdir()  # reading it fails with EISDIR, which is no "absent feature"
    with pytest.raises(DeviceError):
        SysfsBackend(settings_for(intel_root))
    result = SysfsBackend.probe(settings_for(intel_root))
    assert not result.is_available and "EISDIR" in result.reason


def test_zone_linked_outside_the_root_is_skipped(intel_root: Path) -> None:
    (intel_root / "class/powercap/intel-rapl:0").unlink()
    os.symlink("/", intel_root / "class/powercap/intel-rapl:0")
    backend, _ = open_sysfs(intel_root)
    assert [d.device_id for d in backend.devices()] == ["cpufreq-package-0", "intel-rapl:1"]


def test_backend_on_empty_root_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailableError) as info:
        SysfsBackend(settings_for(tmp_path))
    message = str(info.value)
    assert str(tmp_path) in message and "POWERLIB_SYSFS_ROOT" in message
    assert "\n" not in message


def test_registry_opens_the_sysfs_backend(
    intel_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POWERLIB_BACKEND", "sysfs")
    monkeypatch.setenv("POWERLIB_SYSFS_ROOT", str(intel_root))
    monkeypatch.setenv("POWERLIB_STATE_DIR", str(intel_root / "state"))
    for settings in (settings_for(intel_root), Settings.from_env()):
        with open_backend(settings=settings) as backend:
            assert isinstance(backend, SysfsBackend)
            assert len(backend.devices()) == 2
    with powerlib.open_backend("sysfs", settings_for(intel_root)) as backend:
        assert backend.devices()[0].read_state().energy_j == pytest.approx(1.0)


@pytest.mark.parametrize(
    "code", [errno.EACCES, errno.ENOENT, errno.ENODATA, errno.EINVAL, errno.EIO, errno.EBUSY]
)
@pytest.mark.parametrize("op", ["read", "write"])
def test_only_powerlib_errors_escape(intel_root: Path, code: int, op: str) -> None:
    """Whatever errno any file returns, no OSError (or other vendor error) leaks out."""
    backend, kernel = open_sysfs(intel_root)
    kernel.inject("*", op, code)
    dev = backend.devices()[0]
    calls = [
        dev.read_state,
        dev.details,
        lambda: dev.lock_sm_clocks(1800.0, 2400.0),
        dev.reset_sm_clocks,
        lambda: dev.set_power_limit(100.0),
        dev.reset_power_limit,
    ]
    for call in calls:
        try:
            call()
        except PowerlibError as err:
            assert err.device == "intel-rapl:0"
            assert isinstance(err.__cause__, OSError)
    kernel.clear_injections()
    dev.read_state()
