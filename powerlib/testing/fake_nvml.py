"""A fake ``pynvml`` module for tests: a few modelled GPUs, real NVML error types.

It implements the subset of NVML that :mod:`powerlib.backends.nvidia` calls, with the same function
and parameter names as NVIDIA's ``nvidia-ml-py`` (a parity test in powerlib's suite checks this with
``inspect``), and it raises the *real* ``pynvml.NVMLError`` subclasses from the installed
nvidia-ml-py, so the backend's error translation is exercised for real. nvidia-ml-py imports
without a GPU or driver; it is in powerlib's ``test`` extra.

Usage::

    fake = FakeNvml([A100_SXM4_40GB, H100_SXM5_80GB])
    backend = NvidiaBackend(settings, nvml=fake)     # or sys.modules["pynvml"] = fake
    fake.fail("nvmlDeviceSetGpuLockedClocks", fake.NVML_ERROR_NO_PERMISSION)
    fake.advance(1.0)                                # one second at each GPU's modelled power

Per-GPU state a test may set on ``fake.gpus[i]``: ``busy`` (under load: the SM clock runs at the
lock's maximum or the top clock, else at the lock's minimum or the bottom one), ``ignores_lock``
(clock-lock setters answer success and change nothing), ``ignores_power_limit`` (likewise for the
power limit), ``mig_mode`` / ``mig_mode_pending`` (what ``nvmlDeviceGetMigMode`` reports; GPUs
before Ampere answer NOT_SUPPORTED). A busy GPU whose modelled power at its target clock exceeds
the power limit runs at the highest supported clock that fits under it, with the ``sw_power_cap``
clock-event reason (0x4) set, so that several locks near the top run at one clock, as on a real
GPU at its power cap.

NVIDIA's newer controls, per GPU (absent by default, as on a GPU before Blackwell):
``power_smoothing`` (``None``: no power smoothing; else True/False, with ``power_floor_w``, the
applied floor a busy GPU's power does not go below, and ``smoothing_preset``, read through
field values), ``workload_profiles`` (``None``: no workload power profiles; else the profile ids
in force, read through ``nvmlDeviceWorkloadPowerProfileGetCurrentProfiles``), and
``facility_limit_mw`` (a limit set out of band, by a facility or BMC: the enforced limit is the
lower of it and the management limit). ``fake.cuda14 = True`` makes the calls CUDA 14 removes
(:data:`powerlib.backends._nvml_api.DEPRECATED_CALLS`) raise ``NVML_ERROR_DEPRECATED``.

Modelled GPUs are approximations built from public figures (see docs/peers.md §4.1), not
recordings of real devices.
"""

from __future__ import annotations

import fnmatch
import importlib
import types
from dataclasses import dataclass, field
from typing import Any

from powerlib.backends._nvml_api import DEPRECATED_CALLS

__all__ = ["A100_SXM4_40GB", "H100_SXM5_80GB", "V100_SXM2_16GB", "FakeGpuSpec", "FakeNvml"]


def _real_pynvml() -> types.ModuleType:
    # nvidia-ml-py is a test dependency, imported when a fake is made; it has no type information
    return importlib.import_module("pynvml")


@dataclass(frozen=True, kw_only=True)
class FakeGpuSpec:
    """One modelled GPU model. Powers in mW, clocks in MHz, as NVML reports them."""

    name: str
    architecture: int
    mem_clocks_mhz: tuple[int, ...]
    gfx_clocks_mhz: tuple[int, ...]
    power_limit_range_mw: tuple[int, int]
    default_power_limit_mw: int
    idle_power_mw: int
    busy_power_per_mhz_mw: float  # power above idle per MHz of SM clock while "busy"
    has_energy_counter: bool = True
    has_instant_power_field: bool = True
    persistence_mode: int = 1


def _clocks(lo: int, hi: int, step: int) -> tuple[int, ...]:
    return tuple(range(hi, lo - 1, -step))  # NVML lists them high to low


