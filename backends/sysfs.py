"""The eBPF-free Linux backend: CPU packages through powercap (RAPL) and cpufreq in sysfs.

Control is plain sysfs writes (powercap constraints, cpufreq policy limits): no BPF program, no
kernel module beyond the stock drivers, no vendor library. Every path is relative to
``Settings.sysfs_root`` and every file access goes through :class:`SysfsIO`, whose one translation
point turns ``OSError`` into powerlib errors.

Devices: one :class:`SysfsCpuPackage` per top-level RAPL zone named ``package-N`` (or
``package-N-die-D``, one device per die zone) under ``class/powercap`` (or, when only the real
directory was bind-mounted, ``devices/virtual/powercap/intel-rapl``), plus one per CPU package that
has cpufreq policies but no zone. Policies are grouped by the ``topology/physical_package_id`` of
their CPUs (package 0 when topology is missing). Zones are identified by their ``name`` file; zone
ids are hex. Devices are ordered by (package, die).

Inferences and choices, documented here once:

- Vendor: ``"intel"`` when the package zone has ``constraint_*`` files, else ``"amd"`` (Zen zones
  expose energy counters only). A cpufreq-only package takes the vendor of its pstate driver,
  else ``"unknown"``.
- Power: RAPL has no ``power_uw``; ``power_w`` is the energy delta between the last two reads
  divided by their interval when that interval is at least 10 ms, else ``None``. The counter is
  read once when the device is opened, so the first ``read_state`` after 10 ms has a value.
- Energy: ``energy_uj`` wraps at ``max_energy_range_uj``; a running total keeps ``energy_j``
  non-decreasing. A wrap is missed if reads are more than one wrap period apart, so a WARNING is
  logged once per counter when two reads are further apart than range / 500 W.
- An ``energy_uj`` the process may not read (root-only since Linux 5.10) clears
  ``has_energy_counter`` instead of failing every read.
- Power limit: the ``long_term`` constraint (PL1), selected by name. Its range is
  ``(constraint_min_power_uw or 1 W, constraint_max_power_uw)``; 1 W is a floor because 0 means
  "no limit" to some firmware. Without a max the range is ``None``. The default limit (what
  ``reset_power_limit`` restores) is ``constraint_max_power_uw``, RAPL's thermal spec power.
- Clocks: ``scaling_available_frequencies`` when the driver has a table; otherwise
  (``intel_pstate``, ``amd-pstate``) a 100 MHz grid from ``cpuinfo_min_freq`` to
  ``cpuinfo_max_freq``, both ends included. Locking writes the policy's min/max limits.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import ClassVar

from powerlib.backend import Backend, ProbeResult
from powerlib.backends._sysfs_io import SysfsIO, soft
from powerlib.backends._sysfs_topology import Policy, Zone, scan
from powerlib.config import Settings
from powerlib.device import Capabilities, Device, DeviceInfo, DeviceKind, PowerState
from powerlib.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    NotSupportedError,
    PermissionDeniedError,
    PowerlibError,
)
from powerlib.units import from_khz, from_uj, from_us, from_uw, to_khz, to_uw

__all__ = ["SysfsBackend", "SysfsCpuPackage"]

logger = logging.getLogger(__name__)

_SUBZONE_RE = re.compile(r"^intel-rapl:[0-9a-f]+:([0-9a-f]+)$")
_CONSTRAINT_NAME_RE = re.compile(r"^constraint_(\d+)_name$")
_PSTATE_VENDORS = {"intel_pstate": "intel", "intel_cpufreq": "intel", "amd-pstate": "amd"}

_MIN_POWER_LIMIT_W = 1.0
_GRID_STEP_MHZ = 100.0
_MIN_POWER_INTERVAL_S = 0.010
_WRAP_SAFE_POWER_W = 500.0


def _maybe(convert: Callable[[int], float], value: int | None) -> float | None:
    return None if value is None else convert(value)


class _EnergyCounter:
    """Running total of a wrapping µJ counter, plus the power between the last two updates."""

    def __init__(self, range_uj: int | None, label: str) -> None:
        self._range_uj = range_uj if range_uj and range_uj > 0 else None
        self._label = label
        self._lock = threading.Lock()
        self._prev: tuple[int, float] | None = None  # (raw µJ, monotonic s)
        self._total_uj = 0
        self._has_warned = False

    def update(self, raw_uj: int, now_s: float) -> tuple[float, float | None]:
        """Add a reading; return ``(energy_j, power_w)``, power ``None`` if under 10 ms apart."""
        with self._lock:
            if self._prev is None:
                self._prev, self._total_uj = (raw_uj, now_s), raw_uj
                return from_uj(self._total_uj), None
            prev_uj, prev_s = self._prev
            if raw_uj >= prev_uj or self._range_uj is None:
                delta_uj = max(raw_uj - prev_uj, 0)
            else:
                delta_uj = raw_uj + (self._range_uj - prev_uj)
            safe_s = from_uj(self._range_uj) / _WRAP_SAFE_POWER_W if self._range_uj else None
            if safe_s is not None and now_s - prev_s > safe_s and not self._has_warned:
                self._has_warned = True
                logger.warning(
                    "%s: %.1f s between energy reads exceeds the safe wrap period (%.1f s); a "
                    "counter wrap may have been missed - read state more often",
                    self._label,
                    now_s - prev_s,
                    safe_s,
                )
            self._total_uj += delta_uj
            self._prev = (raw_uj, now_s)
            interval_s = now_s - prev_s
            power_w = (
                from_uj(delta_uj) / interval_s if interval_s >= _MIN_POWER_INTERVAL_S else None
            )
            return from_uj(self._total_uj), power_w


class SysfsCpuPackage(Device):
    """One CPU package (or die): RAPL energy and PL1 limit, cpufreq clock limits.

    Args:
        io: File access under the sysfs root.
        index: Position in the backend's device list.
        package: Package number (from the zone name or CPU topology).
        zone: The package's RAPL zone, or ``None`` (clocks only).
        policies: The cpufreq policies of the package's CPUs.
        monotonic: Clock for power intervals and wrap detection (injectable for tests).
    """

    def __init__(
        self,
        io: SysfsIO,
        index: int,
        package: int,
        zone: Zone | None,
        policies: Sequence[Policy],
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._io, self._zone, self._policies, self._monotonic = io, zone, tuple(policies), monotonic
        self._package = package
        self._warned_files: set[str] = set()
        self._constraints: dict[str, int] = {}
        self._subzones: list[tuple[str, str]] = []  # (dir name, zone name)
        has_constraint_files = False
        if zone is not None:
            for entry in io.listdir(zone.rel):
                has_constraint_files |= entry.startswith("constraint_")
                if (match := _CONSTRAINT_NAME_RE.match(entry)) is not None:
                    name = soft(io.read_text, f"{zone.rel}/{entry}")
                    if name:
                        self._constraints.setdefault(name, int(match[1]))
                elif _SUBZONE_RE.match(entry):
                    self._subzones.append(
                        (entry, soft(io.read_text, f"{zone.rel}/{entry}/name") or "")
                    )
        dram = next((d for d, n in self._subzones if n == "dram"), None)
        self._dram_rel = f"{zone.rel}/{dram}" if zone is not None and dram is not None else None
        label = zone.dir_name if zone is not None else f"cpufreq-package-{package}"
        self._pkg_energy = self._open_counter(zone.rel if zone else None, label)
        self._dram_energy = self._open_counter(self._dram_rel, f"{label} dram")
        self._long_term = self._constraints.get("long_term")
        limit_range_w, default_w = self._limit_facts()
        if zone is not None:
            vendor = "intel" if has_constraint_files else "amd"
        else:
            driver = next((p.driver for p in self._policies if p.driver), "")
            vendor = _PSTATE_VENDORS.get(driver.removesuffix("-epp"), "unknown")
        freqs_mhz = self._supported_freqs_mhz()
        can_set = self._long_term is not None
        super().__init__(
            DeviceInfo(
                device_id=label,
                index=index,
                name=zone.name if zone is not None else f"package-{package}",
                vendor=vendor,
                kind=DeviceKind.CPU,
                backend="sysfs",
                supported_sm_freqs_mhz=freqs_mhz,
                power_limit_range_w=limit_range_w,
                default_power_limit_w=default_w,
                capabilities=Capabilities(
                    can_lock_sm_clocks=bool(self._policies and freqs_mhz),
                    can_set_power_limit=can_set,
                    can_reset_power_limit=can_set and default_w is not None,
                    has_energy_counter=self._pkg_energy is not None,
                    has_power_reading=self._pkg_energy is not None,
                    has_temperature=False,
                ),
            )
        )

    # -- construction helpers -------------------------------------------------------------------

    def _open_counter(self, zone_rel: str | None, label: str) -> _EnergyCounter | None:
        """A counter for ``zone_rel/energy_uj`` primed with one reading; ``None`` if unreadable."""
        if zone_rel is None or not self._io.exists(f"{zone_rel}/energy_uj"):
            return None
        counter = _EnergyCounter(soft(self._io.read_int, f"{zone_rel}/max_energy_range_uj"), label)
        try:
            counter.update(self._io.read_int(f"{zone_rel}/energy_uj"), self._monotonic())
        except (PermissionDeniedError, NotSupportedError) as err:
            logger.warning("%s: no energy counter: %s", label, err)
            return None
        except PowerlibError as err:  # transient (EIO, ...): keep the counter, prime later
            logger.debug("%s: could not prime the energy counter: %s", label, err)
        return counter

    def _limit_facts(self) -> tuple[tuple[float, float] | None, float | None]:
        """``(power_limit_range_w, default_power_limit_w)`` of the long_term constraint."""
        if self._zone is None or self._long_term is None:
            return None, None
        prefix = f"{self._zone.rel}/constraint_{self._long_term}"
        max_uw = soft(self._io.read_int, f"{prefix}_max_power_uw")
        if not max_uw:  # absent, or 0 = unknown
            return None, None
        min_uw = soft(self._io.read_int, f"{prefix}_min_power_uw")
        min_w = from_uw(min_uw) if min_uw else min(_MIN_POWER_LIMIT_W, from_uw(max_uw))
        return (min_w, from_uw(max_uw)), from_uw(max_uw)

    def _supported_freqs_mhz(self) -> tuple[float, ...]:
        table = {khz for p in self._policies for khz in p.table_khz}
        if table:
            return tuple(from_khz(khz) for khz in sorted(table))
        if not self._policies:
            return ()
        lo_mhz = from_khz(min(p.cpuinfo_min_khz for p in self._policies))
        hi_mhz = from_khz(max(p.cpuinfo_max_khz for p in self._policies))
        steps = int((hi_mhz - lo_mhz - 0.5) // _GRID_STEP_MHZ) + 1 if hi_mhz > lo_mhz else 0
        return tuple(lo_mhz + i * _GRID_STEP_MHZ for i in range(max(steps, 0))) + (hi_mhz,)

    # -- reads -----------------------------------------------------------------------------------

    def _read_opt(self, rel: str) -> int | None:
        """``read_int``, ``None`` when absent or denied (a denial is logged once per file)."""
        try:
            return self._io.read_int(rel)
        except NotSupportedError:
            return None
        except PermissionDeniedError as err:
            if rel not in self._warned_files:
                self._warned_files.add(rel)
                logger.warning("%s: %s", self.device_id, err)
            return None

    @contextmanager
    def _annotate(self, operation: str) -> Iterator[None]:
        """Add this device and the operation to any powerlib error raised inside."""
        try:
            yield
        except PowerlibError as err:
            err.device = err.device or self.device_id
            err.operation = operation
            raise

    def _read_state(self) -> PowerState:
        """Reads: ``energy_uj`` (package, dram), ``constraint_X_power_limit_uw``, ``scaling_*``."""
        with self._annotate("read_state"):
            now_s = self._monotonic()
            energy_j = power_w = memory_energy_j = power_limit_w = None
            if self._pkg_energy is not None and self._zone is not None:
                raw_uj = self._read_opt(f"{self._zone.rel}/energy_uj")
                if raw_uj is not None:
                    energy_j, power_w = self._pkg_energy.update(raw_uj, now_s)
            if self._dram_energy is not None and self._dram_rel is not None:
                raw_uj = self._read_opt(f"{self._dram_rel}/energy_uj")
                if raw_uj is not None:
                    memory_energy_j = self._dram_energy.update(raw_uj, now_s)[0]
            if self._zone is not None and self._long_term is not None:
                limit_uw = self._read_opt(
                    f"{self._zone.rel}/constraint_{self._long_term}_power_limit_uw"
                )
                power_limit_w = _maybe(from_uw, limit_uw)
            cur = [self._read_opt(f"{p.rel}/scaling_cur_freq") for p in self._policies]
            cur_khz = [c for c in cur if c is not None]
            return PowerState(
                device_id=self.device_id,
                timestamp_s=time.time(),
                power_w=power_w,
                energy_j=energy_j,
                sm_freq_mhz=from_khz(sum(cur_khz) / len(cur_khz)) if cur_khz else None,
                power_limit_w=power_limit_w,
                temperature_c=None,
                locked_sm_freqs_mhz=self._read_lock(),
                memory_energy_j=memory_energy_j,
            )

    def _read_lock(self) -> tuple[float, float] | None:
        mins_khz, maxs_khz, is_locked = [], [], False
        for p in self._policies:
            lo, hi = (
                self._read_opt(f"{p.rel}/scaling_min_freq"),
                self._read_opt(f"{p.rel}/scaling_max_freq"),
            )
            if lo is None or hi is None:
                continue
            mins_khz.append(lo)
            maxs_khz.append(hi)
            is_locked |= (lo, hi) != (p.cpuinfo_min_khz, p.cpuinfo_max_khz)
        return (from_khz(min(mins_khz)), from_khz(max(maxs_khz))) if is_locked else None

    def details(self) -> Mapping[str, object]:
        """Zone, constraints, subzones and cpufreq policies, as JSON-able values."""
        with self._annotate("details"):
            zone, io, read = self._zone, self._io, self._read_opt
            out: dict[str, object] = {"package": self._package}
            if zone is not None:
                enabled, range_uj = (
                    read(f"{zone.rel}/enabled"),
                    read(f"{zone.rel}/max_energy_range_uj"),
                )
                constraints = []
                for name, i in sorted(self._constraints.items(), key=lambda kv: kv[1]):
                    prefix = f"{zone.rel}/constraint_{i}"
                    constraints.append(
                        {
                            "index": i,
                            "name": name,
                            "power_limit_w": _maybe(from_uw, read(f"{prefix}_power_limit_uw")),
                            "time_window_s": _maybe(from_us, read(f"{prefix}_time_window_us")),
                            "max_power_w": _maybe(from_uw, read(f"{prefix}_max_power_uw")),
                        }
                    )
                out.update(
                    zone=zone.dir_name,
                    zone_name=zone.name,
                    enabled=None if enabled is None else bool(enabled),
                    max_energy_range_j=_maybe(from_uj, range_uj),
                    constraints=constraints,
                    subzones=[{"zone": d, "name": n} for d, n in self._subzones],
                )
            out["cpufreq_policies"] = [
                {
                    "policy": p.name,
                    "cpus": list(p.cpus),
                    "driver": p.driver,
                    "governor": soft(io.read_text, f"{p.rel}/scaling_governor"),
                    "min_mhz": _maybe(from_khz, self._read_opt(f"{p.rel}/scaling_min_freq")),
                    "max_mhz": _maybe(from_khz, self._read_opt(f"{p.rel}/scaling_max_freq")),
                    "cpuinfo_min_mhz": from_khz(p.cpuinfo_min_khz),
                    "cpuinfo_max_mhz": from_khz(p.cpuinfo_max_khz),
                }
                for p in self._policies
            ]
            return out

    # -- writes ----------------------------------------------------------------------------------

    def _lock_sm_clocks(self, min_mhz: float, max_mhz: float) -> None:
        """Writes: each policy's ``scaling_min_freq``/``scaling_max_freq``, in a valid order.

        The kernel rejects a min above the max, so the max goes first when the new min is above
        the current max, and the min goes first otherwise.
        """
        lo_khz, hi_khz = to_khz(min_mhz), to_khz(max_mhz)
        with self._annotate("lock_sm_clocks"):
            for p in self._policies:
                order = [("scaling_min_freq", lo_khz), ("scaling_max_freq", hi_khz)]
                if lo_khz > self._io.read_int(f"{p.rel}/scaling_max_freq"):
                    order.reverse()
                for attr, khz in order:
                    self._io.write_text(f"{p.rel}/{attr}", str(khz))

    def _reset_sm_clocks(self) -> None:
        """Writes: ``scaling_max_freq`` = ``cpuinfo_max_freq``, then the min likewise."""
        with self._annotate("reset_sm_clocks"):
            for p in self._policies:
                self._io.write_text(f"{p.rel}/scaling_max_freq", str(p.cpuinfo_max_khz))
                self._io.write_text(f"{p.rel}/scaling_min_freq", str(p.cpuinfo_min_khz))

    def _set_power_limit(self, power_limit_w: float) -> float:
        """Writes: ``constraint_X_power_limit_uw`` of ``long_term`` (µW), then ``enabled`` = 1."""
        assert self._zone is not None and self._long_term is not None  # capability checked
        if self.info.power_limit_range_w is None and power_limit_w < _MIN_POWER_LIMIT_W:
            raise InvalidArgumentError(
                f"power limit must be at least {_MIN_POWER_LIMIT_W:g} W, got {power_limit_w:g} W",
                device=self.device_id,
                operation="set_power_limit",
            )
        rel = f"{self._zone.rel}/constraint_{self._long_term}_power_limit_uw"
        enabled_rel = f"{self._zone.rel}/enabled"
        with self._annotate("set_power_limit"):
            try:
                self._io.write_text(rel, str(to_uw(power_limit_w)))
            except PermissionDeniedError as err:
                if self._read_opt(enabled_rel) != 0:
                    raise
                raise PermissionDeniedError(
                    f"cannot write {rel}: the RAPL power limit is locked by the BIOS (monitoring "
                    "only); unlock it in the firmware setup",
                    vendor_code=err.vendor_code,
                ) from err
            try:
                if self._io.read_int(enabled_rel) == 0:
                    self._io.write_text(enabled_rel, "1")
            except NotSupportedError:
                pass
            readback_uw = self._read_opt(rel)
        return from_uw(readback_uw) if readback_uw is not None else power_limit_w

    def _reset_power_limit(self) -> None:
        """Writes the default (``constraint_X_max_power_uw`` of ``long_term``) as the limit."""
        assert self.info.default_power_limit_w is not None  # capability checked
        self._set_power_limit(self.info.default_power_limit_w)


class SysfsBackend(Backend):
    """CPU packages through Linux powercap (RAPL) and cpufreq, by plain sysfs reads and writes.

    Args:
        settings: ``settings.sysfs_root`` is where sysfs is mounted.
        io: File access; defaults to ``SysfsIO(settings.sysfs_root)``. Tests pass a FakeKernel.
        monotonic: Clock for power intervals and wrap detection.

    Raises:
        BackendUnavailableError: No RAPL package zone and no cpufreq policy under the root.
    """

    name: ClassVar[str] = "sysfs"
    install_hint: ClassVar[str] = (
        "needs the Linux powercap (intel_rapl) and/or cpufreq drivers; in containers bind-mount "
        "the host's /sys/devices/virtual/powercap to <root>/devices/virtual/powercap and set "
        "POWERLIB_SYSFS_ROOT=<root>; energy_uj is root-only since Linux 5.10"
    )

    def __init__(
        self,
        settings: Settings,
        io: SysfsIO | None = None,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(settings)
        self._io = SysfsIO(settings.sysfs_root) if io is None else io
        topology = scan(self._io)
        if not topology.packages:
            raise BackendUnavailableError(
                f"sysfs backend unavailable: {topology.reason}; {self.install_hint}"
            )
        devices = []
        for index, key in enumerate(topology.packages):
            zone = next((z for z in topology.zones if (z.package, z.die) == key), None)
            mine = [p for p in topology.policies if (p.package, p.die) == key]
            devices.append(SysfsCpuPackage(self._io, index, key[0], zone, mine, monotonic))
        self._devices: tuple[SysfsCpuPackage, ...] = tuple(devices)
        logger.info("sysfs backend: %s", topology.reason)

    @classmethod
    def probe(cls, settings: Settings) -> ProbeResult:
        """Look for RAPL package zones and cpufreq policies; never raises."""
        try:
            topology = scan(SysfsIO(settings.sysfs_root))
        except Exception as err:  # noqa: BLE001 - probe must never raise
            reason = f"cannot scan {settings.sysfs_root}: {err}"
            return ProbeResult(backend=cls.name, is_available=False, reason=reason)
        return ProbeResult(
            backend=cls.name,
            is_available=bool(topology.packages),
            reason=topology.reason,
            num_devices=len(topology.packages),
        )

    def devices(self) -> Sequence[SysfsCpuPackage]:
        """One device per CPU package (or die zone), ordered by package number."""
        return self._devices
