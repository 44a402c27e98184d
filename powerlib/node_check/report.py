"""What ``powerlib check`` found: per device, and for the node (``powerlib.check.v1``).

:class:`DeviceCheck` is one device's facts and verdict, :class:`NodeCheck` the whole report
and its JSON form; :mod:`powerlib.node_check.check` fills them (docs/real-gpu.md §8). The exit
codes are those of docs/json-and-exit-codes.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from powerlib.device import ClockLockState
from powerlib.measurement.counter_period import CounterCheck
from powerlib.node_check.landing import LatencyCheck

__all__ = ["EXIT_NOT_SUPPORTED", "EXIT_PERMISSION", "SCHEMA", "DeviceCheck", "NodeCheck"]

SCHEMA = "powerlib.check.v1"
"""The ``schema`` of :meth:`NodeCheck.to_json` (``powerlib check --json``)."""

# Exit codes of docs/json-and-exit-codes.md (also the PowerlibError subclasses' exit_code).
EXIT_PERMISSION = 4
EXIT_NOT_SUPPORTED = 5


@dataclass(slots=True, kw_only=True)
class DeviceCheck:
    """Everything :func:`check_device` found about one device, and its verdict.

    Attributes:
        index: The device's index on its backend.
        device_id: Its stable id.
        name: Its name.
        permission: ``"root"``, ``"direct"``, ``"agent grant"`` or ``"none"``.
        control_refusal: Why this process may not change it (``permission`` ``"none"``).
        persistence_mode: True/False where the driver reports it, else ``None``.
        mig_enabled: True/False where the driver reports it, else ``None``.
        can_lock_sm_clocks: The device can lock its compute clock at all.
        lock: What the driver reports about the clock lock (``None``: unreadable).
        power_limit_w: The power limit in force.
        default_power_limit_w: The device's default limit.
        counter: The energy counter and read cost (``None``: not measured).
        latency: The landing latency (``None``: ``load`` was not asked for).
        power_scope: What the power and energy readings cover.
        power_smoothing: Power smoothing (``enabled``, ``floor_w``, ``preset_profile``) where the
            device has it, else ``None`` (absent from the JSON).
        workload_power_profiles: The workload power profiles in force where the device has
            them, else ``None`` (absent from the JSON).
        foreign_power_limit: A limit powerlib did not set (``limit_w``, ``default_w``,
            ``set_by``), else ``None`` (absent from the JSON).
        warnings: Findings that do not stop a session (persistence off, an existing lock...).
        reasons: Why the device is not ready, first the one that sets ``exit_code``.
        exit_code: 0 when ready, else the exit code of the first reason.
    """

    index: int
    device_id: str
    name: str
    permission: str | None = None
    control_refusal: str | None = None
    persistence_mode: bool | None = None
    mig_enabled: bool | None = None
    can_lock_sm_clocks: bool = False
    lock: ClockLockState | None = None
    power_limit_w: float | None = None
    default_power_limit_w: float | None = None
    counter: CounterCheck | None = None
    latency: LatencyCheck | None = None
    power_scope: str | None = None
    power_smoothing: dict[str, object] | None = None
    workload_power_profiles: list[str] | None = None
    foreign_power_limit: dict[str, object] | None = None
    warnings: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    exit_code: int = 0

    @property
    def ready(self) -> bool:
        """No reason stops a session from controlling this device."""
        return not self.reasons

    @property
    def verdict(self) -> str:
        """``"ready"`` or ``"not ready: <reasons>"``, one line."""
        return "ready" if self.ready else "not ready: " + "; ".join(self.reasons)

    def fail(self, reason: str, exit_code: int) -> None:
        """Record a reason the device is not ready (the first one sets the exit code)."""
        self.reasons.append(reason)
        if self.exit_code == 0:
            self.exit_code = exit_code

    def to_json(self) -> dict[str, object]:
        """JSON-ready fields; NVIDIA's newer controls only where the device has them."""
        newer = {
            "power_smoothing": self.power_smoothing,
            "workload_power_profiles": self.workload_power_profiles,
            "foreign_power_limit": self.foreign_power_limit,
        }
        return {
            "index": self.index,
            "device_id": self.device_id,
            "name": self.name,
            "ready": self.ready,
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "reasons": list(self.reasons),
            "warnings": list(self.warnings),
            "permission": self.permission,
            "control_refusal": self.control_refusal,
            "persistence_mode": self.persistence_mode,
            "mig_enabled": self.mig_enabled,
            "can_lock_sm_clocks": self.can_lock_sm_clocks,
            "clock_lock": None if self.lock is None else self.lock.to_json(),
            "power_limit_w": self.power_limit_w,
            "default_power_limit_w": self.default_power_limit_w,
            "energy_counter": None if self.counter is None else self.counter.to_json(),
            "landing_latency": None if self.latency is None else self.latency.to_json(),
            "power_scope": self.power_scope,
            **{key: value for key, value in newer.items() if value is not None},
        }


@dataclass(slots=True, kw_only=True)
class NodeCheck:
    """The whole report: the backend, then one :class:`DeviceCheck` per device.

    Attributes:
        backend: The backend's registry name (what was asked for when it could not open).
        available: The backend opened.
        error: Why it could not open (one line), else ``None``.
        error_code: The exit code of that error (3: backend unavailable).
        versions: Driver and library versions (``None`` values: unknown).
        devices: The devices checked.
        duration_s: How long the counter was read per device.
        load: Whether the landing latency was measured under load.
    """

    backend: str
    available: bool = True
    error: str | None = None
    error_code: int = 0
    versions: dict[str, str | None] = field(default_factory=dict)
    devices: list[DeviceCheck] = field(default_factory=list)
    duration_s: float = 0.0
    load: bool = False

    @property
    def exit_code(self) -> int:
        """0 when all is ready, else the backend's error code or the first failing device's."""
        if not self.available:
            return self.error_code or 3
        return next((d.exit_code for d in self.devices if d.exit_code), 0)

    @property
    def ready(self) -> bool:
        """The backend opened and every device checked is ready."""
        return self.exit_code == 0

    def to_json(self) -> dict[str, object]:
        """The ``powerlib.check.v1`` object."""
        return {
            "schema": SCHEMA,
            "ready": self.ready,
            "exit_code": self.exit_code,
            "backend": {
                "name": self.backend,
                "available": self.available,
                "error": self.error,
                "versions": dict(self.versions),
            },
            "duration_s": self.duration_s,
            "load": self.load,
            "devices": [d.to_json() for d in self.devices],
        }
