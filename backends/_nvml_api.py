"""The NVML call point: import, error translation, and the values NVML answers in.

Every NVML call of :mod:`powerlib.backends.nvidia` goes through :func:`call`, the one place where
``pynvml.NVMLError`` becomes a powerlib error (the NVML code is kept as ``vendor_code``, the
original exception chained). The binding is imported lazily by :func:`import_pynvml`, never from
the deprecated ``pynvml`` shim distribution (its import warning is silenced). Transient codes
(``TIMEOUT``, ``IN_USE``, ``NOT_READY``) become ``TransientDeviceError``, which the device layer
retries a bounded number of times (docs/real-gpu.md §2).

Also here: the clock-event reason bits, architecture numbers and workload power profiles of
``nvml.h``, the calls CUDA 13 deprecates and CUDA 14 removes (they answer
``NVML_ERROR_DEPRECATED``, which powerlib reads as "absent", like ``NOT_SUPPORTED`` and
``FUNCTION_NOT_FOUND``), field-value decoding, byte-string decoding, and the NVML-to-CUDA device
order (see :mod:`powerlib.backends.nvidia`). Every NVML call with its units and privileges is
listed in docs/vendor-calls.md.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from powerlib.config import Settings
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
    "ARCH_AMPERE",
    "ARCH_NAMES",
    "ARCH_VOLTA",
    "DEPRECATED_CALLS",
    "INSTALL_HINT",
    "POWER_PROFILE_NAMES",
    "REASON_LOCKED",
    "call",
    "cuda_order",
    "field_number",
    "import_pynvml",
    "major_version",
    "mask_bits",
    "package_version",
    "profile_names",
    "reason_names",
    "text",
]

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'powerlib[nvidia]' (nvidia-ml-py) and an NVIDIA driver"

# NVML return codes (nvml.h) -> powerlib error class and what to tell the user.
_NVML_ERRORS: Mapping[int, tuple[type[PowerlibError], str]] = {
    1: (BackendUnavailableError, "NVML is not initialised"),
    2: (InvalidArgumentError, "NVML rejected an argument"),
    3: (NotSupportedError, "not supported by this GPU or driver"),
    4: (
        PermissionDeniedError,
        "needs root, and in a container also CAP_SYS_ADMIN (docker run --cap-add SYS_ADMIN)",
    ),
    6: (DeviceNotFoundError, "NVML found no such object"),
    9: (BackendUnavailableError, "the NVIDIA kernel driver is not loaded"),
    10: (TransientDeviceError, "the GPU did not answer in time"),
    12: (BackendUnavailableError, "libnvidia-ml.so.1 not found: install the NVIDIA driver"),
    13: (NotSupportedError, "the driver is too old for this NVML call"),
    15: (DeviceLostError, "the GPU fell off the bus or stopped answering"),
    16: (DeviceError, "the GPU needs a reset"),
    18: (
        BackendUnavailableError,
        "NVML and kernel driver versions differ (driver upgraded without a reboot?)",
    ),
    19: (TransientDeviceError, "the GPU is busy with an operation that excludes this one"),
    24: (InvalidArgumentError, "the GPU does not support this frequency"),
    26: (NotSupportedError, "the NVML call is deprecated"),
    27: (TransientDeviceError, "the GPU or driver is not ready for this request yet"),
    28: (DeviceNotFoundError, "the GPU was not found"),
}

# nvmlDeviceGetCurrentClocksEventReasons bits (nvml.h).
REASON_LOCKED = 0x2  # "applications clocks setting": also set while locked clocks hold the clock
_EVENT_REASONS = (
    (0x1, "gpu_idle"),
    (0x2, "clocks_locked_or_app_clocks"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal"),
    (0x40, "hw_thermal"),
    (0x80, "hw_power_brake"),
    (0x100, "display_clocks"),
)

# nvmlDeviceGetArchitecture values (nvml.h).
ARCH_VOLTA = 5
ARCH_AMPERE = 7
ARCH_NAMES = {
    2: "kepler",
    3: "maxwell",
    4: "pascal",
    5: "volta",
    6: "turing",
    7: "ampere",
    8: "ada",
    9: "hopper",
    10: "blackwell",
}


# The calls CUDA 13 deprecates and CUDA 14 removes (they then answer NVML_ERROR_DEPRECATED, 26)
# that powerlib has used; the default read path calls none of them on an NVML 13 or newer driver
# (docs/real-gpu.md §8): nvmlDeviceGetTemperatureV and nvmlDeviceGetCurrentClocksEventReasons
# replace the first and the last two.
DEPRECATED_CALLS = (
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetApplicationsClock",
    "nvmlDeviceGetDefaultApplicationsClock",
    "nvmlDeviceSetApplicationsClocks",
    "nvmlDeviceResetApplicationsClocks",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetSupportedClocksThrottleReasons",
)

# nvmlPowerProfileType_t (nvml.h, Blackwell workload power profiles): bit n of a profile mask.
POWER_PROFILE_NAMES = {
    0: "max_p",
    1: "max_q",
    2: "compute",
    3: "memory_bound",
    4: "network",
    5: "balanced",
    6: "llm_inference",
    7: "llm_training",
    8: "rbm",
    9: "dcpcie",
    10: "hmma_sparse",
    11: "hmma_dense",
    12: "sync_balanced",
    13: "hpc",
    14: "mig",
    15: "max_q_1",
    16: "network_bound",
    17: "high_throughput_inference",
    18: "medium_throughput_inference",
    19: "low_latency_inference",
    20: "training",
    21: "inference",
    22: "max_q_2",
    23: "max_q_3",
    24: "low_priority_background",
}

# nvmlValueType_t -> the member of nvmlValue_t that holds a field value of that type.
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


def import_pynvml() -> ModuleType:
    """Import NVIDIA's ``pynvml`` module, silencing the deprecated ``pynvml`` shim's warning.

    Raises:
        BackendUnavailableError: The module is not installed, or is not NVIDIA's binding.
    """
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
            # import_module: the binding has no type information; the caller holds a module
            pynvml = importlib.import_module("pynvml")
    except ImportError as err:
        raise BackendUnavailableError(
            f"the pynvml module is not installed: {INSTALL_HINT}"
        ) from err
    if not hasattr(pynvml, "_nvmlGetFunctionPointer"):
        raise BackendUnavailableError(
            f"the installed pynvml module ({getattr(pynvml, '__file__', '?')}) is not NVIDIA's "
            "nvidia-ml-py binding; uninstall nvidia-ml-py3/py3nvml and pip install nvidia-ml-py"
        )
    return pynvml


def call(
    nvml: Any,
    fn: Callable[..., Any],
    *args: Any,
    device: str | None = None,
    operation: str | None = None,
) -> Any:
    """Call one NVML function; the one place NVML errors become powerlib errors."""
    try:
        return fn(*args)
    except nvml.NVMLError as err:
        code = getattr(err, "value", None)
        known = _NVML_ERRORS.get(code) if isinstance(code, int) else None
        cls, hint = known or (DeviceError, "NVML reported an error")
        name = getattr(fn, "__name__", "nvml call")
        raise cls(
            f"{name}: {err}: {hint}", device=device, operation=operation, vendor_code=code
        ) from err


def reason_names(mask: int) -> tuple[str, ...]:
    """The names of the clock-event reason bits set in ``mask``."""
    return tuple(name for bit, name in _EVENT_REASONS if mask & bit)


def field_number(value: Any) -> float:
    """The number an ``nvmlFieldValue_t`` holds, read as its ``valueType`` says (default: uint)."""
    kind = getattr(value, "valueType", 1)
    member = _VALUE_MEMBERS[kind] if isinstance(kind, int) and 0 <= kind < 7 else "uiVal"
    return float(getattr(value.value, member))


def mask_bits(words: Sequence[int]) -> tuple[int, ...]:
    """The bits set in an ``nvmlMask255_t`` (32-bit words, bit 0 of word 0 first)."""
    return tuple(32 * w + b for w, word in enumerate(words) for b in range(32) if word >> b & 1)


def profile_names(bits: Sequence[int]) -> tuple[str, ...]:
    """Workload power profile names for mask bits (``profile_<n>`` for one nvml.h lacks)."""
    return tuple(POWER_PROFILE_NAMES.get(bit, f"profile_{bit}") for bit in bits)


def major_version(version: str | None) -> int | None:
    """The major number of an NVML version (``"13.580.65"`` -> 13); ``None`` if unknown."""
    head = (version or "").split(".", 1)[0]
    return int(head) if head.isdigit() else None


def package_version(name: str) -> str | None:
    """The installed version of the distribution ``name``, or ``None``."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def text(value: bytes | str) -> str:
    """An NVML string (bytes in older bindings) as ``str``."""
    return value.decode() if isinstance(value, bytes) else value


def cuda_order(names: Sequence[str], settings: Settings) -> list[int]:
    """NVML indices in CUDA ordinal order (see :mod:`powerlib.backends.nvidia`)."""
    if settings.cuda_device_order == "FASTEST_FIRST" and len(set(names)) > 1:
        logger.warning(
            "GPUs of different models (%s) with CUDA_DEVICE_ORDER=FASTEST_FIRST: CUDA's order may "
            "differ from NVML's PCI order, which powerlib uses; set CUDA_DEVICE_ORDER=PCI_BUS_ID "
            "or list GPU UUIDs in CUDA_VISIBLE_DEVICES",
            ", ".join(sorted(set(names))),
        )
    return list(range(len(names)))
