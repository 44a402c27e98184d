"""The powerlib exception hierarchy.

Every error a backend can raise is one of these; vendor exceptions (``pynvml.NVMLError``,
``amdsmi`` exceptions, ``OSError`` from sysfs) are translated at one choke point per backend and
chained with ``raise ... from err`` so the original stays available for debugging.

Each error carries optional context (``device``, ``operation``, ``vendor_code``) that is rendered the
same way by ``str()`` and ``repr()``, survives pickling (errors cross process boundaries in the
guardian and in ``torch.distributed`` gathers), and maps to one documented CLI exit code.

This module imports nothing from powerlib or third parties.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "ConfigError",
    "DeviceBusyError",
    "DeviceError",
    "DeviceLostError",
    "DeviceNotFoundError",
    "InvalidArgumentError",
    "NotSupportedError",
    "PermissionDeniedError",
    "PlanError",
    "PowerlibError",
    "ProtocolError",
    "TransientDeviceError",
    "UntrustedStateError",
]


class PowerlibError(Exception):
    """Base class of every error powerlib raises on purpose.

    Args:
        message: What went wrong, in one sentence, with what to do about it when known.
        device: The device's stable id (or index), when the error concerns one device.
        operation: What was being done, e.g. ``"set_power_limit"``.
        vendor_code: The vendor's numeric code or errno name, kept for diagnostics.

    Attributes:
        exit_code: The ``powerlib`` CLI's exit status for this kind of error (documented in
            docs/json-and-exit-codes.md). Subclasses override it.
    """

    exit_code: int = 1

    def __init__(
        self,
        message: str,
        *,
        device: str | None = None,
        operation: str | None = None,
        vendor_code: int | str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.device = device
        self.operation = operation
        self.vendor_code = vendor_code

    def __str__(self) -> str:
        prefix = ""
        if self.device is not None:
            prefix += f"device {self.device}: "
        if self.operation is not None:
            prefix += f"{self.operation}: "
        suffix = f" (vendor code {self.vendor_code})" if self.vendor_code is not None else ""
        return f"{prefix}{self.message}{suffix}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild,
            (type(self), self.message, self.device, self.operation, self.vendor_code),
        )


def _rebuild(
    cls: type[PowerlibError],
    message: str,
    device: str | None,
    operation: str | None,
    vendor_code: int | str | None,
) -> PowerlibError:
    return cls(message, device=device, operation=operation, vendor_code=vendor_code)


class BackendUnavailableError(PowerlibError):
    """A backend cannot start: library missing, driver not loaded, no device found.

    The message names the pip extra or the driver to install.
    """

    exit_code = 3


class PermissionDeniedError(PowerlibError):
    """The operation needs a privilege the process lacks; the message says which."""

    exit_code = 4


class NotSupportedError(PowerlibError):
    """The device, driver or backend cannot do this. Check ``DeviceInfo.capabilities`` first."""

    exit_code = 5


class DeviceNotFoundError(PowerlibError):
    """No device matches the given index or id."""

    exit_code = 6


class InvalidArgumentError(PowerlibError, ValueError):
    """A value is out of range or malformed; nothing was changed."""

    exit_code = 7


class ProtocolError(InvalidArgumentError):
    """A request that breaks the agent's wire protocol (docs/agent.md §2); nothing was changed.

    Not JSON, an unknown operation, an argument of the wrong type, a line too long: the agent
    answers it once and closes the connection, and its client raises this class, so a caller
    tells a malformed request from a device's failure (it used to arrive as
    :class:`DeviceError`, its name unknown to the client). An :class:`InvalidArgumentError`.
    """


class ConfigError(PowerlibError, ValueError):
    """A setting (environment variable, option, file) is invalid; the message lists valid choices."""

    exit_code = 7


class PlanError(PowerlibError, ValueError):
    """A profile or plan is malformed or infeasible; the message says what and where."""

    exit_code = 7


class DeviceBusyError(PowerlibError):
    """Another process controls the device; the message names the owner."""

    exit_code = 8


class DeviceLostError(PowerlibError):
    """The device fell off the bus or stopped answering."""

    exit_code = 9


class DeviceError(PowerlibError):
    """Any other failure reported by a driver or vendor library (the vendor code is kept)."""

    exit_code = 10


class TransientDeviceError(DeviceError):
    """The driver did not answer in time or was briefly busy: worth a bounded retry.

    NVML ``TIMEOUT``/``IN_USE``, amdsmi ``TIMEOUT``/``RETRY``/``BUSY``.

    It is not :class:`DeviceBusyError`, which means another *controller* owns the device: a
    transient error says nothing about ownership, so a session that still gets it after the
    retries resets the device to its baseline (docs/real-gpu.md §2).
    """


class UntrustedStateError(PowerlibError):
    """A state folder or journal is not one that powerlib trusts, so nothing was done with it.

    Trusted means: owned by the invoking user or root (or a uid the caller trusts explicitly),
    not writable by group or others, and a real folder or regular file (never a symlink or fifo).
    The message names the path, its owner and its mode. Also raised for a journal that would
    steer where a restore writes (a recorded sysfs root that is not the invoking one).
    """

    exit_code = 12
