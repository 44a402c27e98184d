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

from powerlib.backend import Backend
from powerlib.config import Settings
from powerlib.control import ControlSession
from powerlib.device import Device, DeviceKind
from powerlib.errors import (
    BackendUnavailableError,
    DeviceBusyError,
    InvalidArgumentError,
    NotSupportedError,
    PermissionDeniedError,
    PowerlibError,
)
from powerlib.registry import local_device
from powerlib.runtime.coordination import Coordinator
from powerlib.runtime.listeners import InstructionListener

DISABLE_ENV = "POWERLIB_DISABLE"
"""Set to 1 to run every session disabled (measure only, no device change)."""

__all__ = [
    "DISABLE_ENV",
    "MODES",
    "LazyCudaSync",
    "RunConfig",
    "check_control",
    "claim_device",
]

logger = logging.getLogger(__name__)

MODES = ("auto", "profile", "plan", "apply")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """How a session runs: what it does, on which device, with which ranks.

    Attributes:
        mode: ``auto``, ``profile``, ``plan`` or ``apply``.
        stage: This rank's pipeline stage; default: the rank, when there is one rank per stage.
        backend: A :class:`Backend`, a backend name, or ``None`` (``POWERLIB_BACKEND``).
        device: The device (index, id or :class:`Device`); default this process's CUDA device,
            else ``LOCAL_RANK`` (:func:`powerlib.registry.local_device`).
        profile_path: The profile to plan from (``plan`` mode).
        plan_path: The plan to apply (``apply`` mode).
        coordinator: How ranks agree; default ``torch.distributed`` if initialised, else alone.
        clock: Time source in seconds; default ``time.perf_counter``.
        sync: Waits for the device before a time is read; default ``torch.cuda.synchronize``
            once CUDA is initialised, else nothing (decided at each call).
        progress: Print progress to stderr; default on rank 0 only.
        guardian: Start the watchdog process that restores the device if this process is
            killed; default: on when the backend changes devices directly and persistently (real
            hardware, not the agent; docs/real-gpu.md §6).
        listeners: Instruction listeners the session registers before it starts
            (:mod:`powerlib.runtime.listeners`; Kareus's launch control).
        settings: Settings; default from the environment.
        enabled: ``False`` (or ``POWERLIB_DISABLE=1`` in the environment) runs the same hooks
            and measures every iteration's time and energy, but changes no device and takes
            no lock: the A side of an A/B run.
        force: Take a GPU whose clocks someone else locked (an administrator's
            ``nvidia-smi -lgc``), although NVML cannot read that lock back: the session's
            restore then unlocks it (docs/real-gpu.md §1). Without it such a GPU is refused at
            the ``with`` line.

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
    guardian: bool | None = None
    listeners: Sequence[InstructionListener] = ()
    settings: Settings | None = None
    enabled: bool = True
    force: bool = False

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

    def select_device(self, backend: Backend, settings: Settings) -> Device:
        """This session's device: :attr:`device` when given, else :func:`local_device`.

        Raises:
            DeviceNotFoundError: The named device does not exist, or none can be told apart.
        """
        if isinstance(self.device, Device):
            return self.device
        if self.device is not None:
            return backend.device(self.device)
        return local_device(backend, settings)

    def resolve_sync(self) -> Callable[[], None]:
        """:attr:`sync`, or a wait that is ``torch.cuda.synchronize`` once CUDA is initialised.

        The default is decided at each call, not here: a session entered before the model
        moves to the GPU still waits for kernels later (docs/real-gpu.md §4).
        """
        if self.sync is not None:
            return self.sync
        return LazyCudaSync()


class LazyCudaSync:
    """``torch.cuda.synchronize`` once CUDA is initialised, nothing before (docs/real-gpu.md §4).

    Never imports torch (a CPU job does not have it); each call before CUDA is up costs a
    dictionary look-up and one ``is_initialized()``, and the synchronize is kept from then on.
    """

    def __init__(self) -> None:
        self._sync: Callable[[], None] | None = None

    def __call__(self) -> None:
        """Wait for the device when CUDA is up; return at once before."""
        sync = self._sync
        if sync is None:
            torch = sys.modules.get("torch")
            if torch is None or not torch.cuda.is_initialized():
                return
            sync = self._sync = torch.cuda.synchronize
        sync()


def check_control(backend: Backend, device: Device) -> None:
    """Refuse, at the ``with`` line, a training session that cannot change its device.

    Runs before any lock or journal, in this order: the device must be a GPU (``auto`` may
    have fallen back to the CPU sysfs backend), not in MIG mode as the driver reports it, and
    the process must be allowed to change it (:meth:`Backend.control_refusal
    <powerlib.backend.Backend.control_refusal>`: root, or the agent). Each refusal is one line
    (docs/real-gpu.md §4, §5).

    Raises:
        BackendUnavailableError: The device is not a GPU.
        NotSupportedError: The GPU is in MIG mode.
        PermissionDeniedError: This process may not change the device.
    """
    info = device.info
    if info.kind != DeviceKind.GPU:
        raise BackendUnavailableError(
            f"a training session changes GPU clocks, but the {backend.name} backend was picked "
            f"and {device.device_id} is a {info.kind.value}: set POWERLIB_BACKEND to a GPU backend "
            "(nvidia, amd, agent; simulated without a GPU), or pass enabled=False to measure only"
        )
    try:
        mig = device.mig_enabled()
    except PowerlibError as err:
        logger.info("powerlib: could not read the MIG mode of %s: %s", device.device_id, err)
        mig = None
    if mig:
        raise NotSupportedError(
            f"{device.device_id} is in MIG mode: one clock serves every MIG instance's tenant, "
            "so a training session does not change it; disable MIG (nvidia-smi -i <gpu> -mig 0) "
            "or pass enabled=False to measure only"
        )
    refusal = backend.control_refusal()
    if refusal is not None:
        raise PermissionDeniedError(refusal)


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
