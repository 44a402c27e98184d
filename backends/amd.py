"""AMD GPUs through ``amdsmi`` (the ROCm SMI library's Python wrapper; extra ``amd``).

Importing ``amdsmi`` without ROCm prints to stdout and raises ``KeyError``; with a library that
lacks a symbol it raises ``AttributeError``. :func:`import_amdsmi` swallows the stdout noise (it
would corrupt ``--json`` output) and turns every failure into ``BackendUnavailableError`` with a
hint. The module can also be passed in (``AmdBackend(settings, smi=fake)``); tests use
:mod:`powerlib.testing.fake_amdsmi`.

Every amdsmi call goes through :func:`_call`: it holds one process-wide lock (``libamd_smi`` is not
thread-safe before ROCm 7.2), retries ``AMDSMI_STATUS_RETRY`` once, and is the one place where
amdsmi exceptions become powerlib errors (the status code is kept as ``vendor_code``).
``AMDSMI_STATUS_NOT_FOUND`` means ``DeviceNotFoundError`` while enumerating and ``DeviceLostError``
on a GPU that was already open.
``amdsmi_init`` / ``amdsmi_shut_down`` are reference-counted per module, so a probe or a second
backend in the same process never shuts the library down under an open one.

Index spaces. Three numberings of the same GPUs disagree on some nodes (on an MI350X node HIP's
device 0 is amd-smi's GPU 3):

* **amd-smi index**: the position in ``amdsmi_get_processor_handles()``, which is PCI BDF order.
  Only ``details()["amdsmi_index"]`` uses it.
* **HIP index**: what ``HIP_VISIBLE_DEVICES``, ``torch.cuda`` (``cuda:N`` on ROCm) and the
  ``--device N`` of powerlib use. It is read from ``amdsmi_get_gpu_enumeration_info()["hip_id"]``
  (ROCm 6.4+); without that call the handles are sorted by KFD node id
  (``amdsmi_get_gpu_kfd_info()["node_id"]``), which is the order the ROCr runtime enumerates in;
  failing both, BDF order is used and a warning says so. ``details()["device_order"]`` names the
  source.
* The OAM slot (``asic_info["oam_id"]``) is not used.

Visibility follows the runtime: ``ROCR_VISIBLE_DEVICES`` is applied first (ordinals in HIP order,
or UUIDs), then ``HIP_VISIBLE_DEVICES`` relative to what ROCr left. UUID tokens are matched against
HIP's UUID (``hip_uuid``, ``GPU-…``) when amdsmi reports it, else against amd-smi's UUID. Set to the
empty string, either variable hides every GPU. ``DeviceInfo.index`` is the position in the final
list, so device 0 is the GPU the framework calls device 0. ``device_id`` is amd-smi's UUID
(the PCI BDF when the UUID cannot be read or is shared by several devices).

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
* amdsmi cannot read a lock back reliably: ``PowerState.locked_sm_freqs_mhz`` is the lock this
  process applied. A perf level other than AUTO set by someone else shows in ``details()``.

Privileges: every setter needs root; in a container also access to ``/dev/kfd`` and ``/dev/dri``
and a writable ``/sys``. Clock and power-cap control work on bare metal (and single-VF SR-IOV
guests for the cap), not on VM guests in general, which answer NOT_SUPPORTED.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

from powerlib.backends._visible import select_visible
from powerlib.config import Settings
from powerlib.device import (
    Backend,
    Capabilities,
    Device,
    DeviceInfo,
    DeviceKind,
    PowerState,
    ProbeResult,
)
from powerlib.errors import (
    BackendUnavailableError,
    DeviceBusyError,
    DeviceError,
    DeviceLostError,
    DeviceNotFoundError,
    InvalidArgumentError,
    NotSupportedError,
    PermissionDeniedError,
    PowerlibError,
)
from powerlib.units import from_uj, from_uw, to_uw

__all__ = ["AmdBackend", "AmdDevice", "import_amdsmi"]

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "install ROCm (libamd_smi.so) and its amdsmi Python wrapper, or pip install 'powerlib[amd]'"
)

_PERMISSION_HINT = (
    "needs root; in a container also access to /dev/kfd and /dev/dri "
    "(--device /dev/kfd --device /dev/dri) and a writable /sys "
    "(-v /sys:/sys --security-opt apparmor=unconfined)"
)
_UNAVAILABLE_HINT = (
    f"check that the amdgpu driver is loaded and ROCm matches the wrapper; {INSTALL_HINT}"
)

# AMDSMI_STATUS_* (amdsmi_wrapper.py, 7.0.2) -> powerlib error class and what to tell the user.
_STATUS: dict[int, tuple[type[PowerlibError], str]] = {
    1: (InvalidArgumentError, "amdsmi rejected an argument"),
    2: (
        NotSupportedError,
        "not supported by this GPU, driver or platform (VM guests cannot change clocks or caps)",
    ),
    3: (NotSupportedError, "not implemented by this amdsmi version"),
    4: (BackendUnavailableError, f"amdsmi could not load a module it needs; {_UNAVAILABLE_HINT}"),
    5: (
        BackendUnavailableError,
        "libamd_smi.so lacks a symbol: the amdsmi wrapper and the ROCm library differ; install "
        "the wrapper shipped with your ROCm (/opt/rocm/share/amd_smi)",
    ),
    8: (DeviceBusyError, "the call timed out; the GPU or driver is busy"),
    9: (DeviceBusyError, "the library asked to retry, and the retry failed too"),
    10: (PermissionDeniedError, _PERMISSION_HINT),
    17: (InvalidArgumentError, "a value is out of bounds"),
    18: (BackendUnavailableError, f"amdsmi failed to initialise; {_UNAVAILABLE_HINT}"),
    30: (DeviceBusyError, "the GPU is busy"),
    31: (
        DeviceNotFoundError,
        "the GPU was not found (removed, reset, or hidden from this process)",
    ),
    32: (BackendUnavailableError, "amdsmi is not initialised"),
    34: (BackendUnavailableError, "the amdgpu kernel driver is not loaded"),
    53: (InvalidArgumentError, "amdsmi rejected an argument"),
    55: (NotSupportedError, "this setting is not available on this GPU or platform"),
}
for _code in range(45, 52):  # NO_ENERGY_DRV ... NO_DRV: energy, MSR or HSMP driver problems
    _STATUS[_code] = (
        BackendUnavailableError,
        "an AMD energy, MSR or HSMP driver is missing or not answering",
    )
del _code

_RETRY = 9
_NOT_FOUND = 31
_RETRY_DELAY_S = 0.005
_GRID_STEP_MHZ = 50.0
_READBACK_TOLERANCE_W = 1.0
_SENTINELS = frozenset({0xFFFF, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF})  # "no value" in amdsmi structs
_MIN_PLAUSIBLE_CAP_UW = 1_000_000  # a maximum cap under 1 W means the unit is not µW
_HZ_PER_MHZ = 1e6
_MILLIDEGREE_THRESHOLD = 1000.0  # no GPU reports 1000 °C: larger values are m°C

# One lock for every amdsmi call in the process: libamd_smi is not thread-safe before ROCm 7.2.
_SMI_LOCK = threading.Lock()
# amdsmi_init references held by powerlib, per module object (taken before _SMI_LOCK, never after).
_INIT_LOCK = threading.Lock()
_INIT_COUNTS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def import_amdsmi() -> ModuleType:
    """Import ``amdsmi`` with its stdout noise captured.

    Raises:
        BackendUnavailableError: Not installed, or the ROCm library is missing or mismatched.
    """
    noise = io.StringIO()
    try:
        with contextlib.redirect_stdout(noise):
            import amdsmi  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415 - lazy
    except ImportError as err:
        raise BackendUnavailableError(
            f"the amdsmi module is not installed: {INSTALL_HINT}"
        ) from err
    except (OSError, KeyError) as err:
        detail = noise.getvalue().strip().splitlines()
        raise BackendUnavailableError(
            "amdsmi cannot load libamd_smi.so"
            + (f" ({detail[0]})" if detail else "")
            + f": {INSTALL_HINT}; set ROCM_PATH if ROCm is installed elsewhere"
        ) from err
    except AttributeError as err:
        raise BackendUnavailableError(
            f"amdsmi does not match the installed libamd_smi.so ({err}); install the wrapper "
            "shipped with your ROCm (/opt/rocm/share/amd_smi)"
        ) from err
    module: ModuleType = amdsmi
    return module


# -- the one call and translation point ----------------------------------------------------------


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:200]


def _is_instance(err: BaseException, smi: Any, class_name: str) -> bool:
    cls = getattr(smi, class_name, None)
    return isinstance(cls, type) and isinstance(err, cls)


def _status_code(smi: Any, err: BaseException) -> int | None:
    if not _is_instance(err, smi, "AmdSmiLibraryException"):
        return None
    try:
        code = err.get_error_code()  # type: ignore[attr-defined]
    except Exception:  # a wrapper without the method: fall back to the attribute
        code = getattr(err, "err_code", None)
    return int(code) if isinstance(code, int) else None


def _translate(
    smi: Any, err: Exception, name: str, device: str | None, operation: str | None
) -> PowerlibError:
    """Turn anything an amdsmi call raised into a powerlib error."""
    context: dict[str, Any] = {"device": device, "operation": operation}
    code = _status_code(smi, err)
    if code is not None:
        cls, hint = _STATUS.get(code, (DeviceError, "amdsmi reported an error"))
        if code == _NOT_FOUND and device is not None:  # an open GPU that stopped answering
            cls, hint = DeviceLostError, "the GPU is gone: it fell off the bus or was reset"
        try:
            status = " ".join(str(err.get_error_info(detailed=False)).split())  # type: ignore[attr-defined]
        except Exception:  # older wrappers
            status = f"status {code}"
        return cls(f"{name}: {status}: {hint}", vendor_code=code, **context)
    if _is_instance(err, smi, "AmdSmiParameterException"):
        return InvalidArgumentError(f"{name} rejected an argument: {_one_line(err)}", **context)
    if _is_instance(err, smi, "AmdSmiException"):
        return DeviceError(f"{name} failed: {_one_line(err)}", **context)
    if isinstance(err, AttributeError) and not hasattr(smi, name):
        return NotSupportedError(
            f"this amdsmi wrapper has no {name} (it is older than the call); install the wrapper "
            "shipped with your ROCm (/opt/rocm/share/amd_smi)",
            **context,
        )
    return DeviceError(
        f"{name} raised {type(err).__name__}: {_one_line(err)} (an amdsmi wrapper bug?)", **context
    )


def _call(
    smi: Any, name: str, *args: Any, device: str | None = None, operation: str | None = None
) -> Any:
    """Call ``smi.<name>(*args)`` under the process-wide lock; retry RETRY once; translate errors.

    Raises:
        PowerlibError: The translated failure, chained to the amdsmi exception.
    """
    try:
        with _SMI_LOCK:
            return getattr(smi, name)(*args)
    except Exception as err:
        if _status_code(smi, err) != _RETRY:
            raise _translate(smi, err, name, device, operation) from err
        logger.debug("%s asked to retry; retrying once", name)
    time.sleep(_RETRY_DELAY_S)
    try:
        with _SMI_LOCK:
            return getattr(smi, name)(*args)
    except Exception as err:
        raise _translate(smi, err, name, device, operation) from err


def _enum(smi: Any, enum_name: str, member: str) -> Any:
    """``smi.<enum_name>.<member>``, or BackendUnavailableError for a mismatched wrapper."""
    try:
        return getattr(getattr(smi, enum_name), member)
    except AttributeError as err:
        raise BackendUnavailableError(
            f"this amdsmi wrapper has no {enum_name}.{member}; install the wrapper shipped with "
            "your ROCm (/opt/rocm/share/amd_smi)"
        ) from err


def _acquire(smi: Any) -> None:
    """``amdsmi_init`` on the first reference to ``smi`` in this process."""
    with _INIT_LOCK:
        count = _INIT_COUNTS.get(smi, 0)
        if count == 0:
            flag = _enum(smi, "AmdSmiInitFlags", "INIT_AMD_GPUS")
            try:
                _call(smi, "amdsmi_init", flag, operation="init")
            except PowerlibError as err:
                raise BackendUnavailableError(
                    f"amdsmi could not start: {err.message}", vendor_code=err.vendor_code
                ) from err
        _INIT_COUNTS[smi] = count + 1


def _release(smi: Any) -> None:
    """``amdsmi_shut_down`` when the last reference to ``smi`` goes."""
    with _INIT_LOCK:
        count = _INIT_COUNTS.get(smi, 0) - 1
        if count > 0:
            _INIT_COUNTS[smi] = count
            return
        _INIT_COUNTS.pop(smi, None)
        try:
            _call(smi, "amdsmi_shut_down", operation="close")
        except PowerlibError as err:
            logger.debug("amdsmi_shut_down failed: %s", err)


# -- value parsing ---------------------------------------------------------------------------------


def _number(value: object) -> float | None:
    """A finite number from an amdsmi dict, or ``None`` for ``"N/A"`` and all-ones sentinels."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int) and value in _SENTINELS:
        return None
    return float(value) if math.isfinite(value) else None


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if not isinstance(value, str):
        return None
    value = value.strip()
    return value if value and value != "N/A" else None


