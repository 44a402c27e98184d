"""Is this node ready for powerlib? The logic of ``powerlib check`` (docs/real-gpu.md §8).

:func:`check_node` looks at one open backend and each of its devices and says, per device,
whether a session could change its clocks and measure its energy, and why not:

* the backend and its driver and library versions;
* permissions: ``root`` (or ``direct`` when the process is not root and the backend needs no
  privilege, as the simulator), ``agent grant`` (the node agent makes the changes), or ``none``
  with :meth:`~powerlib.backend.Backend.control_refusal`'s line (docs/real-gpu.md §5);
* persistence mode, MIG (asked of the driver), an existing clock lock or a power limit that is not
  the default (docs/real-gpu.md §1);
* the energy counter's update period and the cost of one ``read_state``, *measured*: the device is
  read back to back for ``duration_s``
  (:func:`~powerlib.measurement.counter_period.measure_counter`);
* with ``load``, the clock-change landing latency, measured under a short load (an idle GPU parks
  its clock, so its running clock says nothing): a low clock is locked, then a high one, a few
  times, through a :class:`~powerlib.control.ControlSession` (journaled, always restored); see
  :func:`~powerlib.node_check.landing.measure_landing_latency`;
* what the power reading covers (the whole board, a Grace Hopper module, a RAPL zone...);
* NVIDIA's newer controls where the GPU has them: power smoothing (its floor: slack cannot save
  below it), the workload power profile in force, and a power limit powerlib did not set
  (:func:`foreign_power_limit`: out of band, or set by another tool).

Each device ends with one verdict: ready, or not ready with the reason and the exit code of the
table in docs/json-and-exit-codes.md (4 no permission, 5 MIG or no clock control, 9 device lost, the error's own code
for any other driver failure). An error in one device's check never stops the others. The
report's exit code is the first failing device's (3, or the error's code, when the backend
cannot be opened at all). Nothing here needs click: the CLI (:mod:`powerlib.cli.check`) only
parses and prints, and the runtime can call :func:`check_node` at start-up.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Callable, Mapping
from typing import TypeVar

from powerlib._version import __version__
from powerlib.backend import Backend
from powerlib.config import Settings
from powerlib.device import Device, DeviceKind
from powerlib.errors import (
    DeviceBusyError,
    DeviceLostError,
    NotSupportedError,
    PowerlibError,
)
from powerlib.measurement.counter_period import measure_counter
from powerlib.node_check.landing import (
    LANDING_REPETITIONS,
    LANDING_TIMEOUT_S,
    LatencyCheck,
    measure_landing_latency,
)
from powerlib.node_check.report import EXIT_NOT_SUPPORTED, EXIT_PERMISSION, DeviceCheck, NodeCheck

__all__ = [
    "backend_versions",
    "check_device",
    "check_node",
    "check_settings",
    "foreign_power_limit",
    "permission_of",
    "power_scope",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

STUCK_COUNTER_S = 0.5
"""A counter that did not move in this long is reported (NVML's and RAPL's update every 100 ms
or faster; a shorter window says too little)."""

_LIMIT_TOLERANCE_W = 0.5


# -- backend-wide facts -------------------------------------------------------------------------


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def backend_versions(backend: Backend) -> dict[str, str | None]:
    """The powerlib version and what the backend can say about its driver and library.

    NVML: ``nvmlSystemGetDriverVersion``, ``nvmlSystemGetNVMLVersion`` and the nvidia-ml-py
    package; the simulator: its GPU model; the agent: its protocol and backend. A version that
    cannot be read is ``None``; nothing here raises.
    """
    versions: dict[str, str | None] = {"powerlib": __version__}
    try:
        versions.update(backend.versions())
    except Exception as err:  # noqa: BLE001 - a plug-in's versions must not stop the check
        logger.debug("%s: versions: %s", backend.name, err)
    if backend.name == "amd":
        versions["amdsmi"] = _package_version("amdsmi")
    hello = getattr(backend, "hello", None)
    if backend.remote and isinstance(hello, Mapping):
        versions["agent_protocol"] = _text_or_none(hello.get("version"))
        versions["agent_backend"] = _text_or_none(hello.get("backend"))
    return versions


def _text_or_none(value: object) -> str | None:
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def permission_of(backend: Backend) -> tuple[str, str | None]:
    """How this process may change the backend's devices: ``(label, refusal line)``.

    ``"agent grant"`` when the node agent makes the changes (``backend.remote``); else
    ``"none"`` with :meth:`~powerlib.backend.Backend.control_refusal`'s line when it refuses, and
    ``"root"`` (``"direct"`` for a process that is not root, on a backend that needs no
    privilege) when it does not (docs/real-gpu.md §5).
    """
    if backend.remote:
        return "agent grant", None
    refusal = backend.control_refusal()
    if refusal is not None:
        return "none", refusal
    return ("root" if os.geteuid() == 0 else "direct"), None


def power_scope(dev: Device, details: Mapping[str, object]) -> str:
    """What the device's power and energy readings cover, in a few words."""
    info = dev.info
    if info.is_simulated:
        return "simulated"
    name = info.name.lower()
    if info.vendor == "nvidia":
        if "gh200" in name or "grace hopper" in name:
            return "module (Grace Hopper: NVML may report the CPU+GPU module, not the GPU alone)"
        return "board (NVML: the whole GPU board, memory included)"
    if info.vendor == "amd" and info.kind is DeviceKind.GPU:
        return "socket (amdsmi socket power)"
    zone = details.get("zone")
    if zone is not None:
        zone_name = details.get("zone_name")
        return f"RAPL zone {zone}" + (f" ({zone_name})" if zone_name else "")
    return "unknown"


