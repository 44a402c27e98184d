"""How a session joins its job and claims its device, at the ``with`` line.

:func:`join_job` finds the job's ranks (the coordinator), this rank's stage and its progress
channel; :func:`open_for_control` opens this rank's device for a training session: it refuses,
in one line and before any lock or journal, a device the session cannot change
(:func:`check_control`), then starts the control session, the frequency controller and the
sampler; :func:`claim_device` takes the device's lock so that a second session on it fails at
its ``with`` line. :func:`open_for_measuring` opens what a disabled session reads (nothing it
cannot). What is opened is kept in a :class:`Job`, filled as it opens, so the session closes
exactly what opened when a later step fails. Both take the device's work follower
(:meth:`Device.work_follower <powerlib.device.Device.work_follower>`: a simulated GPU follows the
job's instructions, a disabled session's too); :meth:`Job.follow_work` tells it what runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from powerlib.backend import Backend
from powerlib.config import Settings
from powerlib.control import ControlSession
from powerlib.device import Device, DeviceKind, WorkFollower
from powerlib.errors import (
    BackendUnavailableError,
    DeviceBusyError,
    NotSupportedError,
    PermissionDeniedError,
    PowerlibError,
)
from powerlib.measurement.markers import cuda_marker
from powerlib.measurement.reader import warn_no_device
from powerlib.measurement.sampler import DeviceSampler
from powerlib.progress import Progress
from powerlib.registry import local_device, open_backend
from powerlib.runtime.controller import FrequencyController
from powerlib.runtime.coordination import Coordinator, default_coordinator
from powerlib.runtime.session_config import RunConfig

__all__ = [
    "Job",
    "check_control",
    "claim_device",
    "join_job",
    "open_for_control",
    "open_for_measuring",
    "select_device",
]

logger = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class Job:
    """What a session opened at its ``with`` line (each part ``None`` until it opened).

    Attributes:
        coordinator: The job's ranks.
        rank: This process's rank.
        stage: This rank's pipeline stage.
        progress: Where progress lines go (rank 0 by default).
        clock: The session's time source.
        settings: The settings the session runs with.
        own_backend: The backend the session opened itself (closed with it).
        device: This rank's device.
        idle_power_w: Its power before any change.
        power_limit_w: Its power limit before any change (an administrator's or the
            facility's, or the default): the ceiling the ``power-budget`` policy never raises;
            ``None`` where it cannot be read.
        control: The control session every change goes through.
        controller: The frequency controller.
        sampler: The device's reads (profile attribution, the closed loop, measuring).
        work: What makes the device follow the job's instructions (a simulated GPU's).
    """

    coordinator: Coordinator
    rank: int
    stage: int
    progress: Progress
    clock: Callable[[], float]
    settings: Settings
    own_backend: Backend | None = None
    device: Device | None = None
    idle_power_w: float | None = None
    power_limit_w: float | None = None
    control: ControlSession | None = None
    controller: FrequencyController | None = None
    sampler: DeviceSampler | None = None
    work: WorkFollower | None = None

    def follow_work(self, kind: str | None) -> None:
        """Tell the device's work follower what runs; never raises into training.

        Args:
            kind: An instruction of this (canonical) kind began; ``None``: the instruction that
                began last ended (this may block while its time follows the clock).
        """
        work = self.work
        if work is None:
            return
        try:
            if kind is None:
                work.instruction_ended()
            else:
                work.instruction_began(kind)
        except Exception as err:  # noqa: BLE001 - a device's follower never reaches training
            self.work = None
            logger.warning("powerlib: %s stopped following the job: %s", self.device, err)

    def close_work(self) -> None:
        """The job ends on the device: its work follower closes (the device idles); never raises."""
        work, self.work = self.work, None
        if work is None:
            return
        try:
            work.close()
        except Exception as err:  # noqa: BLE001 - closing the session never fails here
            logger.warning("powerlib: %s could not stop following the job: %s", self.device, err)


def join_job(run: RunConfig, num_stages: int, settings: Settings) -> Job:
    """The job's coordinator, this rank, its stage and its progress channel.

    Raises:
        InvalidArgumentError: No stage given and the ranks are not the stages, or the stage
            is out of range.
    """
    coordinator = run.coordinator or default_coordinator()
    return Job(
        coordinator=coordinator,
        rank=coordinator.rank,
        stage=run.resolve_stage(coordinator, num_stages),
        progress=Progress(coordinator.rank == 0 if run.progress is None else run.progress),
        clock=run.clock or time.perf_counter,
        settings=settings,
    )


def select_device(run: RunConfig, backend: Backend, settings: Settings) -> Device:
    """This session's device: ``run.device`` when given, else :func:`local_device`.

    Raises:
        DeviceNotFoundError: The named device does not exist, or none can be told apart.
    """
    if isinstance(run.device, Device):
        return run.device
    if run.device is not None:
        return backend.device(run.device)
    return local_device(backend, settings)


def _open_device(job: Job, run: RunConfig) -> tuple[Backend, Device]:
    """The backend (opened here unless given) and this rank's device (docs/real-gpu.md §4)."""
    backend = run.backend
    if not isinstance(backend, Backend):
        backend = job.own_backend = open_backend(backend, job.settings)
    job.device = device = select_device(run, backend, job.settings)
    job.work = device.work_follower()
    return backend, device


def open_for_control(job: Job, run: RunConfig, *, threaded: bool) -> None:
    """Open this rank's device for a training session.

    It refuses a device it cannot change first, then starts the control session, the controller
    (clock changes wait for a stream marker on a GPU) and the sampler.

    Raises:
        BackendUnavailableError, NotSupportedError, PermissionDeniedError: See
            :func:`check_control`.
        DeviceNotFoundError: The named device does not exist, or none can be told apart.
    """
    backend, device = _open_device(job, run)
    check_control(backend, device)  # one line, before any lock or journal (real-gpu.md §5)
    state = device.read_state()  # before any change
    job.idle_power_w, job.power_limit_w = state.power_w, state.power_limit_w
    job.control = control = ControlSession(
        backend, guardian=run.guardian, force=run.force, warn=False
    ).start()
    job.controller = FrequencyController(control, device, threaded=threaded, clock=job.clock)
    # On a GPU, clock changes wait for a marker on the stream (no synchronize in a hook).
    job.controller.marker = cuda_marker("auto")
    job.sampler = DeviceSampler(device, clock=job.clock)


def open_for_measuring(job: Job, run: RunConfig) -> None:
    """``enabled=False``: read the device if it can be read; change nothing, lock nothing.

    Only what was named explicitly fails: measuring never breaks training (docs/real-gpu.md §7).

    Raises:
        PowerlibError: The named backend cannot start, or the named device cannot be opened.
    """
    try:
        _, device = _open_device(job, run)
        job.sampler = DeviceSampler(device, clock=job.clock)
    except PowerlibError as err:
        opened = isinstance(run.backend, Backend) or job.own_backend is not None
        named = isinstance(run.backend, Backend) or (run.backend or job.settings.backend) != "auto"
        if (named and not opened) or (opened and run.device is not None):
            raise
        warn_no_device(f"disabled session: {err}")


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