def _int_or_none(value: object) -> int | None:
    number = _number(value)
    return int(number) if number is not None and number == int(number) else None


def _gfx_grid_mhz(min_mhz: float, max_mhz: float) -> tuple[float, ...]:
    """Both ends plus every multiple of 50 MHz strictly between them."""
    inner = range(
        int(math.floor(min_mhz / _GRID_STEP_MHZ)) + 1, int(math.ceil(max_mhz / _GRID_STEP_MHZ))
    )
    points = {min_mhz, max_mhz, *(k * _GRID_STEP_MHZ for k in inner)}
    return tuple(sorted(p for p in points if min_mhz <= p <= max_mhz))


def _pick_power(info: Mapping[str, Any] | None) -> tuple[str, float] | None:
    """``(field, W)``: current socket power when valid, else the average."""
    if not info:
        return None
    current = _number(info.get("current_socket_power"))
    average = _number(info.get("average_socket_power"))
    if current is not None and current > 0:
        return "current_socket_power", current
    if average is not None and average >= 0:
        return "average_socket_power", average
    if current is not None and current >= 0:
        return "current_socket_power", current
    return None


def _perf_level_name(value: object) -> str | None:
    text = _text(value)
    return None if text is None else text.removeprefix("AMDSMI_DEV_PERF_LEVEL_").lower()