def foreign_power_limit(
    backend: Backend, dev: Device, limit_w: float | None, details: Mapping[str, object]
) -> dict[str, object] | None:
    """A power limit powerlib did not set: ``{"limit_w", "default_w", "set_by"}``, else ``None``.

    Out of band: the enforced limit (``details["enforced_power_limit_w"]``) is below the
    management limit ``limit_w`` (a facility, BMC or another enforced limit: powerlib only
    writes the management limit). In band: ``limit_w`` is not the default and no powerlib
    journal holds the device (a session journals every limit it sets; docs/real-gpu.md §1);
    not judged through the node agent, whose journals this process cannot see.
    """
    default_w = dev.info.default_power_limit_w
    enforced = details.get("enforced_power_limit_w")
    if limit_w is None or default_w is None:
        return None
    if isinstance(enforced, float | int) and enforced < limit_w - _LIMIT_TOLERANCE_W:
        set_by = "out of band (a facility, BMC or other enforced limit below the management one)"
        return {"limit_w": float(enforced), "default_w": default_w, "set_by": set_by}
    if abs(limit_w - default_w) <= _LIMIT_TOLERANCE_W or backend.remote or _journaled(backend, dev):
        return None
    set_by = "by another tool (no powerlib journal holds this device)"
    return {"limit_w": limit_w, "default_w": default_w, "set_by": set_by}


def _journaled(backend: Backend, dev: Device) -> bool:
    """Whether a powerlib journal holds the device (an unreadable state folder: assume so)."""
    from powerlib.control.journal import has_journal  # noqa: PLC0415 - the control plane and backends load only for a check
    from powerlib.control.state import StateDir, device_key  # noqa: PLC0415 - the control plane and backends load only for a check

    try:
        key = device_key(dev.info.backend, dev.device_id)
        return has_journal(StateDir(backend.settings.state_dir), key)
    except (PowerlibError, OSError) as err:
        logger.debug("%s: could not read the journal folder: %s", dev.device_id, err)
        return True


# -- the check ----------------------------------------------------------------------------------


def _attempt(check: DeviceCheck, what: str, read: Callable[[], T]) -> T | None:
    """``read()``; a lost device aborts the device's check, other errors become a warning."""
    try:
        return read()
    except DeviceLostError:
        raise
    except NotSupportedError:
        return None
    except PowerlibError as err:
        check.warnings.append(f"{what} could not be read: {err.message}")
        return None


def check_device(
    backend: Backend,
    dev: Device,
    *,
    duration_s: float = 1.0,
    load: bool = False,
    permission: tuple[str, str | None] | None = None,
    repetitions: int = LANDING_REPETITIONS,
    landing_timeout_s: float = LANDING_TIMEOUT_S,
) -> DeviceCheck:
    """Check one device; never raises for a device or driver error (it becomes the verdict).

    Args:
        backend: The open backend ``dev`` belongs to.
        dev: The device.
        duration_s: How long its counter is read back to back.
        load: Also measure the clock-change landing latency under a load (changes its clocks,
            through a ControlSession, and puts them back).
        permission: :func:`permission_of` the backend, when the caller already asked.
        repetitions: Low-then-high clock pairs for the landing latency.
        landing_timeout_s: How long one clock change may take to show.
    """
    info = dev.info
    check = DeviceCheck(index=info.index, device_id=info.device_id, name=info.name)
    try:
        _check_into(
            check, backend, dev, duration_s, load, permission, repetitions, landing_timeout_s
        )
    except DeviceLostError as err:
        check.reasons.insert(0, f"device lost: {err.message}")
        check.exit_code = err.exit_code
    except PowerlibError as err:
        check.fail(err.message, err.exit_code)
    except Exception as err:  # noqa: BLE001 - one device's bug must not hide the others
        logger.debug("checking %s failed", info.device_id, exc_info=True)
        check.fail(f"unexpected {type(err).__name__}: {err}", 1)
    return check


