"""powerlib: cut the energy of large-model training without slowing it down.

The public surface is re-exported here; everything else is an implementation detail. Importing
powerlib imports no vendor library (pynvml, amdsmi) and no framework (torch, megatron, deepspeed):
backends and integrations import theirs lazily, when used.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from powerlib.backend import Backend, ProbeResult
from powerlib.config import Settings
from powerlib.device import Capabilities, Device, DeviceInfo, DeviceKind, PowerState
from powerlib.errors import (
    BackendUnavailableError,
    ConfigError,
    DeviceBusyError,
    DeviceError,
    DeviceLostError,
    DeviceNotFoundError,
    InvalidArgumentError,
    NotSupportedError,
    PermissionDeniedError,
    PlanError,
    PowerlibError,
    UntrustedStateError,
)
from powerlib.registry import backend_names, open_backend, probe_backends

if TYPE_CHECKING:  # loaded on first use (see __getattr__); typed and documented where defined
    from powerlib.control import ControlSession, RestoreOutcome, restore_journals
    from powerlib.measure_api import Measurement, MeasurementResult, measure
    from powerlib.runtime.session import Session, optimize

from powerlib._version import __version__

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "Capabilities",
    "ConfigError",
    "ControlSession",
    "Device",
    "DeviceBusyError",
    "DeviceError",
    "DeviceInfo",
    "DeviceKind",
    "DeviceLostError",
    "DeviceNotFoundError",
    "InvalidArgumentError",
    "Measurement",
    "MeasurementResult",
    "NotSupportedError",
    "PermissionDeniedError",
    "PlanError",
    "PowerState",
    "PowerlibError",
    "UntrustedStateError",
    "ProbeResult",
    "RestoreOutcome",
    "Session",
    "Settings",
    "__version__",
    "backend_names",
    "measure",
    "open_backend",
    "optimize",
    "probe_backends",
    "restore_journals",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str) -> object:
    """``optimize``, ``Session``, ``measure`` and the control plane load on first use.

    A planning-only process (``powerlib plan``) then imports neither numpy-heavy runtime code
    nor the journal and lock machinery.
    """
    if name in ("ControlSession", "RestoreOutcome", "restore_journals"):
        from powerlib import control  # noqa: PLC0415 - the package surface loads its parts on first use

        return getattr(control, name)
    if name in ("optimize", "Session"):
        from powerlib import runtime  # noqa: PLC0415 - the package surface loads its parts on first use

        return getattr(runtime, name)
    if name in ("measure", "Measurement", "MeasurementResult"):
        from powerlib import measure_api  # noqa: PLC0415 - the package surface loads its parts on first use

        return getattr(measure_api, name)
    raise AttributeError(f"module 'powerlib' has no attribute {name!r}")
