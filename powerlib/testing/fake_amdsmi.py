"""A fake ``amdsmi`` module, for testing code that uses the AMD backend without ROCm or a GPU.

:func:`make_fake_amdsmi` returns a module object that stands in for ``import amdsmi``::

    fake = make_fake_amdsmi(devices=2)
    backend = AmdBackend(Settings(), smi=fake)

It implements the subset of the amdsmi 7.0.2 Python API that powerlib calls, with the same function
names and parameter names (``tests/backends/test_amd.py`` checks them against a snapshot recorded from
the real wrapper), the same enum values, and exception classes with the real names and constructor
signatures. Like the real wrapper it checks argument types (a ``float`` where it wants an ``int``
raises ``AmdSmiParameterException``) and returns the same dict keys, including the ``"N/A"``
string the wrapper puts in place of a ``0xFFFF`` power reading (a ``0xFFFFFFFF`` passes through, as
it does in 7.0.2).

By default it models one MI300X-like GPU. The numbers are approximate (public spec sheets and
amd-smi examples), not measurements: 304 compute units, GFX clock 500-2100 MHz, power cap 750 W
(range 0-750 W, in µW as amdsmi reports it on bare-metal Linux), 150 W drawn under load, an
energy counter of 15.259 µJ per tick, 45 °C hotspot.

Behaviour a test can rely on:

- ``amdsmi_init`` / ``amdsmi_shut_down`` are reference-counted; any other call while the count is
  zero raises ``AMDSMI_STATUS_NOT_INIT`` (32).
- ``amdsmi_get_processor_handles`` returns GPUs in PCI BDF order, whatever order they were given in.
- Setters need ``fake.is_root`` (else ``AMDSMI_STATUS_NO_PERM``, 10). ``amdsmi_set_gpu_clk_range``
  moves the perf level to MANUAL and keeps the current GFX clock inside the range;
  ``amdsmi_set_gpu_perf_determinism_mode`` moves it to DETERMINISM with the value as soft max;
  ``amdsmi_set_gpu_perf_level(AUTO)`` drops both. The current clock is the soft maximum (a busy GPU).
  A GPU with ``ignores_clock_writes`` answers those three setters with success and changes nothing
  (a driver that drops the write).
- Power is ``min(load_power_w, power cap)``; :meth:`FakeAmdsmi.advance` adds that power times the
  time to each energy accumulator.
- :meth:`FakeAmdsmi.fail` injects a status code into a function or a glob of them (optionally one
  GPU, a number of times), raised the way the wrapper's ``_check_res`` raises it.
- Every call is recorded in ``fake.calls`` as ``(function name, amd-smi index or None)``, and
  ``fake.concurrent_entries`` counts calls that started while another was still running (set
  ``fake.entry_delay_s`` to widen the window), so tests can check that callers serialise.

The status codes, exception classes and enums are in :mod:`powerlib.testing._amdsmi_types`
(importable from here too). This module and that one import only the standard library.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import threading
import time
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from powerlib.testing._amdsmi_types import (
    INVAL,
    NO_PERM,
    NOT_INIT,
    NOT_SUPPORTED,
    RETRY,
    TIMEOUT,
    AmdSmiClkType,
    AmdSmiDevPerfLevel,
    AmdSmiException,
    AmdSmiInitFlags,
    AmdSmiLibraryException,
    AmdSmiParameterException,
    AmdSmiRetryException,
    AmdSmiTemperatureMetric,
    AmdSmiTemperatureType,
    AmdSmiTimeoutException,
)

__all__ = ["FakeAmdsmi", "FakeGpu", "make_fake_amdsmi"]

_NA_UINT16 = 0xFFFF  # the wrapper maps exactly this value to "N/A" in amdsmi_get_power_info
_MHZ_TO_HZ = 1_000_000


# Names for annotations inside FakeAmdsmi, whose class attributes of the same names shadow them.
_InitFlags = AmdSmiInitFlags
_ClkType = AmdSmiClkType
_PerfLevel = AmdSmiDevPerfLevel
_TempType = AmdSmiTemperatureType
_TempMetric = AmdSmiTemperatureMetric


# -- the modelled GPU -----------------------------------------------------------------------------


@dataclass
class FakeGpu:
    """One fake GPU: static facts, capability switches and live state (all mutable by tests).

    ``None`` for ``hip_id`` / ``kfd_node_id`` makes the corresponding call raise NOT_SUPPORTED
    (a ROCm older than 6.4 / 6.3). Raw power fields follow the wrapper: ``None`` means "use the
    model", ``0xFFFF`` is returned as ``"N/A"``, anything else as given.
    """

    bdf: str = "0000:05:00.0"
    uuid: str = "01ff74a1-0000-1000-8000-c8bd5b3ab8a0"
    hip_uuid: str = "GPU-01a0c8bd5b3ab8a0"
    hip_id: int | None = 0
    kfd_node_id: int | None = 2
    market_name: str = "AMD Instinct MI300X"
    num_compute_units: int = 304
    target_graphics_version: str = "gfx942"
    gfx_min_mhz: int = 500
    gfx_max_mhz: int = 2100
    gfx_dpm_levels_mhz: tuple[int, ...] = (500, 1300, 2100)
    power_cap_uw: int = 750_000_000
    default_power_cap_uw: int = 750_000_000
    min_power_cap_uw: int = 0
    max_power_cap_uw: int = 750_000_000
    dpm_cap_mhz: int = 2100
    load_power_w: float = 150.0
    current_socket_power_raw: int | None = None
    average_socket_power_raw: int | None = _NA_UINT16  # MI300 reports current power only
    has_energy_counter: bool = True
    energy_key: str = "energy_accumulator"  # amdsmi <= 6.2.0 called it "power"
    energy_accumulator: int = 1_000_000
    counter_resolution_uj: float = 15.259
    temperatures_c: dict[str, int] = field(default_factory=lambda: {"HOTSPOT": 45, "EDGE": 38})
    supports_clk_range: bool = True
    supports_determinism: bool = True
    perf_level: AmdSmiDevPerfLevel = AmdSmiDevPerfLevel.AUTO
    ignores_clock_writes: bool = False  # clock setters report success and change nothing
    soft_min_mhz: int | None = None  # None: no soft limit (the hardware range applies)
    soft_max_mhz: int | None = None
    energy_remainder_ticks: float = field(default=0.0, repr=False)

    @property
    def power_w(self) -> float:
        """Modelled draw: the load, capped by the power cap."""
        return min(self.load_power_w, self.power_cap_uw / 1e6)

    @property
    def gfx_clk_mhz(self) -> int:
        """Current GFX clock: the soft maximum, or the hardware maximum."""
        return self.soft_max_mhz if self.soft_max_mhz is not None else self.gfx_max_mhz


def _default_gpu(i: int) -> FakeGpu:
    digest = hashlib.sha256(f"fake-amd-gpu-{i}".encode()).hexdigest()
    return FakeGpu(
        bdf=f"{i // 16:04x}:{(i % 16) * 16 + 5:02x}:00.0",
        uuid=f"{i:02x}{digest[:6]}-0000-1000-80{digest[6:8]}-{digest[8:20]}",
        hip_uuid=f"GPU-{i:02x}{digest[20:34]}",
        hip_id=i,
        kfd_node_id=2 + i,
    )


@dataclass(frozen=True)
class _Handle:
    """An opaque processor handle (the wrapper hands out ctypes pointers)."""

    serial: int


@dataclass
class _Fault:
    code: int
    device: int | None
    times: int | None


class FakeAmdsmi(types.ModuleType):
    """A module object with the amdsmi API subset powerlib uses. Build it with make_fake_amdsmi.

    Attributes:
        gpus: The GPUs in amd-smi (PCI BDF) order; mutate them to change what the fake reports.
        is_root: Whether setters succeed (else ``AMDSMI_STATUS_NO_PERM``).
        calls: ``(function name, amd-smi index or None)`` for every call, in order.
        concurrent_entries: Calls that began while another call was in progress.
        entry_delay_s: Time each call takes (widens the window for concurrency checks).
        init_count: Current ``amdsmi_init`` reference count.
        missing: Function names to hide (``getattr`` raises ``AttributeError``), as an older
            wrapper would.
    """

    AmdSmiException = AmdSmiException
    AmdSmiLibraryException = AmdSmiLibraryException
    AmdSmiRetryException = AmdSmiRetryException
    AmdSmiTimeoutException = AmdSmiTimeoutException
    AmdSmiParameterException = AmdSmiParameterException
    AmdSmiInitFlags = AmdSmiInitFlags
    AmdSmiClkType = AmdSmiClkType
    AmdSmiDevPerfLevel = AmdSmiDevPerfLevel
    AmdSmiTemperatureType = AmdSmiTemperatureType
    AmdSmiTemperatureMetric = AmdSmiTemperatureMetric

    def __init__(self, gpus: Sequence[FakeGpu]) -> None:
        super().__init__("amdsmi", "A fake amdsmi module (powerlib.testing.fake_amdsmi).")
        self.__version__ = "7.0.2"
        self.gpus = sorted(gpus, key=lambda g: g.bdf.lower())
        self._handles = [_Handle(i) for i in range(len(self.gpus))]
        self.is_root = True
        self.calls: list[tuple[str, int | None]] = []
        self.concurrent_entries = 0
        self.entry_delay_s = 0.0
        self.init_count = 0
        self.missing: set[str] = set()
        self._faults: dict[str, list[_Fault]] = {}
        self._active = 0
        self._state_lock = threading.Lock()

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("amdsmi_") and name in object.__getattribute__(self, "missing"):
            raise AttributeError(f"module 'amdsmi' has no attribute {name!r}")
        return object.__getattribute__(self, name)

    # -- test controls ------------------------------------------------------------------------

    def fail(
        self, function_name: str, code: int, device: int | None = None, times: int | None = None
    ) -> None:
        """Make ``function_name`` fail with status ``code``.

        Args:
            function_name: An ``amdsmi_*`` name, or a glob such as ``"amdsmi_set_*"``.
            code: The ``AMDSMI_STATUS_*`` value (9 and 8 raise the Retry/Timeout subclasses).
            device: amd-smi index of the GPU whose calls fail; ``None`` for every call.
            times: Fail this many times, then succeed; ``None`` for always.
        """
        self._faults.setdefault(function_name, []).append(_Fault(code, device, times))

    def clear_failures(self) -> None:
        """Remove every injected failure."""
        self._faults.clear()

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` of load pass: each energy accumulator grows by power × time."""
        for gpu in self.gpus:
            ticks = seconds * gpu.power_w * 1e6 / gpu.counter_resolution_uj
            total = gpu.energy_remainder_ticks + ticks
            whole = int(total)
            gpu.energy_accumulator += whole
            gpu.energy_remainder_ticks = total - whole

    def count(self, function_name: str) -> int:
        """How many times ``function_name`` was called."""
        return sum(1 for name, _ in self.calls if name == function_name)

    # -- plumbing -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _enter(self, name: str, handle: object = None, *, needs_init: bool = True) -> Iterator[int]:
        with self._state_lock:
            self._active += 1
            if self._active > 1:
                self.concurrent_entries += 1
        try:
            index = self._index(handle) if handle is not None else None
            self.calls.append((name, index))
            if self.entry_delay_s:
                time.sleep(self.entry_delay_s)
            if needs_init and self.init_count == 0:
                raise AmdSmiLibraryException(NOT_INIT)
            self._maybe_fail(name, index)
            yield -1 if index is None else index
        finally:
            with self._state_lock:
                self._active -= 1

    def _index(self, handle: object) -> int:
        if not isinstance(handle, _Handle) or handle.serial >= len(self.gpus):
            raise AmdSmiParameterException(handle, "amdsmi_processor_handle")
        return handle.serial

    def _maybe_fail(self, name: str, index: int | None) -> None:
        for pattern, faults in self._faults.items():
            if fnmatch.fnmatchcase(name, pattern):
                self._apply(faults, index)

    @staticmethod
    def _apply(faults: list[_Fault], index: int | None) -> None:
        for fault in faults:
            if fault.device is not None and fault.device != index:
                continue
            if fault.times is not None:
                if fault.times <= 0:
                    continue
                fault.times -= 1
            if fault.code == RETRY:
                raise AmdSmiRetryException()
            if fault.code == TIMEOUT:
                raise AmdSmiTimeoutException()
            raise AmdSmiLibraryException(fault.code)

    def _require_root(self) -> None:
        if not self.is_root:
            raise AmdSmiLibraryException(NO_PERM)

    @staticmethod
    def _check(value: object, expected: type) -> None:
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise AmdSmiParameterException(value, expected)

    # -- lifecycle and identity -----------------------------------------------------------------

    def amdsmi_init(self, flag: _InitFlags = _InitFlags.INIT_AMD_GPUS) -> None:
        """Initialise (reference-counted)."""
        self._check(flag, AmdSmiInitFlags)
        with self._enter("amdsmi_init", needs_init=False):
            self.init_count += 1

    def amdsmi_shut_down(self) -> None:
        """Drop one reference."""
        with self._enter("amdsmi_shut_down"):
            self.init_count -= 1

    def amdsmi_get_lib_version(self) -> dict[str, Any]:
        """An approximate library version for ROCm 7.0.2."""
        with self._enter("amdsmi_get_lib_version"):
            return {"major": 26, "minor": 0, "release": 2, "build": "0"}

    def amdsmi_get_processor_handles(self) -> list[_Handle]:
        """Handles in PCI BDF order."""
        with self._enter("amdsmi_get_processor_handles"):
            return list(self._handles)

    def amdsmi_get_gpu_device_bdf(self, processor_handle: object) -> str:
        """``"dddd:bb:dd.f"``."""
        with self._enter("amdsmi_get_gpu_device_bdf", processor_handle) as i:
            return self.gpus[i].bdf

    def amdsmi_get_gpu_device_uuid(self, processor_handle: object) -> str:
        """amd-smi's UUID (not HIP's)."""
        with self._enter("amdsmi_get_gpu_device_uuid", processor_handle) as i:
            return self.gpus[i].uuid

    def amdsmi_get_gpu_enumeration_info(self, processor_handle: object) -> dict[str, Any]:
        """HIP and DRM indices (ROCm 6.4+); NOT_SUPPORTED when ``hip_id`` is None."""
        with self._enter("amdsmi_get_gpu_enumeration_info", processor_handle) as i:
            gpu = self.gpus[i]
            if gpu.hip_id is None:
                raise AmdSmiLibraryException(NOT_SUPPORTED)
            return {
                "drm_render": 128 + i,
                "drm_card": i,
                "hsa_id": gpu.kfd_node_id if gpu.kfd_node_id is not None else "N/A",
                "hip_id": gpu.hip_id,
                "hip_uuid": gpu.hip_uuid,
            }

    def amdsmi_get_gpu_kfd_info(self, processor_handle: object) -> dict[str, Any]:
        """KFD ids; NOT_SUPPORTED when ``kfd_node_id`` is None."""
        with self._enter("amdsmi_get_gpu_kfd_info", processor_handle) as i:
            gpu = self.gpus[i]
            if gpu.kfd_node_id is None:
                raise AmdSmiLibraryException(NOT_SUPPORTED)
            return {"kfd_id": 10_000 + i, "node_id": gpu.kfd_node_id, "current_partition_id": 0}

    def amdsmi_get_gpu_asic_info(self, processor_handle: object) -> dict[str, Any]:
        """Market name, compute units, graphics target."""
        with self._enter("amdsmi_get_gpu_asic_info", processor_handle) as i:
            gpu = self.gpus[i]
            return {
                "market_name": gpu.market_name or "N/A",
                "vendor_id": "0x1002",
                "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
                "subvendor_id": "0x1002",
                "device_id": "0x74a1",
                "rev_id": "0x00",
                "asic_serial": f"0x{0x5A3B8A0000000000 + i:016X}",
                "oam_id": i,
                "num_compute_units": gpu.num_compute_units,
                "target_graphics_version": gpu.target_graphics_version,
                "subsystem_id": "0x74a1",
            }

    # -- clocks -----------------------------------------------------------------------------------

    def amdsmi_get_clock_info(
        self, processor_handle: object, clock_type: _ClkType
    ) -> dict[str, Any]:
        """GFX clock (MHz): current, hardware min and max, whether a soft limit is set."""
        self._check(clock_type, AmdSmiClkType)
        with self._enter("amdsmi_get_clock_info", processor_handle) as i:
            gpu = self.gpus[i]
            if clock_type != AmdSmiClkType.GFX:
                raise AmdSmiLibraryException(NOT_SUPPORTED)
            return {
                "clk": gpu.gfx_clk_mhz,
                "min_clk": gpu.gfx_min_mhz,
                "max_clk": gpu.gfx_max_mhz,
                "clk_locked": gpu.soft_max_mhz is not None,
                "clk_deep_sleep": "N/A",
            }

    def amdsmi_get_clk_freq(self, processor_handle: object, clk_type: _ClkType) -> dict[str, Any]:
        """DPM levels, in Hz as the C struct holds them."""
        self._check(clk_type, AmdSmiClkType)
        with self._enter("amdsmi_get_clk_freq", processor_handle) as i:
            gpu = self.gpus[i]
            if clk_type != AmdSmiClkType.GFX:
                raise AmdSmiLibraryException(NOT_SUPPORTED)
            levels = list(gpu.gfx_dpm_levels_mhz)
            current = min(range(len(levels)), key=lambda k: abs(levels[k] - gpu.gfx_clk_mhz))
            return {
                "num_supported": len(levels),
                "current": current,
                "frequency": [mhz * _MHZ_TO_HZ for mhz in levels],
            }

    def amdsmi_set_gpu_clk_range(
        self,
        processor_handle: object,
        min_clk_value: int,
        max_clk_value: int,
        clk_type: _ClkType,
    ) -> None:
        """Soft GFX range in MHz (root); the perf level becomes MANUAL."""
        self._check(min_clk_value, int)
        self._check(max_clk_value, int)
        self._check(clk_type, AmdSmiClkType)
        with self._enter("amdsmi_set_gpu_clk_range", processor_handle) as i:
            gpu = self.gpus[i]
            if not gpu.supports_clk_range or clk_type != AmdSmiClkType.GFX:
                raise AmdSmiLibraryException(NOT_SUPPORTED)
            self._require_root()
            if not gpu.gfx_min_mhz <= min_clk_value <= max_clk_value <= gpu.gfx_max_mhz:
                raise AmdSmiLibraryException(INVAL)
            if gpu.ignores_clock_writes:
                return
            gpu.soft_min_mhz, gpu.soft_max_mhz = min_clk_value, max_clk_value
            gpu.perf_level = AmdSmiDevPerfLevel.MANUAL

    def amdsmi_set_gpu_perf_determinism_mode(self, processor_handle: object, clkvalue: int) -> None:
        """Performance determinism with ``clkvalue`` MHz as GFX soft max (root)."""
        self._check(clkvalue, int)
        with self._enter("amdsmi_set_gpu_perf_determinism_mode", processor_handle) as i:
            gpu = self.gpus[i]
            if not gpu.supports_determinism:
                raise AmdSmiLibraryException(NOT_SUPPORTED)
            self._require_root()
            if not gpu.gfx_min_mhz <= clkvalue <= gpu.gfx_max_mhz:
                raise AmdSmiLibraryException(INVAL)
            if gpu.ignores_clock_writes:
                return
            gpu.soft_min_mhz, gpu.soft_max_mhz = None, clkvalue
            gpu.perf_level = AmdSmiDevPerfLevel.DETERMINISM

    def amdsmi_set_gpu_perf_level(self, processor_handle: object, perf_level: _PerfLevel) -> None:
        """Set the perf level (root); AUTO drops every soft clock limit."""
        self._check(perf_level, AmdSmiDevPerfLevel)
        with self._enter("amdsmi_set_gpu_perf_level", processor_handle) as i:
            self._require_root()
            gpu = self.gpus[i]
            if gpu.ignores_clock_writes:
                return
            gpu.perf_level = perf_level
            if perf_level == AmdSmiDevPerfLevel.AUTO:
                gpu.soft_min_mhz = gpu.soft_max_mhz = None

    def amdsmi_get_gpu_perf_level(self, processor_handle: object) -> str:
        """E.g. ``"AMDSMI_DEV_PERF_LEVEL_AUTO"``."""
        with self._enter("amdsmi_get_gpu_perf_level", processor_handle) as i:
            return f"AMDSMI_DEV_PERF_LEVEL_{self.gpus[i].perf_level.name}"

    # -- power and energy -------------------------------------------------------------------------

    def amdsmi_get_power_cap_info(self, processor_handle: object) -> dict[str, Any]:
        """Caps in µW, ``dpm_cap`` in MHz."""
        with self._enter("amdsmi_get_power_cap_info", processor_handle) as i:
            gpu = self.gpus[i]
            return {
                "power_cap": gpu.power_cap_uw,
                "default_power_cap": gpu.default_power_cap_uw,
                "dpm_cap": gpu.dpm_cap_mhz,
                "min_power_cap": gpu.min_power_cap_uw,
                "max_power_cap": gpu.max_power_cap_uw,
            }

    def amdsmi_set_power_cap(self, processor_handle: object, sensor_ind: int, cap: int) -> None:
        """Set the cap in µW (root); the driver keeps whole watts, as amdgpu's hwmon does."""
        self._check(sensor_ind, int)
        self._check(cap, int)
        with self._enter("amdsmi_set_power_cap", processor_handle) as i:
            self._require_root()
            gpu = self.gpus[i]
            if sensor_ind != 0 or not gpu.min_power_cap_uw <= cap <= gpu.max_power_cap_uw:
                raise AmdSmiLibraryException(INVAL)
            gpu.power_cap_uw = cap // 1_000_000 * 1_000_000

    def amdsmi_get_power_info(self, processor_handle: object) -> dict[str, Any]:
        """Socket power in W (ints), with the wrapper's ``0xFFFF`` → ``"N/A"`` mapping."""
        with self._enter("amdsmi_get_power_info", processor_handle) as i:
            gpu = self.gpus[i]
            modelled = int(round(gpu.power_w))
            current = (
                modelled if gpu.current_socket_power_raw is None else gpu.current_socket_power_raw
            )
            average = (
                modelled if gpu.average_socket_power_raw is None else gpu.average_socket_power_raw
            )
            info: dict[str, Any] = {
                "socket_power": current,
                "current_socket_power": current,
                "average_socket_power": average,
                "gfx_voltage": _NA_UINT16,
                "soc_voltage": _NA_UINT16,
                "mem_voltage": _NA_UINT16,
                "power_limit": gpu.power_cap_uw,
            }
            return {k: "N/A" if v == _NA_UINT16 else v for k, v in info.items()}

    def amdsmi_get_energy_count(self, processor_handle: object) -> dict[str, Any]:
        """Accumulator ticks, µJ per tick, and a timestamp (ns)."""
        with self._enter("amdsmi_get_energy_count", processor_handle) as i:
            gpu = self.gpus[i]
            if not gpu.has_energy_counter:
                raise AmdSmiLibraryException(NOT_SUPPORTED)
            return {
                gpu.energy_key: gpu.energy_accumulator,
                "counter_resolution": gpu.counter_resolution_uj,
                "timestamp": time.monotonic_ns(),
            }

    def amdsmi_get_temp_metric(
        self,
        processor_handle: object,
        sensor_type: _TempType,
        metric: _TempMetric,
    ) -> int:
        """Temperature in °C; NOT_SUPPORTED for sensors the GPU lacks."""
        self._check(sensor_type, AmdSmiTemperatureType)
        self._check(metric, AmdSmiTemperatureMetric)
        with self._enter("amdsmi_get_temp_metric", processor_handle) as i:
            value = self.gpus[i].temperatures_c.get(sensor_type.name)
            if value is None or metric != AmdSmiTemperatureMetric.CURRENT:
                raise AmdSmiLibraryException(NOT_SUPPORTED)
            return value


def make_fake_amdsmi(devices: int | Sequence[FakeGpu] = 1) -> FakeAmdsmi:
    """Build a fake ``amdsmi`` module.

    Args:
        devices: A number of default MI300X-like GPUs (distinct BDFs, UUIDs, and HIP ids equal to
            their amd-smi index), or the :class:`FakeGpu` objects to model (any order; the fake
            enumerates them by BDF).

    Returns:
        A module object; pass it as ``AmdBackend(settings, smi=...)`` or put it in ``sys.modules``.
    """
    gpus = [_default_gpu(i) for i in range(devices)] if isinstance(devices, int) else devices
    return FakeAmdsmi(gpus)
