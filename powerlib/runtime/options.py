"""What a session is told: how it runs (:class:`RunConfig`), and how it claims its device.

A session's settings come in four groups: the workload and the planning choices
(:class:`~powerlib.runtime.planning_step.PlanSpec`), how it profiles
(:class:`~powerlib.runtime.profile_phase.ProfileConfig`), how it applies a plan
(:class:`~powerlib.runtime.apply_phase.ApplyConfig`) and how it runs (:class:`RunConfig`: mode,
device, coordinator, ...). :meth:`Session.from_config <powerlib.runtime.session.Session.from_config>`
takes the groups; ``powerlib.optimize(...)`` (``Session(...)``) takes every setting as one flat
keyword.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from powerlib.config import Settings
from powerlib.control import ControlSession
from powerlib.device import Backend, Device
from powerlib.errors import DeviceBusyError, InvalidArgumentError, PowerlibError
from powerlib.runtime.coordination import Coordinator

DISABLE_ENV = "POWERLIB_DISABLE"
"""Set to 1 to run every session disabled (measure only, no device change)."""

__all__ = ["DISABLE_ENV", "MODES", "RunConfig", "claim_device"]

logger = logging.getLogger(__name__)

MODES = ("auto", "profile", "plan", "apply")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """How a session runs: what it does, on which device, with which ranks.

    Attributes:
        mode: ``auto``, ``profile``, ``plan`` or ``apply``.
        stage: This rank's pipeline stage; default: the rank, when there is one rank per stage.
        backend: A :class:`Backend`, a backend name, or ``None`` (``POWERLIB_BACKEND``).
        device: The device (index, id or :class:`Device`); default ``LOCAL_RANK`` or 0.
        profile_path: The profile to plan from (``plan`` mode).
        plan_path: The plan to apply (``apply`` mode).
        coordinator: How ranks agree; default ``torch.distributed`` if initialised, else alone.
        clock: Time source in seconds; default ``time.perf_counter``.
        sync: Waits for the device before a time is read; default ``torch.cuda.synchronize``
            when CUDA is in use, else nothing.
        progress: Print progress to stderr; default on rank 0 only.
        guardian: Start the watchdog process that restores the device if this process is killed.
        overlap_groups: For overlap plans on NCCL: the global ranks of every group the
            overlapped collectives run on; default: the whole world.
        settings: Settings; default from the environment.
        enabled: ``False`` (or ``POWERLIB_DISABLE=1`` in the environment) runs the same hooks
            and measures every iteration's time and energy, but changes no device and takes
            no lock: the A side of an A/B run.

    Raises:
        InvalidArgumentError: An unknown mode, or one that lacks its input file.
    """

    mode: str = "auto"
    stage: int | None = None
    backend: Backend | str | None = None
    device: int | str | Device | None = None
    profile_path: str | Path | None = None
    plan_path: str | Path | None = None
    coordinator: Coordinator | None = None
    clock: Callable[[], float] | None = None
    sync: Callable[[], None] | None = None
    progress: bool | None = None
    guardian: bool = False
    overlap_groups: Sequence[Sequence[int]] | None = None
    settings: Settings | None = None
    enabled: bool = True

    @property
    def disabled(self) -> bool:
        """``enabled=False``, or ``POWERLIB_DISABLE`` set to 1/true/yes/on."""
        flag = os.environ.get(DISABLE_ENV, "").strip().lower()
        return not self.enabled or flag in ("1", "true", "yes", "on")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "plan" and self.profile_path is None:
            raise InvalidArgumentError("mode 'plan' needs profile_path (a saved profile)")
        if self.mode == "apply" and self.plan_path is None:
            raise InvalidArgumentError("mode 'apply' needs plan_path (a saved plan)")

    def resolve_stage(self, coordinator: Coordinator, num_stages: int) -> int:
        """:attr:`stage`, or the coordinator's rank when every rank is one stage.

        Raises:
            InvalidArgumentError: No stage given and the ranks are not the stages, or the stage
                is out of range.
        """
        stage = self.stage
        if stage is None:
            if coordinator.world_size != num_stages:
                raise InvalidArgumentError(
                    f"{coordinator.world_size} rank(s) but {num_stages} stage(s): "
                    "pass stage= (this rank's pipeline stage)"
                )
            stage = coordinator.rank
        if not 0 <= stage < num_stages:
            raise InvalidArgumentError(f"stage {stage} is out of range for {num_stages} stage(s)")
        return stage

    def selector(self, settings: Settings) -> int | str:
        """Which device of the backend: :attr:`device`, else ``LOCAL_RANK``, else 0."""
        if self.device is None:
            return settings.local_rank or 0
        assert not isinstance(self.device, Device)  # a Device is used as it is
        return self.device

    def resolve_sync(self) -> Callable[[], None]:
        """:attr:`sync`, or ``torch.cuda.synchronize`` when torch is imported and CUDA is up."""
        if self.sync is not None:
            return self.sync
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            sync: Callable[[], None] = torch.cuda.synchronize
            return sync
        return lambda: None


def claim_device(control: ControlSession, device: Device) -> None:
    """Take the device's lock now, so a second session on it fails at its ``with`` line.

    The lock comes with the first change the session journals; without this, that would
    be the first clock change inside a hook, where a busy device can only degrade the
    session (and another session's clocks would be reset under it). Resetting the SM
    clocks is that first change: the baseline every mode starts from, restored at exit.
    Only :class:`DeviceBusyError` is raised; a driver that refuses the reset is left to
    the first clock change, which warns once and leaves training alone.

    Raises:
        DeviceBusyError: Another session, in this process or another, holds the device.
    """
    if not (control.backend.persistent or getattr(control.backend, "remote", False)):
        return  # nothing is journaled or locked (the emulator)
    try:
        control.reset_sm_clocks(device)
    except DeviceBusyError:
        raise
    except PowerlibError as err:
        logger.info("could not reset the clocks of %s at the start: %s", device, err)