def _dpm_levels_mhz(freq: Mapping[str, Any] | None) -> list[float] | None:
    """DPM levels in MHz; the C struct holds Hz, but accept MHz from other builds."""
    if not freq:
        return None
    values = [v for v in (_number(x) for x in freq.get("frequency") or []) if v is not None]
    if not values:
        return None
    scale = _HZ_PER_MHZ if max(values) > 100_000 else 1.0
    return [round(v / scale, 3) for v in values]


# -- enumeration -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Gpu:
    """Identity of one GPU, read for every handle (visible or not)."""

    handle: Any
    smi_index: int  # amd-smi order (PCI BDF)
    bdf: str
    uuid: str | None  # amd-smi's UUID
    hip_uuid: str | None
    hip_id: int | None
    device_id: str

    @property
    def visibility_uuid(self) -> str:
        """What ``*_VISIBLE_DEVICES`` UUID tokens are matched against."""
        return self.hip_uuid or self.uuid or self.bdf


@dataclass(frozen=True, slots=True)
class _Enumeration:
    gpus: list[_Gpu]  # every GPU, in HIP order
    visible: list[_Gpu]  # after ROCR_VISIBLE_DEVICES, then HIP_VISIBLE_DEVICES
    order_source: str


def _soft(smi: Any, name: str, *args: Any) -> Any:
    try:
        return _call(smi, name, *args, operation="enumerate")
    except PowerlibError as err:
        logger.debug("%s failed during enumeration: %s", name, err)
        return None


