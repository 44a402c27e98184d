"""The amdsmi call point: import, one lock, retries, error translation, init counts and value parsing.

Every amdsmi call goes through :func:`call`: it holds one process-wide lock (``libamd_smi`` is not
thread-safe before ROCm 7.2), retries ``AMDSMI_STATUS_RETRY`` once, and is the one place where
amdsmi exceptions become powerlib errors (the status code is kept as ``vendor_code``).
``TIMEOUT``, ``RETRY`` (after its retry) and ``BUSY`` become ``TransientDeviceError``, which the
device layer retries a bounded number of times for writes (docs/real-gpu.md §2).
``AMDSMI_STATUS_NOT_FOUND`` means ``DeviceNotFoundError`` while enumerating and ``DeviceLostError``
on a GPU that was already open.
``amdsmi_init`` / ``amdsmi_shut_down`` are reference-counted per module, so a probe or a second
backend in the same process never shuts the library down under an open one.

Units at this edge: power caps µW (bare-metal Linux), socket power W, energy ticks × µJ per tick,
clocks MHz, temperature °C; the parsers here return numbers in those units, or ``None`` for
amdsmi's "no value" markers (``"N/A"``, all-ones sentinels).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import threading
import time
import weakref
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from powerlib.errors import (
    BackendUnavailableError,
    DeviceError,
    DeviceLostError,
    DeviceNotFoundError,
    InvalidArgumentError,
    NotSupportedError,
    PermissionDeniedError,
    PowerlibError,
    TransientDeviceError,
)

__all__ = [
    "INSTALL_HINT",
    "NOT_FOUND",
    "RETRY",
    "STATUS",
    "acquire",
    "call",
    "dpm_levels_mhz",
    "enum",
    "gfx_grid_mhz",
    "import_amdsmi",
    "int_or_none",
    "lib_version",
    "number",
    "one_line",
    "perf_level_name",
    "pick_power",
    "release",
    "soft",
    "text",
]

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
STATUS: dict[int, tuple[type[PowerlibError], str]] = {
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
    8: (TransientDeviceError, "the call timed out: the GPU or driver is busy (transient)"),
    9: (
        TransientDeviceError,
        "the library asked to retry, and the retry failed too (transient)",
    ),
    10: (PermissionDeniedError, _PERMISSION_HINT),
    17: (InvalidArgumentError, "a value is out of bounds"),
    18: (BackendUnavailableError, f"amdsmi failed to initialise; {_UNAVAILABLE_HINT}"),
    30: (TransientDeviceError, "the GPU is busy (transient)"),
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
    STATUS[_code] = (
        BackendUnavailableError,
        "an AMD energy, MSR or HSMP driver is missing or not answering",
    )
del _code

RETRY = 9
NOT_FOUND = 31
_RETRY_DELAY_S = 0.005
_GRID_STEP_MHZ = 50.0
_SENTINELS = frozenset({0xFFFF, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF})  # "no value" in amdsmi structs
_HZ_PER_MHZ = 1e6

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


def one_line(err: BaseException) -> str:
    """The error's message on one line, at most 200 characters."""
    return " ".join(str(err).split())[:200]


def _is_instance(err: BaseException, smi: Any, class_name: str) -> bool:
    cls = getattr(smi, class_name, None)
    return isinstance(cls, type) and isinstance(err, cls)


def _status_code(smi: Any, err: BaseException) -> int | None:
    if not _is_instance(err, smi, "AmdSmiLibraryException"):
        return None
    try:
        code = err.get_error_code()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a wrapper without the method: fall back to the attribute
        code = getattr(err, "err_code", None)
    return int(code) if isinstance(code, int) else None


def _translate(
    smi: Any, err: Exception, name: str, device: str | None, operation: str | None
) -> PowerlibError:
    """Turn anything an amdsmi call raised into a powerlib error."""
    context = {"device": device, "operation": operation}
    code = _status_code(smi, err)
    if code is not None:
        cls, hint = STATUS.get(code, (DeviceError, "amdsmi reported an error"))
        if code == NOT_FOUND and device is not None:  # an open GPU that stopped answering
            cls, hint = DeviceLostError, "the GPU is gone: it fell off the bus or was reset"
        try:
            status = " ".join(str(err.get_error_info(detailed=False)).split())  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - older wrappers
            status = f"status {code}"
        return cls(f"{name}: {status}: {hint}", vendor_code=code, **context)
    if _is_instance(err, smi, "AmdSmiParameterException"):
        return InvalidArgumentError(f"{name} rejected an argument: {one_line(err)}", **context)
    if _is_instance(err, smi, "AmdSmiException"):
        return DeviceError(f"{name} failed: {one_line(err)}", **context)
    if isinstance(err, AttributeError) and not hasattr(smi, name):
        return NotSupportedError(
            f"this amdsmi wrapper has no {name} (it is older than the call); install the wrapper "
            "shipped with your ROCm (/opt/rocm/share/amd_smi)",
            **context,
        )
    return DeviceError(
        f"{name} raised {type(err).__name__}: {one_line(err)} (an amdsmi wrapper bug?)", **context
    )


