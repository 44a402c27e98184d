"""NVIDIA GPUs through NVML (the ``pynvml`` module of ``nvidia-ml-py``, extra ``nvidia``).

The binding is imported lazily and never from the deprecated ``pynvml`` shim distribution. Every
NVML call goes through :func:`powerlib.backends._nvml_api.call`, the one place where
``pynvml.NVMLError`` becomes a powerlib error (the NVML code is kept as ``vendor_code``).

Device order is CUDA's, so that ``--device 0`` (and a framework's ``cuda:0``) is the same GPU:

* NVML enumerates in PCI bus order. CUDA does the same when ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, and
  under the default ``FASTEST_FIRST`` on nodes whose GPUs are all the same model (ties are broken
  by PCI bus id). On a mixed node with ``FASTEST_FIRST`` the two orders can differ; powerlib then
  warns once and uses PCI order — set ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or list UUIDs.
* ``CUDA_VISIBLE_DEVICES`` is then applied: ordinals, ``GPU-`` UUIDs or unique UUID prefixes; empty
  means no GPU; ``MIG-`` entries are refused (clocks and limits are per physical GPU).

Units at this edge: NVML power and limits are mW, energy mJ, clocks MHz; inside powerlib W, J, MHz.

Privileges: every setter needs root, and in a container also ``CAP_SYS_ADMIN``. Locked clocks and
power limits vanish when the driver unloads; without persistence mode that happens whenever no
process holds the GPU, so powerlib warns when it changes a GPU whose persistence mode is off.
NVML cannot read back a locked clock range: ``PowerState.locked_sm_freqs_mhz`` reports what this
process set. :meth:`NvidiaDevice.read_sm_lock` asks the driver instead (docs/real-gpu.md §1): the
clock-event reason "applications clocks setting" (also set by locked clocks, whoever set them)
means a lock is in force; its absence proves nothing, so NVML never reports "not locked". The
same reasons tell why a loaded GPU runs below its lock (``sw_power_cap``: at the top clocks the
power cap makes several locks run at one clock).

Transient codes (``TIMEOUT``, ``IN_USE``, ``NOT_READY``) become ``TransientDeviceError``, which
the device layer retries a bounded number of times (docs/real-gpu.md §2); they say nothing about
another controller owning the GPU.

Newer controls (docs/real-gpu.md §8): current calls first, names CUDA 13 deprecates only where
they are absent (application clocks only before NVML 13); ``DEPRECATED`` (CUDA 14) is "absent".
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from powerlib.backend import Backend, ProbeResult
from powerlib.backends import _nvml_api as api
from powerlib.backends._power_limit import write_power_limit
from powerlib.backends._visible import select_visible
from powerlib.config import Settings
from powerlib.device import Capabilities, ClockLockState, Device, DeviceInfo, DeviceKind, PowerState
from powerlib.errors import (
    InvalidArgumentError,
    NotSupportedError,
    PermissionDeniedError,
    PowerlibError,
)
from powerlib.gpu_specs import power_sampling_duty
from powerlib.privilege import admin_refusal
from powerlib.units import from_mj, from_mw, to_mw

__all__ = ["NvidiaBackend", "NvidiaDevice"]

logger = logging.getLogger(__name__)

_PROC_STATUS_PATH = Path("/proc/self/status")  # where control_refusal reads CapEff (tests move it)

# Current name first; the deprecated one (api.DEPRECATED_CALLS) only where the current is absent.
_TEMPERATURE_CALLS = ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature")
_REASON_CALLS = (
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
)
# Power smoothing field ids (nvml.h): enablement, the applied floor, the active preset profile.
_SMOOTHING_FIELDS = (
    "NVML_FI_PWR_SMOOTHING_ENABLED",
    "NVML_FI_PWR_SMOOTHING_APPLIED_TMP_FLOOR",
    "NVML_FI_PWR_SMOOTHING_ACTIVE_PRESET_PROFILE",
)


class NvidiaDevice(Device):
    """One NVIDIA GPU. Static facts are read once, when the backend opens.

    Args:
        nvml: The pynvml module (or a fake with the same API).
        handle: NVML device handle.
        index: CUDA-order index among the visible GPUs.
        monotonic: Clock for the power-integration fallback (injectable for tests).
        nvml_major: The NVML major version (13 and newer: no deprecated application-clock reads);
            ``None``: unknown, read as older.
    """

    def __init__(
        self,
        nvml: Any,
        handle: Any,
        index: int,
        monotonic: Callable[[], float] = time.monotonic,
        nvml_major: int | None = None,
    ) -> None:
        self._nvml, self._handle, self._monotonic = nvml, handle, monotonic
        self._chosen: dict[str, str] = {}  # per read, the call name that answered (see _read_first)
        self._reads_app_clocks = nvml_major is None or nvml_major < 13
        uuid = api.text(api.call(nvml, nvml.nvmlDeviceGetUUID, handle))
        name = api.text(api.call(nvml, nvml.nvmlDeviceGetName, handle))
        self._arch = self._optional(nvml.nvmlDeviceGetArchitecture, handle)
        mem_mhz = sorted(set(self._optional(nvml.nvmlDeviceGetSupportedMemoryClocks, handle) or []))
        gfx_mhz: list[int] = []
        if mem_mhz:
            gfx_mhz = sorted(
                set(
                    self._optional(nvml.nvmlDeviceGetSupportedGraphicsClocks, handle, mem_mhz[-1])
                    or []
                )
            )
        self._max_mem_mhz = mem_mhz[-1] if mem_mhz else None
        limits_mw = self._optional(nvml.nvmlDeviceGetPowerManagementLimitConstraints, handle)
        default_mw = self._optional(nvml.nvmlDeviceGetPowerManagementDefaultLimit, handle)
        self._has_counter = (
            self._optional(nvml.nvmlDeviceGetTotalEnergyConsumption, handle) is not None
        )
        self._power_source = self._detect_power_source()
        has_temp = self._read_temperature_c() is not None
        self._persistence = self._optional(nvml.nvmlDeviceGetPersistenceMode, handle)
        is_volta_plus = self._arch is not None and self._arch >= api.ARCH_VOLTA
        is_ampere_plus = self._arch is not None and self._arch >= api.ARCH_AMPERE
        range_w = None if limits_mw is None else (from_mw(limits_mw[0]), from_mw(limits_mw[1]))
        default_w = None if default_mw is None or range_w is None else from_mw(default_mw)
        super().__init__(
            DeviceInfo(
                device_id=uuid,
                index=index,
                name=name,
                vendor="nvidia",
                kind=DeviceKind.GPU,
                backend="nvidia",
                supported_sm_freqs_mhz=tuple(float(f) for f in gfx_mhz) if is_volta_plus else (),
                supported_mem_freqs_mhz=tuple(float(f) for f in mem_mhz) if is_ampere_plus else (),
                power_limit_range_w=range_w,
                default_power_limit_w=default_w,
                capabilities=Capabilities(
                    can_lock_sm_clocks=is_volta_plus and bool(gfx_mhz),
                    can_lock_memory_clocks=is_ampere_plus and bool(mem_mhz),
                    can_set_power_limit=range_w is not None,
                    can_reset_power_limit=default_w is not None,
                    has_energy_counter=self._has_counter,
                    has_power_reading=self._power_source is not None,
                    has_temperature=has_temp,
                ),
                # A100/H100 sample power 25 % of each counter period (docs/peers.md §4.2)
                power_sampling_duty=power_sampling_duty(name),
            )
        )
        self._locked_sm: tuple[float, float] | None = None
        self._lock = threading.Lock()
        self._integrated: tuple[float, float, float] | None = None  # (t_s, power_w, energy_j)
        self._warned: set[str] = set()
        if not self._has_counter and self._power_source is not None:
            logger.warning(
                "%s (%s) has no energy counter (pre-Volta or unsupported): energy_j is integrated "
                "from power readings taken at each read_state, so read it often",
                name,
                uuid,
            )

    # -- helpers -------------------------------------------------------------------------------

    def _optional(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn``; ``None`` when the GPU or driver does not support it."""
        info = getattr(self, "_info", None)  # absent while the constructor reads static facts
        try:
            return api.call(self._nvml, fn, *args, device=None if info is None else info.device_id)
        except NotSupportedError:
            return None

    def _read_first(self, key: str, names: Sequence[str], *args: Any) -> Any:
        """The first of ``names`` (current first) the binding has and the driver answers, or None.

        No attribute, ``NOT_SUPPORTED``, ``FUNCTION_NOT_FOUND`` or ``DEPRECATED``: the next name.
        The name that answered is kept under ``key`` (no fallback where the current one works).
        """
        chosen = self._chosen.get(key)
        for name in names if chosen is None else (chosen,):
            fn = getattr(self._nvml, name, None)
            value = None if fn is None else self._optional(fn, self._handle, *args)
            if value is not None:
                self._chosen[key] = name
                return value
        return None

    def _call(self, fn: Callable[..., Any], *args: Any, operation: str) -> Any:
        return api.call(self._nvml, fn, *args, device=self.device_id, operation=operation)

    def _detect_power_source(self) -> str | None:
        if self._read_instant_power_mw() is not None:
            return "instant"
        if self._optional(self._nvml.nvmlDeviceGetPowerUsage, self._handle) is not None:
            return "usage"
        return None

    def _read_instant_power_mw(self) -> float | None:
        """``NVML_FI_DEV_POWER_INSTANT`` through field values; per-field status is checked."""
        field_id = getattr(self._nvml, "NVML_FI_DEV_POWER_INSTANT", None)
        if field_id is None:
            return None
        values = self._optional(self._nvml.nvmlDeviceGetFieldValues, self._handle, [field_id])
        if not values or values[0].nvmlReturn != 0:
            return None
        return float(values[0].value.uiVal)

    def _read_power_w(self) -> float | None:
        if self._power_source == "instant":
            mw = self._read_instant_power_mw()
            if mw is not None:
                return from_mw(mw)
        if self._power_source is not None:
            mw = self._optional(self._nvml.nvmlDeviceGetPowerUsage, self._handle)
            return None if mw is None else from_mw(mw)
        return None

    def _read_temperature_c(self) -> float | None:
        """Reads: nvmlDeviceGetTemperatureV (°C), else the deprecated nvmlDeviceGetTemperature."""
        sensor = getattr(self._nvml, "NVML_TEMPERATURE_GPU", 0)
        value = self._read_first("temperature", _TEMPERATURE_CALLS, sensor)
        return None if value is None else float(value)

    def _read_reasons(self) -> int | None:
        """Reads: nvmlDeviceGetCurrentClocksEventReasons, else the deprecated ...ThrottleReasons."""
        mask = self._read_first("reasons", _REASON_CALLS)
        return None if mask is None else int(mask)

    def _read_power_smoothing(self) -> dict[str, object] | None:
        """Blackwell power smoothing, through field values; ``None`` where the GPU has none.

        Reads: NVML_FI_PWR_SMOOTHING_ENABLED, _APPLIED_TMP_FLOOR (the floor the GPU holds its
        power to, W as nvidia-smi prints it) and _ACTIVE_PRESET_PROFILE. A field the driver
        does not answer is left out; without the enablement field the feature is absent.
        """
        nvml = self._nvml
        ids = [getattr(nvml, name, None) for name in _SMOOTHING_FIELDS]
        if ids[0] is None:
            return None  # a binding older than power smoothing
        wanted = [i for i in ids if i is not None]
        try:
            values = self._optional(nvml.nvmlDeviceGetFieldValues, self._handle, wanted)
        except InvalidArgumentError:  # a driver older than the field ids
            return None
        got = {
            v.fieldId: api.field_number(v) for v in values or () if getattr(v, "nvmlReturn", 1) == 0
        }
        if ids[0] not in got:
            return None
        out: dict[str, object] = {"enabled": bool(got[ids[0]])}
        if ids[1] in got:
            out["floor_w"] = got[ids[1]]
        if ids[2] in got:
            out["preset_profile"] = int(got[ids[2]])
        return out

    def _read_workload_profiles(self) -> list[str] | None:
        """The workload power profiles in force (Blackwell); ``None`` where the GPU has none.

        Reads: nvmlDeviceWorkloadPowerProfileGetCurrentProfiles (its enforced-profiles mask).
        """
        nvml = self._nvml
        fn = getattr(nvml, "nvmlDeviceWorkloadPowerProfileGetCurrentProfiles", None)
        struct = getattr(nvml, "c_nvmlWorkloadPowerProfileCurrentProfiles_v1_t", None)
        if fn is None or struct is None:
            return None
        current = struct()
        if self._optional(fn, self._handle, ctypes.byref(current)) is None:
            return None
        return list(api.profile_names(api.mask_bits(list(current.enforcedProfilesMask.mask))))

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)

    def _before_write(self) -> None:
        if self._persistence == 0:
            self._warn_once(
                "persistence",
                "%s: persistence mode is off, so the driver may drop locked clocks and power limits "
                "when no process holds the GPU; enable it (nvidia-smi -pm 1 or nvidia-persistenced)",
                self.device_id,
            )

    # -- reads -----------------------------------------------------------------------------------

    def _read_state(self) -> PowerState:
        """Read one snapshot.

        Reads: total energy (mJ), instant power field or power usage (mW), SM clock (MHz), power
        limit (mW), temperature (°C).
        """
        nvml, handle = self._nvml, self._handle
        op = "read_state"
        power_w = self._read_power_w()
        energy_j: float | None = None
        if self._has_counter:
            energy_j = from_mj(
                self._call(nvml.nvmlDeviceGetTotalEnergyConsumption, handle, operation=op)
            )
        elif power_w is not None:
            energy_j = self._integrate(power_w)
        sm_mhz = self._call(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM, operation=op)
        limit_mw = (
            self._call(nvml.nvmlDeviceGetPowerManagementLimit, handle, operation=op)
            if self.info.capabilities.can_set_power_limit
            else None
        )
        return PowerState(
            device_id=self.device_id,
            timestamp_s=time.time(),
            power_w=power_w,
            energy_j=energy_j,
            sm_freq_mhz=float(sm_mhz),
            power_limit_w=None if limit_mw is None else from_mw(limit_mw),
            temperature_c=self._read_temperature_c()
            if self.info.capabilities.has_temperature
            else None,
            locked_sm_freqs_mhz=self._locked_sm,
        )

    def _integrate(self, power_w: float) -> float:
        """Trapezoidal energy estimate for GPUs without a counter."""
        with self._lock:
            now_s = self._monotonic()
            if self._integrated is None:
                self._integrated = (now_s, power_w, 0.0)
            else:
                t0, p0, e0 = self._integrated
                self._integrated = (now_s, power_w, e0 + (p0 + power_w) / 2 * max(now_s - t0, 0.0))
            return self._integrated[2]

    def _read_sm_lock(self) -> ClockLockState:
        """What the driver says about the clock lock (docs/real-gpu.md §1).

        Reads: nvmlDeviceGetCurrentClocksEventReasons, nvmlDeviceGetClockInfo(SM) (MHz). NVML
        has no getter for a locked range, so ``range_mhz`` is ``None`` and ``locked`` is True
        when the "applications clocks setting" reason is set, else ``None`` (a lock that does
        not hold the clock down right now, or no lock: NVML cannot tell which).
        """
        nvml, op = self._nvml, "read_sm_lock"
        mask = self._read_reasons()
        running_mhz = self._call(
            nvml.nvmlDeviceGetClockInfo, self._handle, nvml.NVML_CLOCK_SM, operation=op
        )
        locked = True if mask is not None and mask & api.REASON_LOCKED else None
        if locked and self._legacy_app_clocks():
            locked = None  # the reason is also set by application clocks: it proves no lock
        return ClockLockState(
            locked=locked,
            running_mhz=float(running_mhz),
            reasons=() if mask is None else api.reason_names(mask),
        )

    def _legacy_app_clocks(self) -> bool:
        """Whether (deprecated) application clocks other than the default are set.

        Reads: nvmlDeviceGetApplicationsClock, nvmlDeviceGetDefaultApplicationsClock (SM, MHz).
        They set the same clock-event reason as a lock; a GPU that cannot say has none. CUDA 13
        deprecates them (CUDA 14 removes them): on NVML 13 or newer they are not called, and the
        reason is read as a lock.
        """
        if not self._reads_app_clocks:
            return False
        nvml, sm = self._nvml, self._nvml.NVML_CLOCK_SM
        target = self._optional(nvml.nvmlDeviceGetApplicationsClock, self._handle, sm)
        default = self._optional(nvml.nvmlDeviceGetDefaultApplicationsClock, self._handle, sm)
        return target is not None and default is not None and int(target) != int(default)

    def mig_enabled(self) -> bool | None:
        """Reads: nvmlDeviceGetMigMode -> whether the current (not pending) MIG mode is on.

        ``None`` where the GPU or driver has no MIG (before Ampere, most non-A100/H100 boards).
        """
        mode = self._optional(self._nvml.nvmlDeviceGetMigMode, self._handle)
        if mode is None:
            return None
        return int(mode[0]) == getattr(self._nvml, "NVML_DEVICE_MIG_ENABLE", 1)

    def details(self) -> dict[str, object]:
        """Architecture, PCI bus id, memory clocks, enforced limit, persistence, event reasons, MIG.

        Where the GPU has them (Blackwell), also ``power_smoothing`` (``enabled``, ``floor_w``,
        ``preset_profile``) and ``workload_power_profiles`` (the profiles in force); the keys are
        absent on GPUs without them.
        """
        nvml, handle = self._nvml, self._handle
        pci = self._optional(nvml.nvmlDeviceGetPciInfo, handle)
        enforced_mw = self._optional(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
        reasons = self._read_reasons()
        minor = self._optional(nvml.nvmlDeviceGetMinorNumber, handle)
        newer: dict[str, object] = {}
        if (smoothing := self._read_power_smoothing()) is not None:
            newer["power_smoothing"] = smoothing
        if (profiles := self._read_workload_profiles()) is not None:
            newer["workload_power_profiles"] = profiles
        return {
            "architecture": api.ARCH_NAMES.get(self._arch, str(self._arch))
            if self._arch is not None
            else None,
            "pci_bus_id": None if pci is None else api.text(pci.busId),
            "minor_number": None if minor is None else int(minor),  # /dev/nvidia<N>: Slurm's
            "max_mem_freq_mhz": self._max_mem_mhz,
            "enforced_power_limit_w": None if enforced_mw is None else from_mw(enforced_mw),
            "persistence_mode": None if self._persistence is None else bool(self._persistence),
            "power_reading": {
                "instant": "instantaneous (field 186)",
                "usage": "nvmlDeviceGetPowerUsage",
            }.get(self._power_source or "", None),
            "clock_event_reasons": None if reasons is None else list(api.reason_names(reasons)),
            "mig_enabled": self.mig_enabled(),
            **newer,
        }

    # -- writes ----------------------------------------------------------------------------------

    def _lock_sm_clocks(self, min_mhz: float, max_mhz: float) -> None:
        """Writes: nvmlDeviceSetGpuLockedClocks (MHz; root)."""
        self._before_write()
        self._call(
            self._nvml.nvmlDeviceSetGpuLockedClocks,
            self._handle,
            int(min_mhz),
            int(max_mhz),
            operation="lock_sm_clocks",
        )
        self._locked_sm = (min_mhz, max_mhz)

    def _reset_sm_clocks(self) -> None:
        """Writes: nvmlDeviceResetGpuLockedClocks (root)."""
        self._call(
            self._nvml.nvmlDeviceResetGpuLockedClocks, self._handle, operation="reset_sm_clocks"
        )
        self._locked_sm = None

    def _lock_memory_clocks(self, min_mhz: float, max_mhz: float) -> None:
        """Writes: nvmlDeviceSetMemoryLockedClocks (MHz; Ampere+, root)."""
        self._before_write()
        self._call(
            self._nvml.nvmlDeviceSetMemoryLockedClocks,
            self._handle,
            int(min_mhz),
            int(max_mhz),
            operation="lock_memory_clocks",
        )

    def _reset_memory_clocks(self) -> None:
        """Writes: nvmlDeviceResetMemoryLockedClocks (root)."""
        self._call(
            self._nvml.nvmlDeviceResetMemoryLockedClocks,
            self._handle,
            operation="reset_memory_clocks",
        )

    def _set_power_limit(self, power_limit_w: float) -> float:
        """Writes: nvmlDeviceSetPowerManagementLimit (mW; root), verified by reading it back."""
        self._before_write()
        op = "set_power_limit"
        return write_power_limit(
            power_limit_w,
            lambda: self._call(
                self._nvml.nvmlDeviceSetPowerManagementLimit,
                self._handle,
                to_mw(power_limit_w),
                operation=op,
            ),
            lambda: from_mw(
                self._call(self._nvml.nvmlDeviceGetPowerManagementLimit, self._handle, operation=op)
            ),
            device_id=self.device_id,
        )

    def _reset_power_limit(self) -> None:
        """Writes: the default limit (nvmlDeviceGetPowerManagementDefaultLimit) as the limit."""
        assert self.info.default_power_limit_w is not None  # capability checked
        self._set_power_limit(self.info.default_power_limit_w)


class NvidiaBackend(Backend):
    """The NVIDIA GPUs visible to this process, in CUDA order.

    Args:
        settings: Visibility variables (``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``).
        nvml: The pynvml module; defaults to importing nvidia-ml-py's. Tests pass a fake.

    Raises:
        BackendUnavailableError: No binding, no driver, or NVML failed to start.
        ConfigError: ``CUDA_VISIBLE_DEVICES`` names a MIG instance or no/several GPUs.
    """

    name: ClassVar[str] = "nvidia"
    install_hint: ClassVar[str] = api.INSTALL_HINT

    def __init__(self, settings: Settings, nvml: Any = None) -> None:
        super().__init__(settings)
        self._nvml = api.import_pynvml() if nvml is None else nvml
        api.call(self._nvml, self._nvml.nvmlInit)
        self._is_open = True
        try:
            self._devices = self._open_devices()
        except BaseException:
            self.close()
            raise

    def _open_devices(self) -> list[NvidiaDevice]:
        nvml = self._nvml
        handles = []
        for i in range(api.call(nvml, nvml.nvmlDeviceGetCount)):
            try:
                handles.append(api.call(nvml, nvml.nvmlDeviceGetHandleByIndex, i))
            except PermissionDeniedError:  # a GPU this container's cgroup hides from us
                logger.info("NVML device %d is not accessible to this process; skipped", i)
        uuids = [api.text(api.call(nvml, nvml.nvmlDeviceGetUUID, h)) for h in handles]
        names = [api.text(api.call(nvml, nvml.nvmlDeviceGetName, h)) for h in handles]
        order = api.cuda_order(names, self.settings)
        visible = select_visible(
            self.settings.cuda_visible_devices, [uuids[i] for i in order], "CUDA_VISIBLE_DEVICES"
        )
        major = api.major_version(self._nvml_version())
        return [
            NvidiaDevice(nvml, handles[order[p]], index=k, nvml_major=major)
            for k, p in enumerate(visible)
        ]

    def _nvml_version(self) -> str | None:
        """Reads: nvmlSystemGetNVMLVersion; ``None`` when it cannot be read."""
        fn = getattr(self._nvml, "nvmlSystemGetNVMLVersion", None)
        try:
            return None if fn is None else api.text(api.call(self._nvml, fn))
        except PowerlibError as err:
            logger.debug("nvmlSystemGetNVMLVersion: %s", err)
            return None

    @classmethod
    def probe(cls, settings: Settings) -> ProbeResult:
        """Import the binding, initialise NVML and count visible GPUs; never raises."""
        try:
            with cls(settings) as backend:
                count = len(backend.devices())
        except PowerlibError as err:
            return ProbeResult(backend=cls.name, is_available=False, reason=err.message)
        if count == 0:
            return ProbeResult(
                backend=cls.name,
                is_available=False,
                reason="NVML started but no GPU is visible (CUDA_VISIBLE_DEVICES is empty?)",
            )
        return ProbeResult(
            backend=cls.name,
            is_available=True,
            reason=f"NVML found {count} visible GPU(s)",
            num_devices=count,
        )

    def versions(self) -> dict[str, str | None]:
        """The driver and NVML versions, and the nvidia-ml-py package's."""
        out: dict[str, str | None] = {}
        for key, fn_name in (
            ("driver", "nvmlSystemGetDriverVersion"),
            ("nvml", "nvmlSystemGetNVMLVersion"),
        ):
            fn = getattr(self._nvml, fn_name, None)
            try:
                out[key] = None if fn is None else api.text(api.call(self._nvml, fn))
            except PowerlibError as err:
                logger.debug("%s: %s", fn_name, err)
                out[key] = None
        out["nvidia-ml-py"] = api.package_version("nvidia-ml-py")
        return out

    def devices(self) -> Sequence[NvidiaDevice]:
        """The visible GPUs, in CUDA order."""
        return self._devices

    def control_refusal(self) -> str | None:
        """Why this process may not change NVIDIA GPUs: not root, or no ``CAP_SYS_ADMIN``.

        NVML refuses every setter otherwise (docs/real-gpu.md §5).
        """
        return admin_refusal("NVIDIA GPU clocks and power limits", _PROC_STATUS_PATH)

    def close(self) -> None:
        """Shut NVML down (device settings are left as they are)."""
        if getattr(self, "_is_open", False):
            self._is_open = False
            try:
                api.call(self._nvml, self._nvml.nvmlShutdown)
            except PowerlibError as err:
                logger.debug("nvmlShutdown failed: %s", err)
