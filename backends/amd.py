"""AMD GPUs through ``amdsmi`` (the ROCm SMI library's Python wrapper; extra ``amd``).

Importing ``amdsmi`` without ROCm prints to stdout and raises ``KeyError``; with a library that
lacks a symbol it raises ``AttributeError``. :func:`~powerlib.backends._amd_api.import_amdsmi` swallows the stdout noise (it
would corrupt ``--json`` output) and turns every failure into ``BackendUnavailableError`` with a
hint. The module can also be passed in (``AmdBackend(settings, smi=fake)``); tests use
:mod:`powerlib.testing.fake_amdsmi`.

The amdsmi calls themselves (one lock, retries, error translation, value parsing) are
:mod:`powerlib.backends._amd_api`; which GPUs this process sees and how they are numbered is
:mod:`powerlib.backends._amd_enumeration`.

Units at this edge: power caps µW (bare-metal Linux), socket power W, energy ticks × µJ per tick,
clocks MHz, temperature °C; inside powerlib W, J, MHz, °C.

Clocks:

* ``supported_sm_freqs_mhz`` is a 50 MHz grid over the GFX range that ``amdsmi_get_clock_info``
  reports (``min_clk``-``max_clk``), both ends included. ``amdsmi_set_gpu_clk_range`` accepts any
  MHz value in that range, while the DPM levels (``amdsmi_get_clk_freq``, often three on an
  Instinct GPU) are too coarse to plan on; they are shown in ``details()``. Some amdsmi versions
  report the soft limits in force as ``min_clk``/``max_clk``: open the backend after a reset to see
  the full range.
* Locking writes ``amdsmi_set_gpu_clk_range`` (the perf level becomes MANUAL). Where that call is
  not supported and a single clock is requested, performance determinism
  (``amdsmi_set_gpu_perf_determinism_mode``, MI200 and newer) is used instead: the firmware then
  holds a steady GFX clock at or below the value, under the power cap.
* The only reset is ``amdsmi_set_gpu_perf_level(AUTO)``; it resets every clock domain at once, so
  memory clocks are never offered for locking.
* amdsmi cannot read a locked range back reliably: ``PowerState.locked_sm_freqs_mhz`` is the lock
  this process applied. :meth:`AmdDevice.read_sm_lock` asks the driver whether a lock is in force
  (docs/real-gpu.md §1): perf level AUTO means none, MANUAL, DETERMINISM or another forced level
  means one (whoever set it); an UNKNOWN level falls back to ``clk_locked`` of
  ``amdsmi_get_clock_info``. A perf level other than AUTO set by someone else shows in
  ``details()``.
* MIG has no AMD counterpart that powerlib reads: ``mig_enabled()`` is ``None``.

Privileges: every setter needs root; in a container also access to ``/dev/kfd`` and ``/dev/dri``
and a writable ``/sys``. Clock and power-cap control work on bare metal (and single-VF SR-IOV
guests for the cap), not on VM guests in general, which answer NOT_SUPPORTED.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from powerlib.backend import Backend, ProbeResult
from powerlib.backends import _amd_api as api
from powerlib.backends._amd_enumeration import Gpu, enumerate_gpus
from powerlib.backends._power_limit import write_power_limit
from powerlib.config import Settings
from powerlib.device import Capabilities, ClockLockState, Device, DeviceInfo, DeviceKind, PowerState
from powerlib.errors import (
    BackendUnavailableError,
    DeviceError,
    NotSupportedError,
    PermissionDeniedError,
    PowerlibError,
)
from powerlib.privilege import admin_refusal
from powerlib.units import from_uj, from_uw, to_uw

__all__ = ["AmdBackend", "AmdDevice"]

logger = logging.getLogger(__name__)

_MIN_PLAUSIBLE_CAP_UW = 1_000_000  # a maximum cap under 1 W means the unit is not µW
_MILLIDEGREE_THRESHOLD = 1000.0  # no GPU reports 1000 °C: larger values are m°C
_PROC_STATUS_PATH = Path("/proc/self/status")  # where control_refusal reads CapEff (tests move it)


# -- devices -----------------------------------------------------------------------------------


class _EnergyTotal:
    """Running µJ total of the energy accumulator; never decreases while the device is open."""

    def __init__(self, first_uj: float, label: str) -> None:
        self._lock = threading.Lock()
        self._prev_uj = first_uj
        self._total_uj = first_uj
        self._label = label
        self._has_warned = False

    def update(self, raw_uj: float) -> float:
        """Add a reading; return the total in J."""
        with self._lock:
            delta_uj = raw_uj - self._prev_uj
            if delta_uj < 0:
                if not self._has_warned:
                    self._has_warned = True
                    logger.warning(
                        "%s: the amdsmi energy counter went backwards (%.0f -> %.0f µJ; see "
                        "ROCm/amdsmi#115); counting from the new value",
                        self._label,
                        self._prev_uj,
                        raw_uj,
                    )
                delta_uj = 0.0
            self._total_uj += delta_uj
            self._prev_uj = raw_uj
            return from_uj(self._total_uj)


class AmdDevice(Device):
    """One AMD GPU. Static facts are read once, when the backend opens.

    Args:
        smi: The amdsmi module (or a fake with the same API), already initialised.
        gpu: The GPU's identity from enumeration.
        index: HIP-order index among the visible GPUs.
        order_source: Where the HIP order came from (shown in ``details()``).
        lib_version: ``amdsmi_get_lib_version()`` as text, if known.
    """

    def __init__(
        self,
        smi: Any,
        gpu: Gpu,
        index: int,
        *,
        order_source: str = "",
        lib_version: str | None = None,
    ) -> None:
        self._smi, self._gpu, self._handle = smi, gpu, gpu.handle
        self._order_source, self._lib_version = order_source, lib_version
        self._gfx = api.enum(smi, "AmdSmiClkType", "GFX")
        self._perf_auto = api.enum(smi, "AmdSmiDevPerfLevel", "AUTO")
        self._temp_current = api.enum(smi, "AmdSmiTemperatureMetric", "CURRENT")
        self._locked_mhz: tuple[float, float] | None = None
        self._lock_mode: str | None = None
        asic = self._optional("amdsmi_get_gpu_asic_info", self._handle) or {}
        clock = self._optional("amdsmi_get_clock_info", self._handle, self._gfx)
        self._has_clock_info = clock is not None
        gfx_min, gfx_max = (
            api.number((clock or {}).get("min_clk")),
            api.number((clock or {}).get("max_clk")),
        )
        freqs: tuple[float, ...] = ()
        if gfx_min is not None and gfx_max is not None and 0 < gfx_min <= gfx_max:
            freqs = api.gfx_grid_mhz(gfx_min, gfx_max)
        range_w, default_w = self._power_cap_facts()
        self._energy = self._open_energy()
        picked = api.pick_power(self._optional("amdsmi_get_power_info", self._handle))
        self._power_field = None if picked is None else picked[0]
        self._temp_sensor = self._detect_temperature_sensor()
        self._asic = {k: asic.get(k) for k in ("num_compute_units", "target_graphics_version")}
        super().__init__(
            DeviceInfo(
                device_id=gpu.device_id,
                index=index,
                name=api.text(asic.get("market_name")) or "AMD GPU",
                vendor="amd",
                kind=DeviceKind.GPU,
                backend="amd",
                supported_sm_freqs_mhz=freqs,
                power_limit_range_w=range_w,
                default_power_limit_w=default_w,
                capabilities=Capabilities(
                    can_lock_sm_clocks=bool(freqs),
                    can_set_power_limit=range_w is not None,
                    can_reset_power_limit=default_w is not None,
                    has_energy_counter=self._energy is not None,
                    has_power_reading=self._power_field is not None,
                    has_temperature=self._temp_sensor is not None,
                    can_lock_memory_clocks=False,
                ),
            )
        )

    # -- helpers -------------------------------------------------------------------------------

    def _call(self, name: str, *args: Any, operation: str) -> Any:
        return api.call(self._smi, name, *args, device=self._gpu.device_id, operation=operation)

    def _optional(self, name: str, *args: Any, operation: str = "open") -> Any:
        """``_call``, or ``None`` when the GPU, driver or wrapper does not support it."""
        try:
            return self._call(name, *args, operation=operation)
        except NotSupportedError as err:
            logger.debug("%s: %s", self._gpu.device_id, err)
            return None

    def _power_cap_facts(self) -> tuple[tuple[float, float] | None, float | None]:
        """Reads: amdsmi_get_power_cap_info (µW) -> ``(power_limit_range_w, default_w)``."""
        caps = self._optional("amdsmi_get_power_cap_info", self._handle)
        if not caps:
            return None, None
        max_uw = api.number(caps.get("max_power_cap"))
        if max_uw is None or max_uw < _MIN_PLAUSIBLE_CAP_UW:
            logger.warning(
                "%s: amdsmi reports a maximum power cap of %r, not a plausible µW value; power "
                "capping is disabled for this GPU",
                self._gpu.device_id,
                caps.get("max_power_cap"),
            )
            return None, None
        min_uw = api.number(caps.get("min_power_cap")) or 0.0
        range_w = (from_uw(min(min_uw, max_uw)), from_uw(max_uw))
        default_uw = api.number(caps.get("default_power_cap"))
        default_w = None if not default_uw else from_uw(default_uw)
        if default_w is not None and not range_w[0] <= default_w <= range_w[1]:
            logger.info(
                "%s: default power cap %g W is outside %g-%g W; reset_power_limit is disabled",
                self._gpu.device_id,
                default_w,
                *range_w,
            )
            default_w = None
        return range_w, default_w

    def _read_energy_uj(self, operation: str) -> float | None:
        """Reads: amdsmi_get_energy_count -> accumulator (ticks) × counter_resolution (µJ)."""
        reading = self._call("amdsmi_get_energy_count", self._handle, operation=operation) or {}
        ticks = reading.get("energy_accumulator", reading.get("power"))  # "power" in <= 6.2.0
        if isinstance(ticks, bool) or not isinstance(ticks, int) or ticks < 0:
            return None
        resolution_uj = api.number(reading.get("counter_resolution"))
        if resolution_uj is None or resolution_uj <= 0:
            return None
        return ticks * resolution_uj

    def _open_energy(self) -> _EnergyTotal | None:
        try:
            first_uj = self._read_energy_uj("open")
        except (NotSupportedError, PermissionDeniedError) as err:
            logger.info("%s: no energy counter: %s", self._gpu.device_id, err)
            return None
        if first_uj is None:
            logger.warning(
                "%s: amdsmi_get_energy_count returned no usable value; no energy counter",
                self._gpu.device_id,
            )
            return None
        return _EnergyTotal(first_uj, self._gpu.device_id)

    def _read_temperature_c(self, sensor: Any, operation: str) -> float | None:
        """Reads: amdsmi_get_temp_metric(sensor, CURRENT) (°C)."""
        value = api.number(
            self._call(
                "amdsmi_get_temp_metric",
                self._handle,
                sensor,
                self._temp_current,
                operation=operation,
            )
        )
        if value is not None and abs(value) >= _MILLIDEGREE_THRESHOLD:
            value /= 1000.0
        return value

    def _detect_temperature_sensor(self) -> Any:
        for member in ("HOTSPOT", "EDGE"):
            sensor = getattr(getattr(self._smi, "AmdSmiTemperatureType", None), member, None)
            if sensor is None:
                continue
            try:
                if self._read_temperature_c(sensor, "open") is not None:
                    return sensor
            except NotSupportedError:
                continue
        return None

    def _perf_level(self) -> str | None:
        try:
            return api.perf_level_name(
                self._call("amdsmi_get_gpu_perf_level", self._handle, operation="details")
            )
        except PowerlibError as err:
            logger.debug("%s: %s", self._gpu.device_id, err)
            return None

    # -- reads -----------------------------------------------------------------------------------

    def _read_state(self) -> PowerState:
        """Read power, energy, GFX clock, power cap and temperature; no privilege needed.

        Reads: amdsmi_get_power_info (W), amdsmi_get_energy_count (ticks × µJ),
        amdsmi_get_clock_info GFX (MHz), amdsmi_get_power_cap_info (µW),
        amdsmi_get_temp_metric (°C).
        """
        op = "read_state"
        caps = self.info.capabilities
        power_w = None
        if caps.has_power_reading:
            picked = api.pick_power(self._call("amdsmi_get_power_info", self._handle, operation=op))
            power_w = None if picked is None else picked[1]
        energy_j = None
        if self._energy is not None:
            raw_uj = self._read_energy_uj(op)
            if raw_uj is None:
                raise DeviceError(
                    "amdsmi_get_energy_count returned no usable value",
                    device=self.device_id,
                    operation=op,
                )
            energy_j = self._energy.update(raw_uj)
        sm_freq_mhz = None
        if self._has_clock_info:
            clock = self._call("amdsmi_get_clock_info", self._handle, self._gfx, operation=op)
            sm_freq_mhz = api.number((clock or {}).get("clk"))
        power_limit_w = None
        if caps.can_set_power_limit:
            cap_info = self._call("amdsmi_get_power_cap_info", self._handle, operation=op)
            cap_uw = api.number((cap_info or {}).get("power_cap"))
            power_limit_w = None if cap_uw is None else from_uw(cap_uw)
        temperature_c = None
        if self._temp_sensor is not None:
            temperature_c = self._read_temperature_c(self._temp_sensor, op)
        return PowerState(
            device_id=self.device_id,
            timestamp_s=time.time(),
            power_w=power_w,
            energy_j=energy_j,
            sm_freq_mhz=sm_freq_mhz,
            power_limit_w=power_limit_w,
            temperature_c=temperature_c,
            locked_sm_freqs_mhz=self._locked_mhz,
        )

    def _read_sm_lock(self) -> ClockLockState:
        """Whether the driver holds the GFX clock, and the clock now (docs/real-gpu.md §1).

        Reads: amdsmi_get_gpu_perf_level, amdsmi_get_clock_info GFX (``clk``, ``clk_locked``;
        MHz). amdsmi reports no locked range, so ``range_mhz`` is ``None``.
        """
        op = "read_sm_lock"
        level = None
        with contextlib.suppress(NotSupportedError):
            level = api.perf_level_name(
                self._call("amdsmi_get_gpu_perf_level", self._handle, operation=op)
            )
        clock: Mapping[str, Any] = {}
        if self._has_clock_info:
            clock = self._call("amdsmi_get_clock_info", self._handle, self._gfx, operation=op) or {}
        locked: bool | None
        if level == "auto":
            locked = False
        elif level not in (None, "unknown"):
            locked = True  # MANUAL (a clock range), DETERMINISM, or a level forced by someone else
        else:
            locked = True if clock.get("clk_locked") is True else None  # "N/A" or False: unknown
        return ClockLockState(locked=locked, running_mhz=api.number(clock.get("clk")))

    def details(self) -> Mapping[str, object]:
        """Index spaces, identity, perf level, clock lock, DPM levels, power caps, sources.

        Reads: amdsmi_get_gpu_perf_level, amdsmi_get_clk_freq (GFX), amdsmi_get_power_cap_info.
        """
        gpu = self._gpu
        perf_level = self._perf_level()
        freq = None
        with contextlib.suppress(PowerlibError):
            freq = self._call("amdsmi_get_clk_freq", self._handle, self._gfx, operation="details")
        caps = None
        with contextlib.suppress(PowerlibError):
            caps = self._call("amdsmi_get_power_cap_info", self._handle, operation="details")
        out: dict[str, object] = {
            "amdsmi_index": gpu.smi_index,
            "hip_index": gpu.hip_id,
            "device_order": self._order_source,
            "bdf": gpu.bdf,
            "uuid": gpu.uuid,
            "hip_uuid": gpu.hip_uuid,
            "num_compute_units": api.int_or_none(self._asic.get("num_compute_units")),
            "target_graphics_version": api.text(self._asic.get("target_graphics_version")),
            "perf_level": perf_level,
            "clock_lock": None
            if self._locked_mhz is None
            else {
                "mode": self._lock_mode,
                "min_mhz": self._locked_mhz[0],
                "max_mhz": self._locked_mhz[1],
            },
            "gfx_dpm_levels_mhz": api.dpm_levels_mhz(freq),
            "power_cap_w": None,
            "power_reading": self._power_field,
            "temperature_sensor": None
            if self._temp_sensor is None
            else getattr(self._temp_sensor, "name", str(self._temp_sensor)).lower(),
            "energy_counter": self._energy is not None,
            "amdsmi_lib_version": self._lib_version,
            "amdsmi_wrapper_version": api.text(getattr(self._smi, "__version__", None)),
        }
        if caps:
            out["power_cap_w"] = {
                key: None if (uw := api.number(caps.get(src))) is None else from_uw(uw)
                for key, src in (
                    ("current", "power_cap"),
                    ("default", "default_power_cap"),
                    ("min", "min_power_cap"),
                    ("max", "max_power_cap"),
                )
            }
            out["dpm_cap_mhz"] = api.number(caps.get("dpm_cap"))
        if perf_level not in (None, "auto") and self._locked_mhz is None:
            out["note"] = (
                f"perf level {perf_level} was set outside this process: clocks may be "
                "constrained; reset_sm_clocks returns the GPU to auto"
            )
        return out

    # -- writes ----------------------------------------------------------------------------------

    def _lock_sm_clocks(self, min_mhz: float, max_mhz: float) -> None:
        """Writes: amdsmi_set_gpu_clk_range(GFX, MHz) (root), which sets the perf level to MANUAL.

        Where the range call is not supported and ``min == max``, falls back to
        amdsmi_set_gpu_perf_determinism_mode (MHz; root): the firmware holds a steady clock at or
        below the value.
        """
        op = "lock_sm_clocks"
        lo_mhz, hi_mhz = int(round(min_mhz)), int(round(max_mhz))
        try:
            self._call(
                "amdsmi_set_gpu_clk_range", self._handle, lo_mhz, hi_mhz, self._gfx, operation=op
            )
            mode = "clk_range"
        except NotSupportedError as err:
            if lo_mhz != hi_mhz:
                raise NotSupportedError(
                    f"{err.message}; this GPU cannot take a GFX clock range, only a single clock "
                    "(through performance determinism): lock min = max",
                    device=self.device_id,
                    operation=op,
                    vendor_code=err.vendor_code,
                ) from err
            logger.info(
                "%s: clock range not supported; using performance determinism at %d MHz",
                self.device_id,
                hi_mhz,
            )
            self._call("amdsmi_set_gpu_perf_determinism_mode", self._handle, hi_mhz, operation=op)
            mode = "determinism"
        self._locked_mhz, self._lock_mode = (min_mhz, max_mhz), mode

    def _reset_sm_clocks(self) -> None:
        """Writes: amdsmi_set_gpu_perf_level(AUTO) (root); resets every clock domain at once."""
        self._call(
            "amdsmi_set_gpu_perf_level", self._handle, self._perf_auto, operation="reset_sm_clocks"
        )
        self._locked_mhz, self._lock_mode = None, None

    def _set_power_limit(self, power_limit_w: float) -> float:
        """Writes: amdsmi_set_power_cap(sensor 0, µW) (root), verified with amdsmi_get_power_cap_info.

        Raises:
            DeviceError: The cap read back differs from the request by more than 1 W.
        """
        op = "set_power_limit"

        def read_back() -> float | None:
            caps = self._call("amdsmi_get_power_cap_info", self._handle, operation=op)
            readback_uw = api.number((caps or {}).get("power_cap"))
            return None if readback_uw is None else from_uw(readback_uw)

        return write_power_limit(
            power_limit_w,
            lambda: self._call(
                "amdsmi_set_power_cap", self._handle, 0, to_uw(power_limit_w), operation=op
            ),
            read_back,
            device_id=self.device_id,
            what="power cap",
        )

    def _reset_power_limit(self) -> None:
        """Writes: the default cap (``default_power_cap`` of amdsmi_get_power_cap_info) as the cap."""
        assert self.info.default_power_limit_w is not None  # capability checked
        self._set_power_limit(self.info.default_power_limit_w)


# -- backend ---------------------------------------------------------------------------------------


class AmdBackend(Backend):
    """The AMD GPUs visible to this process, in HIP order (see :mod:`._amd_enumeration`).

    Args:
        settings: Visibility variables (``ROCR_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES``).
        smi: The amdsmi module; defaults to :func:`~powerlib.backends._amd_api.import_amdsmi`. Tests pass a fake.

    Raises:
        BackendUnavailableError: No wrapper or library, amdsmi failed to start, or no AMD GPU.
        ConfigError: A visibility variable names no GPU, several, or one twice.
    """

    name: ClassVar[str] = "amd"
    install_hint: ClassVar[str] = api.INSTALL_HINT

    def __init__(self, settings: Settings, smi: ModuleType | None = None) -> None:
        super().__init__(settings)
        self._smi: Any = api.import_amdsmi() if smi is None else smi
        self._devices: tuple[AmdDevice, ...] = ()
        api.acquire(self._smi)
        self._is_open = True
        try:
            lib_version = api.lib_version(self._smi)
            found = enumerate_gpus(self._smi, settings)
            if not found.gpus:
                raise BackendUnavailableError(
                    "amdsmi started but found no AMD GPU: check that the amdgpu driver is loaded "
                    "and that /dev/kfd and /dev/dri are accessible"
                )
            self._devices = tuple(
                AmdDevice(
                    self._smi,
                    gpu,
                    index=k,
                    order_source=found.order_source,
                    lib_version=lib_version,
                )
                for k, gpu in enumerate(found.visible)
            )
        except BaseException:
            self.close()
            raise
        logger.info(
            "amd backend: %d of %d GPU(s) visible (amdsmi library %s)",
            len(self._devices),
            len(found.gpus),
            lib_version or "version unknown",
        )

    @classmethod
    def probe(cls, settings: Settings) -> ProbeResult:
        """Import amdsmi, initialise it and count visible GPUs; never raises."""
        try:
            smi = api.import_amdsmi()
            api.acquire(smi)
            try:
                found = enumerate_gpus(smi, settings)
            finally:
                api.release(smi)
        except PowerlibError as err:
            return ProbeResult(backend=cls.name, is_available=False, reason=err.message)
        except Exception as err:  # noqa: BLE001 - probe must never raise
            reason = f"amdsmi probe failed: {type(err).__name__}: {api.one_line(err)}"
            return ProbeResult(backend=cls.name, is_available=False, reason=reason)
        if not found.gpus:
            reason = "amdsmi started but found no AMD GPU (is the amdgpu driver loaded?)"
            return ProbeResult(backend=cls.name, is_available=False, reason=reason)
        if not found.visible:
            reason = (
                f"amdsmi found {len(found.gpus)} AMD GPU(s), but ROCR_VISIBLE_DEVICES / "
                "HIP_VISIBLE_DEVICES hide all of them"
            )
            return ProbeResult(backend=cls.name, is_available=False, reason=reason)
        return ProbeResult(
            backend=cls.name,
            is_available=True,
            reason=(
                f"amdsmi found {len(found.gpus)} AMD GPU(s), {len(found.visible)} visible "
                f"(HIP order from {found.order_source})"
            ),
            num_devices=len(found.visible),
        )

    def devices(self) -> Sequence[AmdDevice]:
        """The visible GPUs, in HIP order."""
        return self._devices

    def control_refusal(self) -> str | None:
        """Why this process may not change AMD GPUs: not root, or no ``CAP_SYS_ADMIN``.

        amdsmi setters are refused otherwise (docs/real-gpu.md §5).
        """
        return admin_refusal("AMD GPU clocks and power caps", _PROC_STATUS_PATH)

    def close(self) -> None:
        """Shut amdsmi down (once; device settings are left as they are)."""
        if getattr(self, "_is_open", False):
            self._is_open = False
            for dev in self._devices:
                dev.close()
            api.release(self._smi)