A100_SXM4_40GB = FakeGpuSpec(
    name="NVIDIA A100-SXM4-40GB",
    architecture=7,  # Ampere
    mem_clocks_mhz=(1215,),
    gfx_clocks_mhz=_clocks(210, 1410, 15),
    power_limit_range_mw=(100_000, 400_000),
    default_power_limit_mw=400_000,
    idle_power_mw=57_000,
    busy_power_per_mhz_mw=200.0,
    has_instant_power_field=False,  # GA100's power usage is already instantaneous
)
H100_SXM5_80GB = FakeGpuSpec(
    name="NVIDIA H100 80GB HBM3",
    architecture=9,  # Hopper
    mem_clocks_mhz=(2619, 1593),
    gfx_clocks_mhz=_clocks(345, 1980, 15),
    power_limit_range_mw=(200_000, 700_000),
    default_power_limit_mw=700_000,
    idle_power_mw=73_000,
    busy_power_per_mhz_mw=300.0,
)
V100_SXM2_16GB = FakeGpuSpec(
    name="Tesla V100-SXM2-16GB",
    architecture=5,  # Volta: SM clock locks, no memory clock locks
    mem_clocks_mhz=(877,),
    gfx_clocks_mhz=_clocks(135, 1530, 7),
    power_limit_range_mw=(150_000, 300_000),
    default_power_limit_mw=300_000,
    idle_power_mw=40_000,
    busy_power_per_mhz_mw=150.0,
    has_energy_counter=False,  # exercises the power-integration fallback
    has_instant_power_field=False,
    persistence_mode=0,
)


@dataclass
class _Gpu:
    spec: FakeGpuSpec
    uuid: str
    bus_id: str
    power_limit_mw: int
    locked_mhz: tuple[int, int] | None = None
    mem_locked_mhz: tuple[int, int] | None = None
    energy_mj: float = 0.0
    busy: bool = False
    ignores_power_limit: bool = False  # models a setter that reports success but does nothing
    ignores_lock: bool = False  # likewise for nvmlDevice{Set,Reset}GpuLockedClocks
    app_clock_mhz: int | None = None  # legacy application clocks (None: the default); tests set it
    minor: int = 0  # /dev/nvidia<minor>; tests may make it differ from the PCI order
    mig_mode: int = 0  # NVML_DEVICE_MIG_DISABLE / _ENABLE (Ampere and newer only)
    mig_mode_pending: int | None = None  # None: the same as mig_mode (no change pending)
    power_smoothing: bool | None = None  # None: the GPU has no power smoothing (pre-Blackwell)
    power_floor_w: float = 0.0  # the applied floor while smoothing is on
    smoothing_preset: int = 0
    workload_profiles: tuple[int, ...] | None = None  # None: no workload power profiles
    facility_limit_mw: int | None = None  # an out-of-band limit (facility, BMC), else None

    def enforced_limit_mw(self) -> int:
        """The limit the GPU holds: the management limit, or a lower out-of-band one."""
        if self.facility_limit_mw is None:
            return self.power_limit_mw
        return min(self.power_limit_mw, self.facility_limit_mw)

    def _busy_power_mw(self, clock_mhz: int) -> float:
        return self.spec.idle_power_mw + self.spec.busy_power_per_mhz_mw * clock_mhz

    def _target_mhz(self) -> int:
        if self.locked_mhz is not None:
            return self.locked_mhz[1] if self.busy else self.locked_mhz[0]
        return max(self.spec.gfx_clocks_mhz) if self.busy else min(self.spec.gfx_clocks_mhz)

    def is_power_capped(self) -> bool:
        """Busy, and the target clock would draw more than the power limit."""
        return self.busy and self._busy_power_mw(self._target_mhz()) > self.enforced_limit_mw()

    def sm_clock_mhz(self) -> int:
        target = self._target_mhz()
        if not self.is_power_capped():
            return target
        fitting = [
            c
            for c in self.spec.gfx_clocks_mhz
            if c <= target and self._busy_power_mw(c) <= self.enforced_limit_mw()
        ]
        return max(fitting) if fitting else min(self.spec.gfx_clocks_mhz)

    def power_mw(self) -> float:
        limit_mw = float(self.enforced_limit_mw())
        if not self.busy:
            return min(float(self.spec.idle_power_mw), limit_mw)
        power_mw = min(self._busy_power_mw(self.sm_clock_mhz()), limit_mw)
        if self.power_smoothing:  # the floor holds a busy GPU's power up (slack included)
            power_mw = max(power_mw, min(self.power_floor_w * 1000.0, limit_mw))
        return power_mw


@dataclass
class _Fault:
    pattern: str
    code: int
    device: int | None
    times: int | None


