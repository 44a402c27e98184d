"""What a wall-clock simulated GPU runs while a session's job runs on it (issue 44).

A job that runs on the CPU (torch with gloo) under ``POWERLIB_BACKEND=simulated`` never launches
work on the simulated GPU, so without help the device idles at its lock floor whatever the job
does. A session therefore hands its instructions to the device's
:class:`~powerlib.device.WorkFollower` (:meth:`SimulatedDevice.work_follower
<powerlib.backends.simulated.SimulatedDevice.work_follower>`), and the device follows the job:

* **Power follows the work.** While an instruction runs, the device runs the
  :class:`~powerlib.backends.simulated_model.WorkUnit` of its kind (:data:`KIND_WORK`).
* **Blocked between instructions.** Once the job has begun, the device is blocked between
  instructions, as a real GPU waiting in a NCCL kernel is (:data:`BLOCKED_WORK`): its clock
  stays up (the lock's ceiling, else the maximum, as under load) at the power of a P2P-blocked
  GPU. So unlocked under load equals all-max: a plan that locks every instruction at the
  maximum clock draws exactly what the unlocked job draws. :meth:`close` idles it.
* **Time follows the clock** (``POWERLIB_SIM_TIME_FOLLOWS_CLOCK=1``, the default). The time
  ``d`` the host took between the instruction's begin and end is what the instruction takes at
  the maximum clock; at the clocks it ran at (the changes that landed while it ran included) it
  takes longer, and :meth:`SimulatedWorkFollower.instruction_ended` sleeps the difference. At one
  clock ``f`` the instruction lasts ``d · t(f) / t(f_max)`` with the model's
  ``t(f) = t_max · (α · f_max / f + 1 − α)``; across clock changes the work done at each clock
  adds up to ``d`` of work at the maximum. The noise of ``POWERLIB_SIM_NOISE`` scales the
  instruction's energy per second only: the host's time carries its own noise.

The follower never raises into training: the first error is logged once as a warning, and the
follower stops following (the device idles as it stood).
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from powerlib.backends.simulated_model import GpuModel, WorkUnit

__all__ = ["BLOCKED_WORK", "KIND_WORK", "LandingLog", "SimulatedWorkFollower", "stretched_end_s"]

logger = logging.getLogger(__name__)

# Shapes only (time_at_max_s is a unit): power depends on the shape, time on the host. The
# compute-bound share α = 0.7 is docs/perseus.md §5.2's synthetic pipeline (t = W·(0.3 + 0.7/x),
# backward 2x forward, same shape); SM activity u = α follows docs/kareus.md §5.1 ("u_c =
# t_comp/t_i: memory-bound kernels draw less"); the memory-bound share (1 − α) runs HBM at full
# rate [assumption]. Weight gradients are GEMMs without the activations' element-wise work, so
# more compute-bound [assumption: α = 0.8]. On the A100 (powerlib/gpu_specs.py) forward draws
# 85 + 0.7·259.2 + 0.3·60 = 284 W at 1410 MHz, under the 400 W cap on every model.
KIND_WORK: dict[str, WorkUnit] = {
    "forward": WorkUnit(
        time_at_max_s=1.0, compute_fraction=0.7, sm_activity=0.7, memory_activity=0.3
    ),
    "backward": WorkUnit(
        time_at_max_s=1.0, compute_fraction=0.7, sm_activity=0.7, memory_activity=0.3
    ),
    "backward_input": WorkUnit(
        time_at_max_s=1.0, compute_fraction=0.7, sm_activity=0.7, memory_activity=0.3
    ),
    "backward_weight": WorkUnit(
        time_at_max_s=1.0, compute_fraction=0.8, sm_activity=0.8, memory_activity=0.2
    ),
}
"""The work each instruction kind runs (the kinds of :mod:`powerlib.planning.pipeline`)."""

BLOCKED_WORK = WorkUnit(time_at_max_s=1.0, compute_fraction=0.0, sm_activity=0.0)
"""A GPU blocked in a NCCL receive: clock up, no SM switching, no HBM traffic, nothing that
scales with the clock. Its power is ``P_idle + P_clock·φ(f)``, 85 W on the A100 at 1410 MHz:
the measured P_block (83.64 W, 85 W; docs/perseus.md §1.4, ``GpuSpec.blocked_power_w``)."""


Lock = tuple[float, float] | None


class LandingLog:
    """When a device's running lock changed, as this process saw it (what a stretch runs on).

    Args:
        maxlen: The most changes kept (the oldest go first).
    """

    def __init__(self, maxlen: int = 4096) -> None:
        self._changes: collections.deque[tuple[float, Lock]] = collections.deque(maxlen=maxlen)

    def note(self, t_s: float, lock: Lock) -> None:
        """The running lock is ``lock`` from ``t_s`` on (nothing is noted if it already was)."""
        last = self._changes[-1] if self._changes else None
        if last is None or last[1] != lock:
            self._changes.append((t_s if last is None else max(t_s, last[0]), lock))

    def since(self, start_s: float) -> list[tuple[float, Lock]]:
        """The lock at ``start_s`` (from ``start_s``), then each change after it, by time."""
        changes = list(self._changes)
        before = sum(1 for t_s, _ in changes if t_s <= start_s)
        if before:
            changes[before - 1] = (start_s, changes[before - 1][1])
        return changes[max(before - 1, 0) :]


class FollowedDevice(Protocol):
    """What the follower needs of a :class:`~powerlib.backends.simulated.SimulatedDevice`."""

    @property
    def device_id(self) -> str:
        """The device's id (for the warning)."""
        ...

    model: GpuModel

    def begin_work(self, work: WorkUnit) -> float:
        """Start running ``work`` now."""
        ...

    def end_work(self) -> None:
        """Idle."""
        ...

    def running_clocks_mhz(self, start_s: float) -> tuple[float, list[tuple[float, float]]]:
        """``(now_s, [(from_s, freq_mhz), ...])``: the running clock from ``start_s`` on."""
        ...