def _check_into(
    check: DeviceCheck,
    backend: Backend,
    dev: Device,
    duration_s: float,
    load: bool,
    permission: tuple[str, str | None] | None,
    repetitions: int,
    landing_timeout_s: float,
) -> None:
    _read_facts(check, backend, dev, duration_s, permission)
    _judge(check, dev)
    busy = _warn(check, backend, dev)
    if load:
        _measure_landing(check, backend, dev, busy, repetitions, landing_timeout_s)


def _read_facts(
    check: DeviceCheck,
    backend: Backend,
    dev: Device,
    duration_s: float,
    permission: tuple[str, str | None] | None,
) -> None:
    """Fill in what the driver says, and read the counter back to back for ``duration_s``."""
    info = dev.info
    check.permission, check.control_refusal = (
        permission_of(backend) if permission is None else permission
    )
    check.can_lock_sm_clocks = info.capabilities.can_lock_sm_clocks
    check.default_power_limit_w = info.default_power_limit_w
    details = _attempt(check, "details", dev.details) or {}
    persistence = details.get("persistence_mode")
    check.persistence_mode = persistence if isinstance(persistence, bool) else None
    check.power_scope = power_scope(dev, details)
    check.mig_enabled = _attempt(check, "MIG mode", dev.mig_enabled)
    check.lock = _attempt(check, "the clock lock", dev.read_sm_lock)
    state = dev.read_state()  # the one read that must work: a failure is the verdict
    check.power_limit_w = state.power_limit_w
    smoothing = details.get("power_smoothing")
    check.power_smoothing = dict(smoothing) if isinstance(smoothing, Mapping) else None
    profiles = details.get("workload_power_profiles")
    check.workload_power_profiles = (
        [str(p) for p in profiles] if isinstance(profiles, list | tuple) else None
    )
    check.foreign_power_limit = foreign_power_limit(backend, dev, state.power_limit_w, details)
    check.counter = measure_counter(dev, duration_s)


def _judge(check: DeviceCheck, dev: Device) -> None:
    """What stops a session, in the order a user has to fix it."""
    info = dev.info
    if check.permission == "none":
        check.fail(
            check.control_refusal or "this process may not change the device", EXIT_PERMISSION
        )
    if check.mig_enabled:
        check.fail(
            "MIG is enabled: one clock serves every instance's tenant, so powerlib will not "
            "change it (disable MIG: nvidia-smi -i N -mig 0)",
            EXIT_NOT_SUPPORTED,
        )
    if not check.can_lock_sm_clocks:
        check.fail(
            f"no clock control: {info.name} ({info.backend} backend) cannot lock its compute clock",
            EXIT_NOT_SUPPORTED,
        )


def _existing_lock(check: DeviceCheck) -> bool:
    return check.lock is not None and check.lock.locked is True


def _warn(check: DeviceCheck, backend: Backend, dev: Device) -> str | None:
    """What a session can run with but the user should know; the line of a session holding it."""
    if check.persistence_mode is False:
        check.warnings.append(
            "persistence mode is off: the driver may drop clock locks and power limits when no "
            "process holds the GPU (nvidia-smi -pm 1, or run nvidia-persistenced)"
        )
    if _existing_lock(check):
        assert check.lock is not None
        shown = (
            "range not reported by the driver"
            if check.lock.range_mhz is None
            else "{:g}-{:g} MHz".format(*check.lock.range_mhz)
        )
        check.warnings.append(f"a clock lock is already in force ({shown})")
    limit, default = check.power_limit_w, check.default_power_limit_w
    if limit is not None and default is not None and abs(limit - default) > _LIMIT_TOLERANCE_W:
        check.warnings.append(f"the power limit is {limit:g} W, not the default {default:g} W")
    if (foreign := check.foreign_power_limit) is not None:
        check.warnings.append(
            f"the limit in force, {foreign['limit_w']:g} W, was set {foreign['set_by']}; "
            "a session restores it, never the default"
        )
    smoothing = check.power_smoothing or {}
    if smoothing.get("enabled") and isinstance(smoothing.get("floor_w"), float):
        check.warnings.append(
            f"power smoothing holds the GPU's power at or above {smoothing['floor_w']:g} W: "
            "slack time cannot save below it (the planner counts the floor)"
        )
    counter = check.counter
    assert counter is not None
    if not counter.has_counter:
        check.warnings.append(
            "no energy counter: energy is integrated from power readings (read often)"
        )
    elif counter.period_bound == "at_least" and counter.duration_s >= STUCK_COUNTER_S:
        check.warnings.append(
            f"the energy counter did not change in {counter.reads} reads over "
            f"{counter.duration_s:.3g} s (stuck, or it updates less often than that)"
        )
    busy = _controlled_by(backend, dev)
    if busy is not None:
        check.warnings.append(busy)
    return busy


