"""The NVML call point: import, error translation, and the values NVML answers in.

Every NVML call of :mod:`powerlib.backends.nvidia` goes through :func:`call`, the one place where
``pynvml.NVMLError`` becomes a powerlib error (the NVML code is kept as ``vendor_code``, the
original exception chained). The binding is imported lazily by :func:`import_pynvml`, never from
the deprecated ``pynvml`` shim distribution (its import warning is silenced). Transient codes
(``TIMEOUT``, ``IN_USE``, ``NOT_READY``) become ``TransientDeviceError``, which the device layer
retries a bounded number of times (docs/real-gpu.md §2).

Also here: the clock-event reason bits and architecture numbers of ``nvml.h``, byte-string
decoding, and the NVML-to-CUDA device order (see :mod:`powerlib.backends.nvidia`). Every NVML call
with its units and privileges is listed in docs/vendor-calls.md.
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
    "INSTALL_HINT",
    "REASON_LOCKED",
    "call",
    "cuda_order",
    "import_pynvml",
    "package_version",
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