def _enumerate(smi: Any, settings: Settings) -> _Enumeration:
    handles = list(_call(smi, "amdsmi_get_processor_handles", operation="enumerate") or [])
    raw = []
    for i, handle in enumerate(handles):
        bdf = _text(_call(smi, "amdsmi_get_gpu_device_bdf", handle, operation="enumerate"))
        uuid = _text(_soft(smi, "amdsmi_get_gpu_device_uuid", handle))
        info = _soft(smi, "amdsmi_get_gpu_enumeration_info", handle) or {}
        raw.append((handle, i, bdf or f"amdsmi-{i}", uuid, info))
    uuid_counts: dict[str | None, int] = {}
    for *_, uuid, _info in raw:
        uuid_counts[uuid] = uuid_counts.get(uuid, 0) + 1
    gpus = [
        _Gpu(
            handle=handle,
            smi_index=i,
            bdf=bdf,
            uuid=uuid,
            hip_uuid=_text(info.get("hip_uuid")),
            hip_id=_int_or_none(info.get("hip_id")),
            device_id=uuid if uuid is not None and uuid_counts[uuid] == 1 else bdf,
        )
        for handle, i, bdf, uuid, info in raw
    ]
    ordered, source = _hip_order(smi, gpus)
    rocr = select_visible(
        settings.rocr_visible_devices,
        [g.visibility_uuid for g in ordered],
        "ROCR_VISIBLE_DEVICES",
    )
    after_rocr = [ordered[i] for i in rocr]
    hip = select_visible(
        settings.hip_visible_devices,
        [g.visibility_uuid for g in after_rocr],
        "HIP_VISIBLE_DEVICES",
    )
    return _Enumeration(ordered, [after_rocr[i] for i in hip], source)