def _measure_landing(
    check: DeviceCheck,
    backend: Backend,
    dev: Device,
    busy: str | None,
    repetitions: int,
    landing_timeout_s: float,
) -> None:
    """The landing latency under load, unless the device is not ready, locked or in use."""
    skip = None
    if not check.ready:
        skip = "the device is not ready"
    elif _existing_lock(check):
        skip = "a clock lock is already in force (measuring would replace it)"
    elif busy is not None:
        skip = "another powerlib session controls the device"
    if skip is not None:
        check.latency = LatencyCheck(measured=False, reason=skip)
        return
    try:
        check.latency = measure_landing_latency(
            backend, dev, repetitions=repetitions, timeout_s=landing_timeout_s
        )
    except DeviceBusyError as err:
        check.latency = LatencyCheck(measured=False, reason=err.message)
        return
    if check.latency.missed:
        reasons = _attempt(check, "the clock lock", dev.read_sm_lock)
        why = f" (clock-event reasons: {', '.join(reasons.reasons)})" if reasons else ""
        check.warnings.append(
            f"{check.latency.missed} clock change(s) did not show in the running clock within "
            f"{landing_timeout_s:g} s{why}"
        )


def _controlled_by(backend: Backend, dev: Device) -> str | None:
    """A line when a running powerlib session holds the device's lock, else ``None``."""
    from powerlib.control import ensure_not_controlled  # noqa: PLC0415 - the control plane and backends load only for a check

    try:
        ensure_not_controlled(backend, dev)
    except DeviceBusyError as err:
        return err.message
    except PowerlibError as err:  # an unusable state folder: the session would say so
        logger.debug("%s: could not tell whether a session holds it: %s", dev.device_id, err)
    return None


def check_node(
    backend: Backend,
    *,
    selector: int | str | None = None,
    duration_s: float = 1.0,
    load: bool = False,
    repetitions: int = LANDING_REPETITIONS,
    landing_timeout_s: float = LANDING_TIMEOUT_S,
) -> NodeCheck:
    """Check an open backend and its devices (docs/real-gpu.md §8).

    Args:
        backend: The open backend.
        selector: One device (index, id or unique id prefix); ``None``: every device.
        duration_s: How long each device's counter is read back to back.
        load: Also measure each device's clock-change landing latency under a load.
        repetitions: Low-then-high clock pairs for the landing latency.
        landing_timeout_s: How long one clock change may take to show.

    Raises:
        DeviceNotFoundError: ``selector`` names no device.
    """
    devices = list(backend.devices()) if selector is None else [backend.device(selector)]
    report = NodeCheck(
        backend=backend.name,
        versions=backend_versions(backend),
        duration_s=duration_s,
        load=load,
    )
    try:
        permission = permission_of(backend)
    except PowerlibError as err:
        permission = ("none", err.message)
    for dev in devices:
        report.devices.append(
            check_device(
                backend,
                dev,
                duration_s=duration_s,
                load=load,
                permission=permission,
                repetitions=repetitions,
                landing_timeout_s=landing_timeout_s,
            )
        )
    return report


def check_settings(
    settings: Settings,
    *,
    selector: int | str | None = None,
    duration_s: float = 1.0,
    load: bool = False,
) -> NodeCheck:
    """Open the backend ``settings`` name and check it; a backend that cannot open is reported.

    Raises:
        DeviceNotFoundError: ``selector`` names no device.
        ConfigError: ``settings.backend`` is not a backend name.
    """
    from powerlib.errors import ConfigError  # noqa: PLC0415 - the control plane and backends load only for a check
    from powerlib.registry import open_backend  # noqa: PLC0415 - the control plane and backends load only for a check

    try:
        backend = open_backend(settings=settings)
    except ConfigError:
        raise
    except PowerlibError as err:
        return NodeCheck(
            backend=settings.backend,
            available=False,
            error=err.message,
            error_code=err.exit_code,
            duration_s=duration_s,
            load=load,
        )
    with backend:
        return check_node(backend, selector=selector, duration_s=duration_s, load=load)
