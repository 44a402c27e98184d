"""The device contract every backend implements.

A :class:`Device` is one physical thing whose power powerlib can read and control: a GPU, or a CPU
package. It has a stable identity (NVML UUID, PCI bus id, powercap zone), static facts
(:class:`DeviceInfo`), a power-state snapshot (:class:`PowerState`) and four operations: lock the
compute clock to a range or a single value, reset it, set the power limit, reset it.

The public methods here validate arguments once, for every backend (range checks, snapping to the
supported clock list, capability checks), then call the backend's ``_``-prefixed hook. A backend
therefore only translates: it never re-implements validation, and it never lets a vendor exception
escape (see :mod:`powerlib.errors`).

Units: W, J, s, °C and MHz, as floats; the names say so. "SM clock" means the compute clock: the
streaming-multiprocessor (graphics) clock on a GPU, the core clock of a CPU package.

A :class:`~powerlib.backend.Backend` opens the devices of one kind of hardware
(:mod:`powerlib.backend`); :mod:`powerlib.registry` chooses it.
"""

from __future__ import annotations

import bisect
import enum
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Protocol, TypeVar

from powerlib.errors import (
    DeviceError,
    InvalidArgumentError,
    NotSupportedError,
    TransientDeviceError,
)

__all__ = [
    "Capabilities",
    "ClockLockState",
    "Device",
    "DeviceInfo",
    "DeviceKind",
    "PowerState",
    "WorkFollower",
    "snap_freq_range_mhz",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

TRANSIENT_RETRY_DELAYS_S = (0.01, 0.05, 0.2)
"""Back-off before each retry of a write the driver answered with a transient error (a bounded
0.26 s in all): NVML's TIMEOUT/IN_USE clear within milliseconds when they clear at all."""

RESET_SETTLE_S = 0.25
"""How long a reset's read-back may still show the lock before the reset counts as ignored."""
_RESET_POLL_S = 0.01

LIMITING_REASONS = frozenset(
    {"sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"}
)
"""Clock-event reasons under which a GPU runs below its locked clock on purpose (power or heat)."""

# Requests within this distance of the supported range's ends are accepted and snapped; vendor clock
# lists are integers, so half a MHz absorbs float noise without accepting a real out-of-range value.
_FREQ_TOLERANCE_MHZ = 0.5


class DeviceKind(str, enum.Enum):
    """What a device is."""

    GPU = "gpu"
    CPU = "cpu"


@dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """What a device can do. Every operation not advertised here raises ``NotSupportedError``.

    Attributes:
        can_lock_sm_clocks: ``lock_sm_clocks`` / ``reset_sm_clocks`` work (given privilege).
        can_set_power_limit: ``set_power_limit`` works (given privilege).
        can_reset_power_limit: ``reset_power_limit`` works: the device knows its default limit.
        has_energy_counter: ``PowerState.energy_j`` is a hardware counter (else ``None``).
        has_power_reading: ``PowerState.power_w`` is available (else ``None``).
        has_temperature: ``PowerState.temperature_c`` is available (else ``None``).
        can_lock_memory_clocks: ``lock_memory_clocks`` / ``reset_memory_clocks`` work (NVIDIA
            Ampere and newer).
    """

    can_lock_sm_clocks: bool
    can_set_power_limit: bool
    can_reset_power_limit: bool
    has_energy_counter: bool
    has_power_reading: bool
    has_temperature: bool
    can_lock_memory_clocks: bool = False

    def names(self) -> tuple[str, ...]:
        """The names of the capabilities that are present, in declaration order."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name))


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceInfo:
    """Static facts about a device; they do not change while it is open.

    Attributes:
        device_id: Stable identity (UUID, PCI bus id, sysfs zone). Locks and journals use it.
        index: Position in its backend's device list (what ``--device 0`` means).
        name: Marketing or kernel name, e.g. ``"NVIDIA A100-SXM4-40GB"`` or ``"package-0"``.
        vendor: ``"nvidia"``, ``"amd"``, ``"intel"``, ...
        kind: GPU or CPU.
        backend: Registry name of the backend that opened it.
        supported_sm_freqs_mhz: Lockable compute clocks, ascending; empty if clocks cannot be locked.
        power_limit_range_w: ``(min, max)`` settable power limit, or ``None``.
        default_power_limit_w: The limit ``reset_power_limit`` restores, or ``None``.
        capabilities: What the device can do.
        is_simulated: True for simulated devices; results derived from them say so.
        supported_mem_freqs_mhz: Lockable memory clocks, ascending; empty if they cannot be locked.
        power_sampling_duty: Share of each energy-counter period, at its end, in which power
            is sampled (each update adds ``1 / duty`` times that window's energy; default 1:
            all of it). A100/H100: 0.25 (:func:`powerlib.gpu_specs.power_sampling_duty`).
    """

    device_id: str
    index: int
    name: str
    vendor: str
    kind: DeviceKind
    backend: str
    supported_sm_freqs_mhz: tuple[float, ...]
    power_limit_range_w: tuple[float, float] | None
    default_power_limit_w: float | None
    capabilities: Capabilities
    is_simulated: bool = False
    supported_mem_freqs_mhz: tuple[float, ...] = ()
    power_sampling_duty: float = 1.0

    def __post_init__(self) -> None:
        duty = self.power_sampling_duty
        if not (isinstance(duty, (int, float)) and 0 < duty <= 1):
            raise ValueError(f"power_sampling_duty must be in (0, 1], not {duty!r}")

    @property
    def min_sm_freq_mhz(self) -> float | None:
        """Lowest lockable compute clock, or ``None``."""
        return self.supported_sm_freqs_mhz[0] if self.supported_sm_freqs_mhz else None

    @property
    def max_sm_freq_mhz(self) -> float | None:
        """Highest lockable compute clock, or ``None``."""
        return self.supported_sm_freqs_mhz[-1] if self.supported_sm_freqs_mhz else None


@dataclass(frozen=True, slots=True, kw_only=True)
class PowerState:
    """One snapshot of a device's power state. ``None`` means "this device cannot tell".

    Attributes:
        device_id: The device it was read from.
        timestamp_s: When it was read (``time.time()``; virtual time for simulated devices).
        power_w: Power draw.
        energy_j: Cumulative energy counter. Only differences are meaningful; the counter never
            decreases while the device is open (wraparound is handled by the backend).
        sm_freq_mhz: Current compute clock.
        power_limit_w: Power limit in force.
        temperature_c: Temperature.
        locked_sm_freqs_mhz: ``(min, max)`` clock lock in force when the backend can tell (NVML
            cannot read it back), else ``None``.
        memory_energy_j: Cumulative energy of the device's memory domain (RAPL dram), if any.
    """

    device_id: str
    timestamp_s: float
    power_w: float | None
    energy_j: float | None
    sm_freq_mhz: float | None
    power_limit_w: float | None
    temperature_c: float | None
    locked_sm_freqs_mhz: tuple[float, float] | None = None
    memory_energy_j: float | None = None


def snap_freq_range_mhz(
    supported_mhz: Sequence[float], min_mhz: float, max_mhz: float
) -> tuple[float, float]:
    """Validate a requested clock range and snap each end to the nearest supported clock.

    Ties go to the lower clock. Snapping is monotone, so ``min <= max`` still holds afterwards.

    Args:
        supported_mhz: Supported clocks, ascending, non-empty.
        min_mhz: Requested lower bound.
        max_mhz: Requested upper bound.

    Returns:
        The snapped ``(min_mhz, max_mhz)``.

    Raises:
        InvalidArgumentError: A value is not finite, ``min > max``, or a value lies outside the
            supported range.
    """
    for value in (min_mhz, max_mhz):
        if not math.isfinite(value):
            raise InvalidArgumentError(f"clock must be a finite number of MHz, got {value!r}")
    if min_mhz > max_mhz:
        raise InvalidArgumentError(
            f"clock range is empty: min {min_mhz:g} MHz > max {max_mhz:g} MHz"
        )
    lo, hi = supported_mhz[0], supported_mhz[-1]
    for value in (min_mhz, max_mhz):
        if value < lo - _FREQ_TOLERANCE_MHZ or value > hi + _FREQ_TOLERANCE_MHZ:
            raise InvalidArgumentError(
                f"{value:g} MHz is outside the supported range {lo:g}-{hi:g} MHz"
            )
    return _nearest(supported_mhz, min_mhz), _nearest(supported_mhz, max_mhz)


def _nearest(sorted_values: Sequence[float], value: float) -> float:
    i = bisect.bisect_left(sorted_values, value)
    if i == 0:
        return sorted_values[0]
    if i == len(sorted_values):
        return sorted_values[-1]
    below, above = sorted_values[i - 1], sorted_values[i]
    return above if above - value < value - below else below


@dataclass(frozen=True, slots=True, kw_only=True)
class ClockLockState:
    """What the driver reports about the compute-clock lock now (docs/real-gpu.md §1).

    Attributes:
        locked: True: a lock is in force; False: none is; ``None``: the driver cannot tell.
            NVML has no getter for a locked range: its backend says True when the clock-event
            reason "applications clocks setting" is set and ``None`` otherwise (that reason is
            only reported while the setting holds the clock down).
        range_mhz: The ``(min, max)`` in force when the driver reports it (sysfs, amdsmi, the
            simulator), else ``None``.
        running_mhz: The clock the device runs at now. Only meaningful under load: an idle GPU
            parks its clock low whatever the lock says.
        reasons: Why the clock is what it is (NVML's clock-event reasons: ``gpu_idle``,
            ``sw_power_cap``, ...); empty when the driver does not say.
    """

    locked: bool | None
    range_mhz: tuple[float, float] | None = None
    running_mhz: float | None = None
    reasons: tuple[str, ...] = ()

    @property
    def idle(self) -> bool:
        """The driver says the device is idle (its running clock says nothing about a lock)."""
        return "gpu_idle" in self.reasons

    @property
    def limited(self) -> tuple[str, ...]:
        """The reasons that hold the clock below its lock (power cap, thermal, brake)."""
        return tuple(r for r in self.reasons if r in LIMITING_REASONS)

    def to_json(self) -> dict[str, object]:
        """JSON-ready fields."""
        return {
            "locked": self.locked,
            "range_mhz": None if self.range_mhz is None else list(self.range_mhz),
            "running_mhz": self.running_mhz,
            "reasons": list(self.reasons),
        }


class WorkFollower(Protocol):
    """Lets a simulated device follow the job's instructions (:meth:`Device.work_follower`).

    A session calls it from its hooks; none of its methods may raise into training.
    """

    def instruction_began(self, kind: str) -> None:
        """An instruction of ``kind`` (``forward``, ``backward``, ...) starts running."""

    def instruction_ended(self) -> None:
        """The instruction that began last ends (may block: its time may follow the clock)."""

    def close(self) -> None:
        """The job stops running on the device (it idles)."""


class Device(ABC):
    """One controllable device. Subclasses implement the ``_``-prefixed hooks.

    The public methods check capabilities and arguments, so a hook only ever sees a valid request:
    clocks already snapped to ``supported_sm_freqs_mhz``, a power limit inside
    ``power_limit_range_w``.
    """

    def __init__(self, info: DeviceInfo) -> None:
        self._info = info
        self.last_sm_readback: ClockLockState | None = None
        """What the driver reported right after the last clock lock or reset (``None``: it
        could not be read back)."""

    @property
    def info(self) -> DeviceInfo:
        """Static facts about the device."""
        return self._info

    @property
    def device_id(self) -> str:
        """The stable id."""
        return self._info.device_id

    @property
    def index(self) -> int:
        """Position in the backend's device list."""
        return self._info.index

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self._info.index} {self._info.device_id} {self._info.name!r}>"
        )

    # -- reads ---------------------------------------------------------------------------------

    def read_state(self) -> PowerState:
        """Read a power-state snapshot. Never needs privilege beyond what listing the device needed."""
        return self._read_state()

    def details(self) -> Mapping[str, object]:
        """Backend-specific facts for ``powerlib status`` (JSON-serialisable). Empty by default."""
        return {}

    def read_sm_lock(self) -> ClockLockState:
        """What the driver reports about the compute-clock lock now (never this process's memory).

        The default reads :meth:`read_state`: backends whose ``locked_sm_freqs_mhz`` is read from
        the device (sysfs, amdsmi, the simulator) need nothing more; NVML overrides it.
        """
        return self._read_sm_lock()

    def work_follower(self) -> WorkFollower | None:
        """What makes a simulated device follow the job's work; ``None`` (a real one runs it)."""
        return None

    def mig_enabled(self) -> bool | None:
        """Whether the GPU is split into MIG instances (read from the driver); ``None``: unknown.

        With MIG on, one clock serves every instance's tenant: sessions refuse to change it.
        """
        return None

    # -- writes --------------------------------------------------------------------------------

    def validate_sm_clocks(
        self, min_mhz: float, max_mhz: float | None = None
    ) -> tuple[float, float]:
        """Check a clock-lock request without applying it; returns the snapped range.

        Raises:
            NotSupportedError: The device cannot lock clocks.
            InvalidArgumentError: Out of range, empty range, or not finite.
        """
        self._require(self._info.capabilities.can_lock_sm_clocks, "lock_sm_clocks", "clock locking")
        try:
            return snap_freq_range_mhz(
                self._info.supported_sm_freqs_mhz, min_mhz, min_mhz if max_mhz is None else max_mhz
            )
        except InvalidArgumentError as err:
            raise InvalidArgumentError(
                err.message, device=self.device_id, operation="lock_sm_clocks"
            ) from None

    def validate_power_limit(self, power_limit_w: float) -> float:
        """Check a power limit without applying it; returns it unchanged.

        Raises:
            NotSupportedError: The device has no settable power limit.
            InvalidArgumentError: Outside ``power_limit_range_w`` or not finite.
        """
        self._require(
            self._info.capabilities.can_set_power_limit, "set_power_limit", "power limiting"
        )
        if not math.isfinite(power_limit_w):
            raise InvalidArgumentError(
                f"power limit must be a finite number of W, got {power_limit_w!r}",
                device=self.device_id,
                operation="set_power_limit",
            )
        limits = self._info.power_limit_range_w
        if limits is not None and not (limits[0] - 1e-9 <= power_limit_w <= limits[1] + 1e-9):
            raise InvalidArgumentError(
                f"{power_limit_w:g} W is outside the allowed range {limits[0]:g}-{limits[1]:g} W",
                device=self.device_id,
                operation="set_power_limit",
            )
        return power_limit_w

    def lock_sm_clocks(self, min_mhz: float, max_mhz: float | None = None) -> tuple[float, float]:
        """Lock the compute clock to ``[min_mhz, max_mhz]`` (a single value when ``max_mhz`` is None).

        Returns:
            The range actually locked, after snapping to supported clocks.

        Raises:
            NotSupportedError: The device cannot lock clocks.
            InvalidArgumentError: Out of range, empty range, or not finite; nothing is changed.
            PermissionDeniedError: The process lacks the needed privilege.
        """
        lo, hi = self.validate_sm_clocks(min_mhz, max_mhz)
        self._retrying("lock_sm_clocks", lambda: self._lock_sm_clocks(lo, hi))
        self.last_sm_readback = self._verify_sm_lock((lo, hi))
        return lo, hi

    def reset_sm_clocks(self) -> None:
        """Remove any clock lock (the device's default clock policy applies again). Idempotent.

        Raises:
            DeviceError: The driver still reports a lock afterwards.
        """
        self._require(
            self._info.capabilities.can_lock_sm_clocks, "reset_sm_clocks", "clock locking"
        )
        self._retrying("reset_sm_clocks", self._reset_sm_clocks)
        self.last_sm_readback = self._verify_sm_lock(None)

    def set_power_limit(self, power_limit_w: float) -> float:
        """Set the power limit.

        Returns:
            The limit written (the backend may round it to its granularity).

        Raises:
            NotSupportedError: The device has no settable power limit.
            InvalidArgumentError: Outside ``power_limit_range_w`` or not finite; nothing is changed.
            PermissionDeniedError: The process lacks the needed privilege.
        """
        limit_w = self.validate_power_limit(power_limit_w)
        return float(self._retrying("set_power_limit", lambda: self._set_power_limit(limit_w)))

    def reset_power_limit(self) -> None:
        """Restore the default power limit. Idempotent."""
        self._require(
            self._info.capabilities.can_reset_power_limit,
            "reset_power_limit",
            "a known default power limit",
        )
        self._retrying("reset_power_limit", self._reset_power_limit)

    def lock_memory_clocks(
        self, min_mhz: float, max_mhz: float | None = None
    ) -> tuple[float, float]:
        """Lock the memory clock to a range (a single value when ``max_mhz`` is None).

        Returns:
            The range locked, snapped to ``supported_mem_freqs_mhz``.

        Raises:
            NotSupportedError: The device cannot lock memory clocks.
            InvalidArgumentError: Out of range, empty range, or not finite; nothing is changed.
            PermissionDeniedError: The process lacks the needed privilege.
        """
        self._require(
            self._info.capabilities.can_lock_memory_clocks,
            "lock_memory_clocks",
            "memory clock locking",
        )
        try:
            lo, hi = snap_freq_range_mhz(
                self._info.supported_mem_freqs_mhz,
                min_mhz,
                min_mhz if max_mhz is None else max_mhz,
            )
        except InvalidArgumentError as err:
            raise InvalidArgumentError(
                err.message, device=self.device_id, operation="lock_memory_clocks"
            ) from None
        self._retrying("lock_memory_clocks", lambda: self._lock_memory_clocks(lo, hi))
        return lo, hi

    def reset_memory_clocks(self) -> None:
        """Remove any memory clock lock. Idempotent."""
        self._require(
            self._info.capabilities.can_lock_memory_clocks,
            "reset_memory_clocks",
            "memory clock locking",
        )
        self._retrying("reset_memory_clocks", self._reset_memory_clocks)

    def close(self) -> None:  # noqa: B027 - optional hook, deliberately not abstract
        """Release backend resources. Does not change device settings."""

    # -- hooks -----------------------------------------------------------------------------------

    @abstractmethod
    def _read_state(self) -> PowerState: ...

    @abstractmethod
    def _lock_sm_clocks(self, min_mhz: float, max_mhz: float) -> None: ...

    @abstractmethod
    def _reset_sm_clocks(self) -> None: ...

    @abstractmethod
    def _set_power_limit(self, power_limit_w: float) -> float: ...

    @abstractmethod
    def _reset_power_limit(self) -> None: ...

    def _read_sm_lock(self) -> ClockLockState:
        st = self.read_state()
        locked = st.locked_sm_freqs_mhz
        return ClockLockState(
            locked=locked is not None, range_mhz=locked, running_mhz=st.sm_freq_mhz
        )

    def _lock_memory_clocks(self, min_mhz: float, max_mhz: float) -> None:
        raise NotImplementedError  # only called when can_lock_memory_clocks is advertised

    def _retrying(self, operation: str, write: Callable[[], T]) -> T:
        """Run one driver write, retrying a transient error a bounded number of times."""
        for delay_s in (*TRANSIENT_RETRY_DELAYS_S, None):
            try:
                return write()
            except TransientDeviceError as err:
                if delay_s is None:
                    raise
                logger.info("%s: %s: %s; retrying in %g s", self.device_id, operation, err, delay_s)
                time.sleep(delay_s)
        raise AssertionError("unreachable")  # pragma: no cover

    def _verify_sm_lock(self, wanted: tuple[float, float] | None) -> ClockLockState | None:
        """Read the lock back from the driver after a write (``wanted`` ``None``: a reset).

        Only what the driver states for certain is an error: a reported range that is not the
        one asked for, no lock after a lock, a lock after a reset. A running clock that has not
        landed yet is not checked here (it lands within the switch latency; the runtime and
        ``powerlib check --load`` measure that).

        Raises:
            DeviceError: The driver contradicts the write.
        """
        try:
            state = self._retrying("read_sm_lock", self._read_sm_lock)
        except (NotSupportedError, TransientDeviceError) as err:
            logger.debug("%s: the lock could not be read back: %s", self.device_id, err)
            return None
        op = "lock_sm_clocks" if wanted is not None else "reset_sm_clocks"
        if wanted is None:
            waited_s = 0.0
            while state.locked and waited_s < RESET_SETTLE_S:
                # A driver may report the lock's clock-event reason for a moment after a reset
                # (NVML's reflects the clock now): read again before calling the reset ignored.
                time.sleep(_RESET_POLL_S)
                waited_s += _RESET_POLL_S
                try:
                    state = self._read_sm_lock()
                except (NotSupportedError, TransientDeviceError):
                    return None
            if state.locked:
                shown = (
                    "" if state.range_mhz is None else " ({:g}-{:g} MHz)".format(*state.range_mhz)
                )
                raise DeviceError(
                    f"the clock lock is still in force after a reset{shown}: the driver ignored "
                    "the reset",
                    device=self.device_id,
                    operation=op,
                )
            return state
        if state.locked is False:
            raise DeviceError(
                f"the lock to {wanted[0]:g}-{wanted[1]:g} MHz did not take effect: the driver "
                "reports no lock",
                device=self.device_id,
                operation=op,
            )
        got = state.range_mhz
        if got is not None and (
            abs(got[0] - wanted[0]) > _FREQ_TOLERANCE_MHZ
            or abs(got[1] - wanted[1]) > _FREQ_TOLERANCE_MHZ
        ):
            raise DeviceError(
                f"the driver applied {got[0]:g}-{got[1]:g} MHz, not the {wanted[0]:g}-{wanted[1]:g} "
                "MHz asked for",
                device=self.device_id,
                operation=op,
            )
        return state

    def _reset_memory_clocks(self) -> None:
        raise NotImplementedError

    def _require(self, supported: bool, operation: str, feature: str) -> None:
        if not supported:
            raise NotSupportedError(
                f"{self._info.name} ({self._info.backend} backend) does not support {feature}",
                device=self.device_id,
                operation=operation,
            )