@dataclass(frozen=True)
class _Handle:
    index: int


@dataclass
class _FieldValue:
    fieldId: int  # NVML struct field names
    nvmlReturn: int
    value: types.SimpleNamespace = field(default_factory=types.SimpleNamespace)
    valueType: int = 1  # NVML_VALUE_TYPE_UNSIGNED_INT


class FakeNvml(types.ModuleType):
    """A module-like fake of ``pynvml``; put it in ``sys.modules["pynvml"]`` or pass it directly."""

    def __init__(self, specs: list[FakeGpuSpec] | None = None) -> None:
        super().__init__("pynvml")
        real = _real_pynvml()
        for name in dir(real):  # constants and error classes come from the real binding
            if name.startswith(("NVML_", "NVMLError", "c_nvmlWorkloadPowerProfile")):
                setattr(self, name, getattr(real, name))
        self._nvmlGetFunctionPointer = object()  # passes powerlib's official-binding check
        specs = [A100_SXM4_40GB, A100_SXM4_40GB] if specs is None else specs
        self.gpus = [
            _Gpu(
                spec=s,
                uuid=f"GPU-{i:08x}-fake-4e0d-9c2a-{0xA1000 + i:012x}",
                bus_id=f"00000000:{0x10 + i:02X}:00.0",
                power_limit_mw=s.default_power_limit_mw,
                minor=i,
            )
            for i, s in enumerate(specs)
        ]
        self.init_count = 0
        self.calls: list[str] = []
        self._faults: list[_Fault] = []
        self.init_error: int | None = None
        self.driver_version = "550.54.15"  # what nvmlSystemGetDriverVersion reports
        self.nvml_version = "12.550.54.15"  # what nvmlSystemGetNVMLVersion reports
        self.cuda14 = False  # True: DEPRECATED_CALLS raise NVML_ERROR_DEPRECATED (CUDA 14)

    # -- test controls ---------------------------------------------------------------------------

    def fail(
        self, pattern: str, code: int, device: int | None = None, times: int | None = None
    ) -> None:
        """Make calls whose name matches ``pattern`` (fnmatch) raise ``NVMLError(code)``."""
        self._faults.append(_Fault(pattern, code, device, times))

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass: every GPU's energy counter grows at its modelled power."""
        for gpu in self.gpus:
            gpu.energy_mj += gpu.power_mw() * seconds

    def _enter(self, name: str, handle: _Handle | None = None) -> _Gpu | None:
        self.calls.append(name)
        if self.init_count <= 0 and name not in ("nvmlInit", "nvmlErrorString"):
            raise self.NVMLError(self.NVML_ERROR_UNINITIALIZED)
        if self.cuda14 and name in DEPRECATED_CALLS:
            raise self.NVMLError(self.NVML_ERROR_DEPRECATED)
        for fault in list(self._faults):
            if fnmatch.fnmatch(name, fault.pattern) and (
                fault.device is None or (handle is not None and handle.index == fault.device)
            ):
                if fault.times is not None:
                    fault.times -= 1
                    if fault.times <= 0:
                        self._faults.remove(fault)
                raise self.NVMLError(fault.code)
        if handle is None:
            return None
        if not isinstance(handle, _Handle) or not 0 <= handle.index < len(self.gpus):
            raise self.NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[handle.index]

    def _gpu(self, name: str, handle: _Handle) -> _Gpu:
        gpu = self._enter(name, handle)
        assert gpu is not None
        return gpu

    # -- lifecycle and identity ------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_error is not None:
            raise self.NVMLError(self.init_error)
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.init_count -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._enter("nvmlSystemGetNVMLVersion")
        return self.nvml_version

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise self.NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return self._gpu("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetMinorNumber(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetMinorNumber", handle).minor

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return self._gpu("nvmlDeviceGetName", handle).spec.name

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> types.SimpleNamespace:
        gpu = self._gpu("nvmlDeviceGetPciInfo", handle)
        return types.SimpleNamespace(busId=gpu.bus_id.encode())

    def nvmlDeviceGetArchitecture(self, device: _Handle) -> int:
        return self._gpu("nvmlDeviceGetArchitecture", device).spec.architecture

    def nvmlDeviceGetPersistenceMode(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetPersistenceMode", handle).spec.persistence_mode

    # -- clocks ----------------------------------------------------------------------------------

    def nvmlDeviceGetSupportedMemoryClocks(self, handle: _Handle) -> list[int]:
        return list(self._gpu("nvmlDeviceGetSupportedMemoryClocks", handle).spec.mem_clocks_mhz)

    def nvmlDeviceGetSupportedGraphicsClocks(
        self, handle: _Handle, memoryClockMHz: int
    ) -> list[int]:
        gpu = self._gpu("nvmlDeviceGetSupportedGraphicsClocks", handle)
        if memoryClockMHz not in gpu.spec.mem_clocks_mhz:
            raise self.NVMLError(self.NVML_ERROR_NOT_FOUND)
        return list(gpu.spec.gfx_clocks_mhz)

    def nvmlDeviceSetGpuLockedClocks(
        self, handle: _Handle, minGpuClockMHz: int, maxGpuClockMHz: int
    ) -> None:
        gpu = self._gpu("nvmlDeviceSetGpuLockedClocks", handle)
        if gpu.spec.architecture < 5:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        if minGpuClockMHz > maxGpuClockMHz:
            raise self.NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
        if not gpu.ignores_lock:
            gpu.locked_mhz = (minGpuClockMHz, maxGpuClockMHz)

    def nvmlDeviceResetGpuLockedClocks(self, handle: _Handle) -> None:
        gpu = self._gpu("nvmlDeviceResetGpuLockedClocks", handle)
        if not gpu.ignores_lock:
            gpu.locked_mhz = None

    def nvmlDeviceSetMemoryLockedClocks(
        self, handle: _Handle, minMemClockMHz: int, maxMemClockMHz: int
    ) -> None:
        gpu = self._gpu("nvmlDeviceSetMemoryLockedClocks", handle)
        if gpu.spec.architecture < 7:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        gpu.mem_locked_mhz = (minMemClockMHz, maxMemClockMHz)

    def nvmlDeviceResetMemoryLockedClocks(self, handle: _Handle) -> None:
        gpu = self._gpu("nvmlDeviceResetMemoryLockedClocks", handle)
        if gpu.spec.architecture < 7:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        gpu.mem_locked_mhz = None

    def nvmlDeviceGetClockInfo(self, handle: _Handle, type: int) -> int:
        gpu = self._gpu("nvmlDeviceGetClockInfo", handle)
        if type == self.NVML_CLOCK_MEM:
            return gpu.mem_locked_mhz[1] if gpu.mem_locked_mhz else max(gpu.spec.mem_clocks_mhz)
        return gpu.sm_clock_mhz()

    def nvmlDeviceGetApplicationsClock(self, handle: _Handle, type: int) -> int:
        gpu = self._gpu("nvmlDeviceGetApplicationsClock", handle)
        if type != self.NVML_CLOCK_SM and type != self.NVML_CLOCK_GRAPHICS:
            return max(gpu.spec.mem_clocks_mhz)
        return gpu.app_clock_mhz if gpu.app_clock_mhz is not None else max(gpu.spec.gfx_clocks_mhz)

    def nvmlDeviceGetDefaultApplicationsClock(self, handle: _Handle, type: int) -> int:
        gpu = self._gpu("nvmlDeviceGetDefaultApplicationsClock", handle)
        if type != self.NVML_CLOCK_SM and type != self.NVML_CLOCK_GRAPHICS:
            return max(gpu.spec.mem_clocks_mhz)
        return max(gpu.spec.gfx_clocks_mhz)

    def nvmlDeviceSetApplicationsClocks(
        self, handle: _Handle, maxMemClockMHz: int, maxGraphicsClockMHz: int
    ) -> None:
        gpu = self._gpu("nvmlDeviceSetApplicationsClocks", handle)
        if maxGraphicsClockMHz not in gpu.spec.gfx_clocks_mhz:
            raise self.NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
        gpu.app_clock_mhz = maxGraphicsClockMHz

    def nvmlDeviceResetApplicationsClocks(self, handle: _Handle) -> None:
        self._gpu("nvmlDeviceResetApplicationsClocks", handle).app_clock_mhz = None

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        return self._reasons(handle)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetCurrentClocksEventReasons", handle)
        return self._reasons(handle)

    def _reasons(self, handle: _Handle) -> int:
        gpu = self.gpus[handle.index]
        return (
            (0x2 if gpu.locked_mhz or gpu.app_clock_mhz is not None else 0)
            | (0 if gpu.busy else 0x1)
            | (0x4 if gpu.is_power_capped() else 0)
        )

    def nvmlDeviceGetMigMode(self, device: _Handle) -> list[int]:
        gpu = self._gpu("nvmlDeviceGetMigMode", device)
        if gpu.spec.architecture < 7:  # MIG arrived with Ampere
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        pending = gpu.mig_mode if gpu.mig_mode_pending is None else gpu.mig_mode_pending
        return [gpu.mig_mode, pending]

    # -- power and energy ------------------------------------------------------------------------

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: _Handle) -> list[int]:
        return list(
            self._gpu(
                "nvmlDeviceGetPowerManagementLimitConstraints", handle
            ).spec.power_limit_range_mw
        )

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: _Handle) -> int:
        return self._gpu(
            "nvmlDeviceGetPowerManagementDefaultLimit", handle
        ).spec.default_power_limit_mw

    def nvmlDeviceGetPowerManagementLimit(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetPowerManagementLimit", handle).power_limit_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetEnforcedPowerLimit", handle).enforced_limit_mw()

    def nvmlDeviceSetPowerManagementLimit(self, handle: _Handle, limit: int) -> None:
        gpu = self._gpu("nvmlDeviceSetPowerManagementLimit", handle)
        lo, hi = gpu.spec.power_limit_range_mw
        if not lo <= limit <= hi:
            raise self.NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
        if not gpu.ignores_power_limit:
            gpu.power_limit_mw = int(limit)

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        return int(self._gpu("nvmlDeviceGetPowerUsage", handle).power_mw())

    def nvmlDeviceGetFieldValues(self, handle: _Handle, fieldIds: list[Any]) -> list[_FieldValue]:
        gpu = self._gpu("nvmlDeviceGetFieldValues", handle)
        out = []
        smoothing = {  # field ids of the installed binding (older ones lack them)
            getattr(self, f"NVML_FI_PWR_SMOOTHING_{name}", -1): value
            for name, value in (
                ("ENABLED", float(bool(gpu.power_smoothing))),
                ("APPLIED_TMP_FLOOR", gpu.power_floor_w),
                ("ACTIVE_PRESET_PROFILE", float(gpu.smoothing_preset)),
            )
        }
        for fid in fieldIds:
            fid = fid[0] if isinstance(fid, tuple) else fid
            if fid == self.NVML_FI_DEV_POWER_INSTANT and gpu.spec.has_instant_power_field:
                out.append(_FieldValue(fid, 0, types.SimpleNamespace(uiVal=int(gpu.power_mw()))))
            elif fid in smoothing and gpu.power_smoothing is not None:
                value = types.SimpleNamespace(dVal=float(smoothing[fid]))
                out.append(_FieldValue(fid, 0, value, self.NVML_VALUE_TYPE_DOUBLE))
            else:
                out.append(_FieldValue(fid, self.NVML_ERROR_NOT_SUPPORTED))
        return out

    def nvmlDeviceWorkloadPowerProfileGetCurrentProfiles(
        self, device: _Handle, currentProfiles: Any
    ) -> int:
        gpu = self._gpu("nvmlDeviceWorkloadPowerProfileGetCurrentProfiles", device)
        if gpu.workload_profiles is None:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        current = getattr(currentProfiles, "_obj", currentProfiles)  # ctypes.byref(struct)
        for bit in gpu.workload_profiles:
            current.enforcedProfilesMask.mask[bit // 32] |= 1 << (bit % 32)
            current.requestedProfilesMask.mask[bit // 32] |= 1 << (bit % 32)
        return int(self.NVML_SUCCESS)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: _Handle) -> int:
        gpu = self._gpu("nvmlDeviceGetTotalEnergyConsumption", handle)
        if not gpu.spec.has_energy_counter:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return int(gpu.energy_mj)

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        gpu = self._gpu("nvmlDeviceGetTemperature", handle)
        return 30 + int(gpu.power_mw() / 10_000)

    def nvmlDeviceGetTemperatureV(self, handle: _Handle, sensor: int, version: int = 0) -> int:
        gpu = self._gpu("nvmlDeviceGetTemperatureV", handle)
        return 30 + int(gpu.power_mw() / 10_000)