def call(
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
        if _status_code(smi, err) != RETRY:
            raise _translate(smi, err, name, device, operation) from err
        logger.debug("%s asked to retry; retrying once", name)
    time.sleep(_RETRY_DELAY_S)
    try:
        with _SMI_LOCK:
            return getattr(smi, name)(*args)
    except Exception as err:
        raise _translate(smi, err, name, device, operation) from err


def enum(smi: Any, enum_name: str, member: str) -> Any:
    """``smi.<enum_name>.<member>``, or BackendUnavailableError for a mismatched wrapper."""
    try:
        return getattr(getattr(smi, enum_name), member)
    except AttributeError as err:
        raise BackendUnavailableError(
            f"this amdsmi wrapper has no {enum_name}.{member}; install the wrapper shipped with "
            "your ROCm (/opt/rocm/share/amd_smi)"
        ) from err


def acquire(smi: Any) -> None:
    """``amdsmi_init`` on the first reference to ``smi`` in this process."""
    with _INIT_LOCK:
        count = _INIT_COUNTS.get(smi, 0)
        if count == 0:
            flag = enum(smi, "AmdSmiInitFlags", "INIT_AMD_GPUS")
            try:
                call(smi, "amdsmi_init", flag, operation="init")
            except PowerlibError as err:
                raise BackendUnavailableError(
                    f"amdsmi could not start: {err.message}", vendor_code=err.vendor_code
                ) from err
        _INIT_COUNTS[smi] = count + 1


def release(smi: Any) -> None:
    """``amdsmi_shut_down`` when the last reference to ``smi`` goes."""
    with _INIT_LOCK:
        count = _INIT_COUNTS.get(smi, 0) - 1
        if count > 0:
            _INIT_COUNTS[smi] = count
            return
        _INIT_COUNTS.pop(smi, None)
        try:
            call(smi, "amdsmi_shut_down", operation="close")
        except PowerlibError as err:
            logger.debug("amdsmi_shut_down failed: %s", err)


# -- value parsing ---------------------------------------------------------------------------------


def number(value: object) -> float | None:
    """A finite number from an amdsmi dict, or ``None`` for ``"N/A"`` and all-ones sentinels."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int) and value in _SENTINELS:
        return None
    return float(value) if math.isfinite(value) else None


def text(value: object) -> str | None:
    """A stripped string from an amdsmi dict (bytes decoded), or ``None`` for empty and ``"N/A"``."""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if not isinstance(value, str):
        return None
    value = value.strip()
    return value if value and value != "N/A" else None


def int_or_none(value: object) -> int | None:
    """A whole :func:`number` as an ``int``, else ``None``."""
    parsed = number(value)
    return int(parsed) if parsed is not None and parsed == int(parsed) else None


def gfx_grid_mhz(min_mhz: float, max_mhz: float) -> tuple[float, ...]:
    """Both ends plus every multiple of 50 MHz strictly between them."""
    inner = range(
        int(math.floor(min_mhz / _GRID_STEP_MHZ)) + 1, int(math.ceil(max_mhz / _GRID_STEP_MHZ))
    )
    points = {min_mhz, max_mhz, *(k * _GRID_STEP_MHZ for k in inner)}
    return tuple(sorted(p for p in points if min_mhz <= p <= max_mhz))


def pick_power(info: Mapping[str, Any] | None) -> tuple[str, float] | None:
    """``(field, W)``: current socket power when valid, else the average."""
    if not info:
        return None
    current = number(info.get("current_socket_power"))
    average = number(info.get("average_socket_power"))
    if current is not None and current > 0:
        return "current_socket_power", current
    if average is not None and average >= 0:
        return "average_socket_power", average
    if current is not None and current >= 0:
        return "current_socket_power", current
    return None


def perf_level_name(value: object) -> str | None:
    """``AMDSMI_DEV_PERF_LEVEL_AUTO`` -> ``"auto"``; ``None`` when there is no level."""
    name = text(value)
    return None if name is None else name.removeprefix("AMDSMI_DEV_PERF_LEVEL_").lower()


def dpm_levels_mhz(freq: Mapping[str, Any] | None) -> list[float] | None:
    """DPM levels in MHz; the C struct holds Hz, but accept MHz from other builds."""
    if not freq:
        return None
    values = [v for v in (number(x) for x in freq.get("frequency") or []) if v is not None]
    if not values:
        return None
    scale = _HZ_PER_MHZ if max(values) > 100_000 else 1.0
    return [round(v / scale, 3) for v in values]


def soft(smi: Any, name: str, *args: Any) -> Any:
    """:func:`call` during enumeration, or ``None`` (logged) when the call fails."""
    try:
        return call(smi, name, *args, operation="enumerate")
    except PowerlibError as err:
        logger.debug("%s failed during enumeration: %s", name, err)
        return None


def lib_version(smi: Any) -> str | None:
    """``amdsmi_get_lib_version()`` as ``"major.minor.release"``, or ``None`` if unknown."""
    version = soft(smi, "amdsmi_get_lib_version")
    if not isinstance(version, Mapping):
        return None
    parts = [version.get(k) for k in ("major", "minor", "release")]
    if not all(isinstance(p, int) for p in parts):
        return None
    return ".".join(str(p) for p in parts)
