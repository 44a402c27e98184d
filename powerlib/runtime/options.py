"""What a session is told: how it runs (:class:`RunConfig`), and :func:`optimize`'s keywords.

A session's settings come in four groups: the workload and the planning choices
(:class:`~powerlib.runtime.planning_step.PlanSpec`), how it profiles
(:class:`~powerlib.runtime.profile_phase.ProfileConfig`), how it applies a plan
(:class:`~powerlib.runtime.apply_phase.ApplyConfig`) and how it runs (:class:`RunConfig`: mode,
device, coordinator, ...). :meth:`Session.from_config <powerlib.runtime.session.Session.from_config>`
takes the groups; :func:`optimize` (and ``Session(...)``) take every setting as one flat keyword.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from powerlib.config import Settings
from powerlib.control import ControlSession
from powerlib.device import Backend, Device
from powerlib.errors import DeviceBusyError, InvalidArgumentError, PowerlibError
from powerlib.runtime.coordination import Coordinator

if TYPE_CHECKING:
    from powerlib.runtime.session import Session

__all__ = ["MODES", "RunConfig", "claim_device", "optimize"]

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
    if not control.backend.persistent:
        return  # nothing is journaled or locked (the emulator)
    try:
        control.reset_sm_clocks(device)
    except DeviceBusyError:
        raise
    except PowerlibError as err:
        logger.info("could not reset the clocks of %s at the start: %s", device, err)


def optimize(
    *,
    num_stages: int,
    num_microbatches: int,
    mode: str = "auto",
    stage: int | None = None,
    schedule: str | None = None,
    num_chunks: int | None = None,
    placement: str | None = None,
    backend: Backend | str | None = None,
    device: int | str | Device | None = None,
    policy: str = "fastest",
    deadline_s: float | None = None,
    deadline_ratio: float | None = None,
    argmin: bool = False,
    max_slowdown: float = 0.001,
    switch_latency_s: float = 0.005,
    p_block_w: float | None = None,
    unit_time_s: float | None = None,
    profile_path: str | Path | None = None,
    plan_path: str | Path | None = None,
    out_dir: str | Path | None = "powerlib-out",
    freqs_mhz: Sequence[float] | None = None,
    warmup_iterations: int = 2,
    settle_iterations: int = 1,
    iterations_per_freq: int = 2,
    stop_after_rises: int = 3,
    coordinator: Coordinator | None = None,
    clock: Callable[[], float] | None = None,
    sync: Callable[[], None] | None = None,
    threaded: bool = True,
    progress: bool | None = None,
    guardian: bool = False,
    prefetch: bool = True,
    plot: bool = False,
    overlap_groups: Sequence[Sequence[int]] | None = None,
    settings: Settings | None = None,
) -> Session:
    """``with powerlib.optimize(num_stages=..., num_microbatches=...) as session:``.

    The same keywords make a :class:`~powerlib.runtime.session.Session` directly.

    Args:
        num_stages: Pipeline stages of the job.
        num_microbatches: Microbatches per iteration.
        mode: ``auto``, ``profile``, ``plan`` or ``apply``.
        stage: This rank's pipeline stage; default: the rank, when there is one rank per stage.
        schedule: ``1f1b`` (default), ``gpipe``, ``interleaved``, or ``recorded`` (plan only on
            the order the hooks record while profiling: zero-bubble and V schedules).
        num_chunks: Model chunks per stage (interleaved, V schedules); default 1.
        placement: ``looped`` (default) or ``v``: which model pieces a stage's chunks hold (see
            :mod:`powerlib.planning.pipeline`). Integrations set schedule, chunks and placement
            through :meth:`set_layout` when they know them. A saved plan (``apply`` mode) is
            checked against the ones given here or through :meth:`set_layout`.
        backend: A :class:`Backend`, a backend name, or ``None`` (``POWERLIB_BACKEND``).
        device: The device (index, id or :class:`Device`); default ``LOCAL_RANK`` or 0.
        policy: ``fastest`` (no slowdown), ``deadline`` or ``min-energy``.
        deadline_s: Straggler iteration time T′ for ``deadline``.
        deadline_ratio: T′ as a multiple of the all-max iteration time.
        argmin: The paper's emulation rule for ``deadline``.
        max_slowdown: Realized-slowdown guard for ``fastest`` and ``deadline`` (fraction;
            default 0.1 %).
        switch_latency_s: Clock-change latency the guard plans for (default 5 ms).
        p_block_w: Blocking power; default: measured between instructions while profiling.
        unit_time_s: Planner time unit; default: from the profile.
        profile_path: The profile to plan from (``plan`` mode).
        plan_path: The plan to apply (``apply`` mode).
        out_dir: Where rank 0 writes profile, frontier, plan and summary; ``None``: nowhere.
        freqs_mhz: Profile candidates; default: every supported clock from the top down.
        warmup_iterations: Discarded iterations at the highest frequency.
        settle_iterations: Discarded iterations after each clock change.
        iterations_per_freq: Measured iterations per frequency.
        stop_after_rises: Stop the sweep after this many frequencies of rising energy.
        coordinator: How ranks agree; default ``torch.distributed`` if initialised, else alone.
        clock: Time source in seconds; default ``time.perf_counter``.
        sync: Waits for the device before a time is read; default ``torch.cuda.synchronize``
            when CUDA is in use, else nothing.
        threaded: Apply frequencies on a controller thread (default) or inline (emulator).
        progress: Print progress to stderr; default on rank 0 only.
        guardian: Start the watchdog process that restores the device if this process is killed.
        prefetch: In the apply phase, request the next instruction's clock when one ends, so the
            switch overlaps the wait between instructions (after the order check).
        plot: Rank 0 also draws ``frontier.png`` in ``out_dir`` (``plot`` extra).
        overlap_groups: For overlap plans on NCCL: the global ranks of every group the overlapped
            collectives run on (every tensor/context-parallel group of the job, the same lists on
            every rank); default: the whole world. See :mod:`powerlib.runtime.launch_control`.
        settings: Settings; default from the environment.

    Returns:
        The session; enter it with ``with``.

    Raises:
        InvalidArgumentError: A bad option (a mode without its input file, bad sweep counts).
        PlanError: A bad planning option (an unknown policy, a deadline without T′).
    """
    from powerlib.runtime.session import Session  # noqa: PLC0415 - the session imports this module

    return Session(
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        mode=mode,
        stage=stage,
        schedule=schedule,
        num_chunks=num_chunks,
        placement=placement,
        backend=backend,
        device=device,
        policy=policy,
        deadline_s=deadline_s,
        deadline_ratio=deadline_ratio,
        argmin=argmin,
        max_slowdown=max_slowdown,
        switch_latency_s=switch_latency_s,
        p_block_w=p_block_w,
        unit_time_s=unit_time_s,
        profile_path=profile_path,
        plan_path=plan_path,
        out_dir=out_dir,
        freqs_mhz=freqs_mhz,
        warmup_iterations=warmup_iterations,
        settle_iterations=settle_iterations,
        iterations_per_freq=iterations_per_freq,
        stop_after_rises=stop_after_rises,
        coordinator=coordinator,
        clock=clock,
        sync=sync,
        threaded=threaded,
        progress=progress,
        guardian=guardian,
        prefetch=prefetch,
        plot=plot,
        overlap_groups=overlap_groups,
        settings=settings,
    )
