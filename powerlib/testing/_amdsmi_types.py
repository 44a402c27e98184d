"""The amdsmi names the fake reproduces: status codes, exception classes and enums.

Values, names and constructor signatures are those of the amdsmi 7.0.2 Python wrapper
(``amdsmi_wrapper.py``, ``amdsmi_exception.py``); ``tests/backends/test_amd.py`` checks them
against a snapshot recorded from the real wrapper. :mod:`powerlib.testing.fake_amdsmi` exposes
them as attributes of the fake module, as the real one does.

This module imports only the standard library.
"""

from __future__ import annotations

import enum

__all__ = [
    "INVAL",
    "NOT_INIT",
    "NOT_SUPPORTED",
    "NO_PERM",
    "RETRY",
    "TIMEOUT",
    "AmdSmiClkType",
    "AmdSmiDevPerfLevel",
    "AmdSmiException",
    "AmdSmiInitFlags",
    "AmdSmiLibraryException",
    "AmdSmiParameterException",
    "AmdSmiRetryException",
    "AmdSmiTemperatureMetric",
    "AmdSmiTemperatureType",
    "AmdSmiTimeoutException",
]

# AMDSMI_STATUS_* codes used by the fake itself (values from amdsmi_wrapper.py 7.0.2).
INVAL = 1
NOT_SUPPORTED = 2
TIMEOUT = 8
RETRY = 9
NO_PERM = 10
NOT_INIT = 32

_STATUS_NAMES = {
    1: "AMDSMI_STATUS_INVAL - Invalid parameters",
    2: "AMDSMI_STATUS_NOT_SUPPORTED - Feature not supported",
    3: "AMDSMI_STATUS_NOT_YET_IMPLEMENTED - Feature not yet implemented",
    8: "AMDSMI_STATUS_TIMEOUT - Timeout in API call",
    9: "AMDSMI_STATUS_RETRY - Retry operation",
    10: "AMDSMI_STATUS_NO_PERM - Permission Denied",
    18: "AMDSMI_STATUS_INIT_ERROR - Initialization error",
    30: "AMDSMI_STATUS_BUSY - Device busy",
    31: "AMDSMI_STATUS_NOT_FOUND - Device Not found",
    32: "AMDSMI_STATUS_NOT_INIT - Device not initialized",
    34: "AMDSMI_STATUS_DRIVER_NOT_LOADED - Driver not loaded",
    55: "AMDSMI_STATUS_SETTING_UNAVAILABLE - Setting is not available",
}


# -- exceptions: the names and constructor signatures of amdsmi_exception.py -------------------


class AmdSmiException(Exception):
    """Base class of the fake's exceptions (as in amdsmi)."""


class AmdSmiLibraryException(AmdSmiException):
    """A non-zero ``amdsmi_status_t``."""

    def __init__(self, err_code: int) -> None:
        err_code = abs(err_code)
        super().__init__(err_code)
        self.err_code = err_code
        self.err_info = _STATUS_NAMES.get(
            err_code, "AMDSMI_STATUS_UNKNOWN_ERROR - An unknown error occurred"
        )

    def __str__(self) -> str:
        return f"Error code:\n\t{self.err_code} | {self.err_info}"

    def get_error_info(self, detailed: bool = True) -> str:
        """The status name and description (only the name when ``detailed`` is false)."""
        return self.err_info if detailed else self.err_info.split(" - ")[0]

    def get_error_code(self) -> int:
        """The status code."""
        return self.err_code


class AmdSmiRetryException(AmdSmiLibraryException):
    """``AMDSMI_STATUS_RETRY`` (9)."""

    def __init__(self) -> None:
        super().__init__(RETRY)


class AmdSmiTimeoutException(AmdSmiLibraryException):
    """``AMDSMI_STATUS_TIMEOUT`` (8)."""

    def __init__(self) -> None:
        super().__init__(TIMEOUT)


class AmdSmiParameterException(AmdSmiException):
    """An argument of the wrong Python type (raised before the library is called)."""

    def __init__(
        self, receivedValue: object, expectedType: object, msg: str | None = None
    ) -> None:  # amdsmi's names
        super().__init__(msg)
        self.err_code = None
        self.actualType = type(receivedValue)
        self.expectedType = expectedType
        self.err_msg = msg or (
            f"Invalid parameter: actual type {self.actualType}, expected type {expectedType}"
        )

    def __str__(self) -> str:
        return self.err_msg


# -- enums: the members powerlib uses, with the wrapper's values ------------------------------


class AmdSmiInitFlags(enum.IntEnum):
    """``amdsmi_init`` flags."""

    INIT_ALL_PROCESSORS = 0xFFFFFFFF
    INIT_AMD_CPUS = 1
    INIT_AMD_GPUS = 2
    INIT_AMD_APUS = 3
    INIT_NON_AMD_CPUS = 4
    INIT_NON_AMD_GPUS = 8


class AmdSmiClkType(enum.IntEnum):
    """Clock domains (``GFX`` is an alias of ``SYS``, as in amdsmi)."""

    SYS = 0
    GFX = 0
    DF = 1
    DCEF = 2
    SOC = 3
    MEM = 4


class AmdSmiDevPerfLevel(enum.IntEnum):
    """``power_dpm_force_performance_level`` values."""

    AUTO = 0
    LOW = 1
    HIGH = 2
    MANUAL = 3
    STABLE_STD = 4
    STABLE_PEAK = 5
    STABLE_MIN_MCLK = 6
    STABLE_MIN_SCLK = 7
    DETERMINISM = 8
    UNKNOWN = 256


class AmdSmiTemperatureType(enum.IntEnum):
    """Temperature sensors (``JUNCTION`` is an alias of ``HOTSPOT``)."""

    EDGE = 0
    HOTSPOT = 1
    JUNCTION = 1
    VRAM = 2


class AmdSmiTemperatureMetric(enum.IntEnum):
    """Temperature metrics."""

    CURRENT = 0
    MAX = 1
    MIN = 2