def stretched_end_s(
    model: GpuModel,
    work: WorkUnit,
    start_s: float,
    clocks_mhz: Sequence[tuple[float, float]],
    work_at_max_s: float,
) -> float:
    """When work that takes ``work_at_max_s`` at the maximum clock ends, begun at ``start_s``.

    Args:
        model: The GPU's time model.
        work: The work's shape (its compute-bound share).
        start_s: When it began.
        clocks_mhz: ``(from_s, freq_mhz)`` by time: the clock from each time on (the first
            from ``start_s`` or before; the last holds for ever).
        work_at_max_s: Its duration at the maximum clock.

    Returns:
        The time it ends: at each clock, a second runs ``t(f_max) / t(f)`` seconds of the work.
    """
    at_max_s = model.duration_s(work, model.max_freq_mhz)
    remaining_s = work_at_max_s
    t_s = start_s
    for i, (from_s, freq_mhz) in enumerate(clocks_mhz):
        until_s = clocks_mhz[i + 1][0] if i + 1 < len(clocks_mhz) else math.inf
        if until_s <= t_s:
            continue
        t_s = max(t_s, from_s) if i else t_s  # the first clock runs from the start
        rate = at_max_s / model.duration_s(work, freq_mhz) if at_max_s > 0 else 1.0
        if remaining_s <= rate * (until_s - t_s):
            return t_s + remaining_s / rate
        remaining_s -= rate * (until_s - t_s)
        t_s = until_s
    return t_s + remaining_s  # no clock given: the maximum


class SimulatedWorkFollower:
    """Makes a wall-clock simulated GPU follow a session's instructions (module docstring).

    Args:
        device: The simulated GPU.
        now: The device's clock (seconds).
        time_follows_clock: Stretch each instruction to the time its clocks give it.
        sleep: How a stretch waits (``time.sleep``; tests pass a fake clock's advance).
    """

    def __init__(
        self,
        device: FollowedDevice,
        *,
        now: Callable[[], float],
        time_follows_clock: bool,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._device = device
        self._now = now
        self.time_follows_clock = time_follows_clock
        self._sleep = sleep
        self._running: tuple[WorkUnit, float] | None = None  # the instruction's work, its start
        self._stopped = False  # closed, or failed once

    @property
    def following(self) -> bool:
        """Still following the job (neither closed nor failed)."""
        return not self._stopped

    def instruction_began(self, kind: str) -> None:
        """The device runs ``kind``'s work (forward's for a kind it does not know)."""
        if self._stopped:
            return
        try:
            work = KIND_WORK.get(kind, KIND_WORK["forward"])
            self._device.begin_work(work)
            self._running = (work, self._now())
        except Exception as err:  # noqa: BLE001 - a follower never raises into training
            self._fail(err)

    def instruction_ended(self) -> None:
        """Stretch the instruction to its clocks' time (when asked), then block."""
        if self._stopped:
            return
        try:
            running, self._running = self._running, None
            if running is not None and self.time_follows_clock:
                work, start_s = running
                now_s, clocks_mhz = self._device.running_clocks_mhz(start_s)
                end_s = stretched_end_s(
                    self._device.model, work, start_s, clocks_mhz, now_s - start_s
                )
                if end_s > now_s:
                    self._sleep(end_s - now_s)
            self._device.begin_work(BLOCKED_WORK)
        except Exception as err:  # noqa: BLE001 - a follower never raises into training
            self._fail(err)

    def close(self) -> None:
        """The job ends: the device idles. Later calls do nothing."""
        if self._stopped:
            return
        self._stopped = True
        self._running = None
        try:
            self._device.end_work()
        except Exception as err:  # noqa: BLE001 - a follower never raises into training
            logger.warning(
                "powerlib: the simulated %s could not idle: %s", self._device.device_id, err
            )

    def _fail(self, err: Exception) -> None:
        """Warn once and stop following (the device is left as it stands)."""
        self._stopped = True
        self._running = None
        logger.warning(
            "powerlib: the simulated %s stopped following the job: %s", self._device.device_id, err
        )
