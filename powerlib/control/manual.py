"""Changing devices by hand: what ``powerlib set`` and ``powerlib reset`` do.

Both refuse a device a running session controls
(:func:`~powerlib.control.ensure_not_controlled`). :func:`set_device` validates every setting
before it changes anything; :func:`reset_devices` resets what each device supports and reports
per device, carrying on past failures.
"""

from __future__ import annotations

from dataclasses import dataclass

from powerlib.backend import Backend
from powerlib.control.session import ensure_not_controlled
from powerlib.device import Device, PowerState
from powerlib.errors import NotSupportedError, PowerlibError
from powerlib.inspection import select_devices

__all__ = ["ResetOutcome", "ResetResult", "SetResult", "reset_devices", "set_device"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SetResult:
    """What :func:`set_device` applied.

    Attributes:
        device: The device changed.
        locked_sm_freqs_mhz: The SM clock range it was locked to, or ``None`` (not asked).
        power_limit_w: The power limit it was set to, or ``None`` (not asked).
        state: The device's state read after the change.
    """

    device: Device
    locked_sm_freqs_mhz: tuple[float, float] | None
    power_limit_w: float | None
    state: PowerState

    @property
    def applied(self) -> dict[str, object]:
        """The ``applied`` record of ``powerlib.set.v1`` (only what was asked for)."""
        applied: dict[str, object] = {}
        if self.locked_sm_freqs_mhz is not None:
            applied["locked_sm_freqs_mhz"] = list(self.locked_sm_freqs_mhz)
        if self.power_limit_w is not None:
            applied["power_limit_w"] = self.power_limit_w
        return applied


def set_device(
    backend: Backend,
    selector: str,
    *,
    sm_clocks_mhz: tuple[float, float] | None = None,
    power_limit_w: float | None = None,
) -> SetResult:
    """Lock a device's SM clocks and/or set its power limit; validate all before any change.

    Settings stay until :func:`reset_devices` (or a reboot/driver reload on real GPUs).

    Args:
        backend: An open backend.
        selector: Device index or id.
        sm_clocks_mhz: ``(low, high)`` SM clock range to lock to (equal for one clock).
        power_limit_w: Power limit to set.

    Raises:
        DeviceBusyError: A session controls the device.
        InvalidSettingError: A clock or limit the device does not support (nothing changed).
        NotSupportedError: The backend is the node agent (a change would end with this process).
    """
    if getattr(backend, "remote", False):
        raise NotSupportedError(
            "through the powerlib agent a change lasts only while the process that made it runs "
            "(a lease), so `powerlib set` would be undone as it exits: change clocks from the job "
            "(powerlib.optimize, a ControlSession), or run `powerlib set` as root on the node"
        )
    dev = backend.device(selector)
    ensure_not_controlled(backend, dev)
    if sm_clocks_mhz is not None:
        dev.validate_sm_clocks(*sm_clocks_mhz)
    if power_limit_w is not None:
        dev.validate_power_limit(power_limit_w)
    locked = None if sm_clocks_mhz is None else dev.lock_sm_clocks(*sm_clocks_mhz)
    limit = None if power_limit_w is None else dev.set_power_limit(power_limit_w)
    return SetResult(
        device=dev,
        locked_sm_freqs_mhz=None if locked is None else (locked[0], locked[1]),
        power_limit_w=limit,
        state=dev.read_state(),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ResetOutcome:
    """One device's reset: ``reset``, ``not supported``, ``failed: ...`` or ``skipped...``."""

    index: int
    device_id: str
    sm_clocks: str
    power_limit: str

    def to_json(self) -> dict[str, object]:
        """A row of ``powerlib.reset.v1``'s ``results``."""
        return {
            "index": self.index,
            "device_id": self.device_id,
            "sm_clocks": self.sm_clocks,
            "power_limit": self.power_limit,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ResetResult:
    """What :func:`reset_devices` did.

    Attributes:
        outcomes: One per device, in device order.
        error: The first failure (a device a session controls, or an operation that failed),
            or ``None``; the caller raises it after reporting.
    """

    outcomes: tuple[ResetOutcome, ...]
    error: PowerlibError | None

    @property
    def ok(self) -> bool:
        """Whether every device was reset (or skipped an operation it does not support)."""
        return self.error is None


def reset_devices(backend: Backend, selector: str | None = None) -> ResetResult:
    """Unlock SM clocks and restore the default power limit of one device or all.

    Operations a device does not support are skipped and reported; a failure is reported and
    the remaining devices are still reset.

    Args:
        backend: An open backend.
        selector: Device index or id, or ``None`` for every device.
    """
    outcomes = []
    first_error: PowerlibError | None = None
    for dev in select_devices(backend, selector):
        try:
            ensure_not_controlled(backend, dev)
        except PowerlibError as err:
            outcomes.append(
                ResetOutcome(
                    index=dev.index,
                    device_id=dev.device_id,
                    sm_clocks=f"skipped: {err}",
                    power_limit="skipped",
                )
            )
            first_error = first_error or err
            continue
        caps = dev.info.capabilities
        done: dict[str, str] = {}
        for key, supported, op in (
            ("sm_clocks", caps.can_lock_sm_clocks, dev.reset_sm_clocks),
            ("power_limit", caps.can_reset_power_limit, dev.reset_power_limit),
        ):
            if not supported:
                done[key] = "not supported"
                continue
            try:
                op()
                done[key] = "reset"
            except PowerlibError as err:
                done[key] = f"failed: {err}"
                first_error = first_error or err
        outcomes.append(
            ResetOutcome(
                index=dev.index,
                device_id=dev.device_id,
                sm_clocks=done["sm_clocks"],
                power_limit=done["power_limit"],
            )
        )
    return ResetResult(outcomes=tuple(outcomes), error=first_error)