def _hip_order(smi: Any, gpus: list[_Gpu]) -> tuple[list[_Gpu], str]:
    """The GPUs in HIP order, and where that order came from (see the module docstring)."""
    hip_ids = [g.hip_id for g in gpus]
    if None not in hip_ids and len(set(hip_ids)) == len(gpus):
        source = "hip_id (amdsmi_get_gpu_enumeration_info)"
        ordered = sorted(gpus, key=lambda g: g.hip_id or 0)
    else:
        nodes = [
            _int_or_none((_soft(smi, "amdsmi_get_gpu_kfd_info", g.handle) or {}).get("node_id"))
            for g in gpus
        ]
        if None not in nodes and len(set(nodes)) == len(gpus):
            source = "KFD node id (amdsmi_get_gpu_kfd_info)"
            by_node = dict(zip((id(g) for g in gpus), nodes))
            ordered = sorted(gpus, key=lambda g: by_node[id(g)] or 0)
        else:
            source = "PCI BDF (amd-smi order)"
            ordered = list(gpus)
            if len(gpus) > 1:
                logger.warning(
                    "amdsmi reports neither HIP ids nor KFD node ids: GPUs are numbered in PCI BDF "
                    "order, which HIP may not follow; list GPU UUIDs in HIP_VISIBLE_DEVICES to "
                    "be sure which GPU is which"
                )
    logger.info("amd: %d GPU(s), HIP order from %s", len(gpus), source)
    return ordered, source


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
        gpu: _Gpu,
        index: int,
        *,
        order_source: str = "",
        lib_version: str | None = None,
    ) -> None:
        self._smi, self._gpu, self._handle = smi, gpu, gpu.handle
        self._order_source, self._lib_version = order_source, lib_version
        self._gfx = _enum(smi, "AmdSmiClkType", "GFX")
        self._perf_auto = _enum(smi, "AmdSmiDevPerfLevel", "AUTO")
        self._temp_current = _enum(smi, "AmdSmiTemperatureMetric", "CURRENT")
        self._locked_mhz: tuple[float, float] | None = None
        self._lock_mode: str | None = None
        asic = self._optional("amdsmi_get_gpu_asic_info", self._handle) or {}
        clock = self._optional("amdsmi_get_clock_info", self._handle, self._gfx)
        self._has_clock_info = clock is not None
        gfx_min, gfx_max = (
            _number((clock or {}).get("min_clk")),
            _number((clock or {}).get("max_clk")),
        )
        freqs: tuple[float, ...] = ()
        if gfx_min is not None and gfx_max is not None and 0 < gfx_min <= gfx_max:
            freqs = _gfx_grid_mhz(gfx_min, gfx_max)
        range_w, default_w = self._power_cap_facts()
        self._energy = self._open_energy()
        picked = _pick_power(self._optional("amdsmi_get_power_info", self._handle))
        self._power_field = None if picked is None else picked[0]
        self._temp_sensor = self._detect_temperature_sensor()
        self._asic = {k: asic.get(k) for k in ("num_compute_units", "target_graphics_version")}
        super().__init__(
            DeviceInfo(
                device_id=gpu.device_id,
                index=index,
                name=_text(asic.get("market_name")) or "AMD GPU",
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
        return _call(self._smi, name, *args, device=self._gpu.device_id, operation=operation)

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
        max_uw = _number(caps.get("max_power_cap"))
        if max_uw is None or max_uw < _MIN_PLAUSIBLE_CAP_UW:
            logger.warning(
                "%s: amdsmi reports a maximum power cap of %r, not a plausible µW value; power "
                "capping is disabled for this GPU",
                self._gpu.device_id,
                caps.get("max_power_cap"),
            )
            return None, None
        min_uw = _number(caps.get("min_power_cap")) or 0.0
        range_w = (from_uw(min(min_uw, max_uw)), from_uw(max_uw))
        default_uw = _number(caps.get("default_power_cap"))
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
        resolution_uj = _number(reading.get("counter_resolution"))
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
        value = _number(
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
            return _perf_level_name(
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
            picked = _pick_power(self._call("amdsmi_get_power_info", self._handle, operation=op))
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
            sm_freq_mhz = _number((clock or {}).get("clk"))
        power_limit_w = None
        if caps.can_set_power_limit:
            cap_info = self._call("amdsmi_get_power_cap_info", self._handle, operation=op)
            cap_uw = _number((cap_info or {}).get("power_cap"))
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
            "num_compute_units": _int_or_none(self._asic.get("num_compute_units")),
            "target_graphics_version": _text(self._asic.get("target_graphics_version")),
            "perf_level": perf_level,
            "clock_lock": None
            if self._locked_mhz is None
            else {
                "mode": self._lock_mode,
                "min_mhz": self._locked_mhz[0],
                "max_mhz": self._locked_mhz[1],
            },
            "gfx_dpm_levels_mhz": _dpm_levels_mhz(freq),
            "power_cap_w": None,
            "power_reading": self._power_field,
            "temperature_sensor": None
            if self._temp_sensor is None
            else getattr(self._temp_sensor, "name", str(self._temp_sensor)).lower(),
            "energy_counter": self._energy is not None,
            "amdsmi_lib_version": self._lib_version,
            "amdsmi_wrapper_version": _text(getattr(self._smi, "__version__", None)),
        }
        if caps:
            out["power_cap_w"] = {
                key: None if (uw := _number(caps.get(src))) is None else from_uw(uw)
                for key, src in (
                    ("current", "power_cap"),
                    ("default", "default_power_cap"),
                    ("min", "min_power_cap"),
                    ("max", "max_power_cap"),
                )
            }
            out["dpm_cap_mhz"] = _number(caps.get("dpm_cap"))
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
        self._call("amdsmi_set_power_cap", self._handle, 0, to_uw(power_limit_w), operation=op)
        caps = self._call("amdsmi_get_power_cap_info", self._handle, operation=op)
        readback_uw = _number((caps or {}).get("power_cap"))
        if readback_uw is None:
            raise DeviceError(
                "the power cap could not be read back after setting it",
                device=self.device_id,
                operation=op,
            )
        readback_w = from_uw(readback_uw)
        if abs(readback_w - power_limit_w) > _READBACK_TOLERANCE_W:
            raise DeviceError(
                f"the power cap did not take effect: asked {power_limit_w:g} W, the GPU reports "
                f"{readback_w:g} W",
                device=self.device_id,
                operation=op,
            )
        return readback_w

    def _reset_power_limit(self) -> None:
        """Writes: the default cap (``default_power_cap`` of amdsmi_get_power_cap_info) as the cap."""
        assert self.info.default_power_limit_w is not None  # capability checked
        self._set_power_limit(self.info.default_power_limit_w)


# -- backend ---------------------------------------------------------------------------------------


def _lib_version(smi: Any) -> str | None:
    version = _soft(smi, "amdsmi_get_lib_version")
    if not isinstance(version, Mapping):
        return None
    parts = [version.get(k) for k in ("major", "minor", "release")]
    if not all(isinstance(p, int) for p in parts):
        return None
    return ".".join(str(p) for p in parts)


class AmdBackend(Backend):
    """The AMD GPUs visible to this process, in HIP order (see the module docstring).

    Args:
        settings: Visibility variables (``ROCR_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES``).
        smi: The amdsmi module; defaults to :func:`import_amdsmi`. Tests pass a fake.

    Raises:
        BackendUnavailableError: No wrapper or library, amdsmi failed to start, or no AMD GPU.
        ConfigError: A visibility variable names no GPU, several, or one twice.
    """

    name: ClassVar[str] = "amd"
    install_hint: ClassVar[str] = INSTALL_HINT

    def __init__(self, settings: Settings, smi: ModuleType | None = None) -> None:
        super().__init__(settings)
        self._smi: Any = import_amdsmi() if smi is None else smi
        self._devices: tuple[AmdDevice, ...] = ()
        _acquire(self._smi)
        self._is_open = True
        try:
            lib_version = _lib_version(self._smi)
            found = _enumerate(self._smi, settings)
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
            smi = import_amdsmi()
            _acquire(smi)
            try:
                found = _enumerate(smi, settings)
            finally:
                _release(smi)
        except PowerlibError as err:
            return ProbeResult(backend=cls.name, is_available=False, reason=err.message)
        except Exception as err:  # probe must never raise
            reason = f"amdsmi probe failed: {type(err).__name__}: {_one_line(err)}"
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

    def close(self) -> None:
        """Shut amdsmi down (once; device settings are left as they are)."""
        if getattr(self, "_is_open", False):
            self._is_open = False
            for dev in self._devices:
                dev.close()
            _release(self._smi)
