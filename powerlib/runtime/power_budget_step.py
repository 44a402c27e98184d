"""The ``power-budget`` policy in a session: rank 0 plans the limits, every rank sets its own.

Planning (rank 0, :func:`plan_budget`, called by the planning step instead of the frontier):
the gathered profile and the pipeline's DAG go to
:func:`~powerlib.planning.power_budget.plan_power_budget`, with each stage's administrator
limit the lowest limit its ranks' GPUs had (``ProfilePayload.power_limit_w``: powerlib changes
no limit while profiling, so it is the one they had when the session started). The budget is
``budget_w``, or ``budget_fraction`` of those limits summed over every rank. A stage of several
ranks (tensor or context parallel) sets one limit on each of its GPUs, so the planner's budget
is the job's divided by the most ranks any stage has (the sum over GPUs stays within it). The
plan (:func:`~powerlib.planning.power_budget.limits_plan`) carries each stage's limit and locks
every instruction at the clock its kind runs at under that limit (docs/perseus.md §7).

Applying (every rank, :func:`apply_power_limit`, when the plan is accepted): the stage's limit
is set through the control session (journaled before the write, restored on every exit path,
by ``powerlib restore`` after a kill), never above the limit the device had when the session
started (an administrator's or the facility's, :attr:`Job.power_limit_w
<powerlib.runtime.claim.Job.power_limit_w>`), and read back from the device. The closed loop
does not check such a plan (the flow runs no rounds for a plan with limits): its reference
windows run every clock at the maximum, which a budget exists to forbid.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from powerlib.device import Device
from powerlib.errors import DeviceError, InvalidArgumentError, PlanError, PowerlibError
from powerlib.planning.pipeline import Instruction, build_dag
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.power_budget import PowerLimitModel, limits_plan, plan_power_budget
from powerlib.planning.profile import Profile
from powerlib.planning.workflow import PlanRequest, SessionInputs, resolve_order, resolve_p_block
from powerlib.progress import Progress
from powerlib.runtime.claim import Job
from powerlib.runtime.records import NoPlan, Planned, ProfilePayload
from powerlib.runtime.session_config import SessionConfig

__all__ = ["apply_power_limit", "device_power_limit_w", "plan_budget", "stage_limits_w"]

logger = logging.getLogger(__name__)

READ_BACK_TOLERANCE_W = 1.0
"""A limit that reads back within this of the one set was set (NVML's milliwatt rounding)."""


def device_power_limit_w(device: Device) -> float | None:
    """The power limit ``device`` holds now (W), or ``None`` where it cannot be read; never raises."""
    try:
        return device.read_state().power_limit_w
    except PowerlibError as err:
        logger.debug("%s: power limit not read: %s", device.device_id, err)
        return None


def stage_limits_w(
    profiles: Sequence[ProfilePayload], num_stages: int
) -> tuple[list[float] | None, float | None, int]:
    """``(per stage, summed, ranks per stage)``: the limits the ranks' GPUs reported.

    Per stage the lowest of its ranks' limits; summed over every rank (what
    ``budget_fraction`` is a share of); the most ranks any stage has. ``None`` for both
    where a stage has no rank that read its limit (a saved profile: no ranks reported).
    """
    by_stage: dict[int, list[float]] = {}
    for p in profiles:
        limit = p.power_limit_w
        if isinstance(limit, int | float) and math.isfinite(limit) and limit > 0:
            by_stage.setdefault(p.stage, []).append(float(limit))
    ranks = max((sum(1 for p in profiles if p.stage == s) for s in range(num_stages)), default=1)
    if sorted(by_stage) != list(range(num_stages)):
        return None, None, max(ranks, 1)
    summed = sum(sum(limits) for limits in by_stage.values())
    return [min(by_stage[s]) for s in range(num_stages)], summed, max(ranks, 1)


def plan_budget(
    config: SessionConfig,
    profile: Profile,
    profiles: Sequence[ProfilePayload],
    *,
    recorded: Mapping[int, Sequence[Instruction]] | None,
    measured_p_block_w: float | None,
    say: Progress,
) -> Planned | NoPlan:
    """Rank 0: the power-budget plan for the gathered ``profile`` (see the module doc).

    Returns:
        The plan (per-stage limits and clocks), or :class:`NoPlan` when the budget is below
        what the GPUs draw at their lowest clocks, or a fraction has no limits to be a share
        of (a saved profile): nothing is changed then.

    Raises:
        PlanError: A profile that lacks a stage or kind the pipeline runs, or an order the
            planner cannot use.
    """
    policy, workload = config.policy, config.workload
    layout = workload.layout
    request = PlanRequest(  # only the order and P_block are read: no frontier is solved
        num_stages=workload.num_stages,
        num_microbatches=workload.num_microbatches,
        schedule=layout.schedule,
        num_chunks=layout.num_chunks,
        placement=layout.placement,
        recorded=recorded,
        p_block_w=policy.p_block_w,
        session=SessionInputs(
            p_block_w=measured_p_block_w,
            idle_power_w=tuple(p.idle_power_w for p in profiles if p.idle_power_w),
        ),
        say=say,
    )
    order, order_source = resolve_order(request)
    p_block_w, _ = resolve_p_block(profile, request, say)
    dag = build_dag([list(stage) for stage in order], layout.placement)
    model = PowerLimitModel(profile, dag, p_block_w=p_block_w)
    admin, summed_w, ranks = stage_limits_w(profiles, workload.num_stages)
    if policy.budget_w is not None:
        budget_w = policy.budget_w
    elif summed_w is not None and policy.budget_fraction is not None:
        budget_w = policy.budget_fraction * summed_w
    else:
        return _refuse(config, "budget_fraction needs every GPU's power limit; give budget_w")
    try:
        budget = plan_power_budget(
            profile, dag, budget_w / ranks, admin_limits_w=admin, p_block_w=p_block_w
        )
    except InvalidArgumentError as err:
        return _refuse(config, f"no power-budget plan: {err}")
    plan = limits_plan(
        model,
        budget,
        {
            "num_microbatches": workload.num_microbatches,
            "schedule": layout.schedule,
            "num_chunks": layout.num_chunks,
            "placement": layout.placement,
            "order_source": order_source,
            "job_budget_w": budget_w,
            "ranks_per_stage": ranks,
        },
    )
    say.say(
        f"power budget {budget_w:.0f} W: stage limits "
        + " ".join(f"{w:.0f}" for w in budget.plan.limits_w)
        + f" W, predicted {budget.plan.time_s:.4f} s per iteration (uniform cap "
        f"{budget.uniform.time_s:.4f} s); no closed-loop check: its all-max windows would "
        "exceed the budget"
    )
    planned = Profile(profile.rows, source=profile.source, p_block_w=p_block_w)
    _write(config.run.out_dir, plan, {"policy": plan.policy, **budget.to_json()}, planned)
    return Planned(plan=plan, p_block_w=p_block_w)


def _refuse(config: SessionConfig, reason: str) -> NoPlan:
    _write(config.run.out_dir, None, {"refused": reason})
    return NoPlan(reason=reason)


def _write(
    out_dir: Path | None,
    plan: FrequencyPlan | None,
    summary: dict[str, object],
    profile: Profile | None = None,
) -> None:
    """``plan.json``, ``summary.json`` and ``profile.csv`` in ``out_dir``; never raises.

    The profile carries the P_block planned with, so ``powerlib plan profile.csv --policy
    power-budget`` re-plans it.
    """
    if out_dir is None:
        return
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        if profile is not None:
            profile.write_csv(out_dir / "profile.csv")
        if plan is not None:
            plan.write(out_dir / "plan.json")
        text = json.dumps({"plan": None if plan is None else "plan.json", **summary}, indent=1)
        (out_dir / "summary.json").write_text(text + "\n", encoding="utf-8")
    except OSError as err:
        logger.warning("powerlib: could not write to %s: %s", out_dir, err)


def apply_power_limit(job: Job, plan: FrequencyPlan) -> float | None:
    """Set this rank's stage limit of ``plan`` through the control session, and read it back.

    Nothing is set for a plan without limits, or for a stage it gives none.

    Returns:
        The limit set (W), or ``None``.

    Raises:
        PlanError: The limit is above the one the device had when the session started (or
            that one could not be read): nothing is changed.
        DeviceError: The device reads another limit back (the control session restores it at
            exit, as every change).
    """
    limit_w = plan.power_limit_w(job.stage)
    if limit_w is None:
        return None
    assert job.control is not None and job.device is not None
    ceiling_w = job.power_limit_w
    device = job.device
    if ceiling_w is None:
        raise PlanError(
            f"the plan sets a {limit_w:.0f} W power limit, but the GPU's limit at the "
            "session's start could not be read, so it could not be honoured"
        )
    try:
        job.control.set_power_limit(device, limit_w, ceiling_w=ceiling_w)
    except InvalidArgumentError as err:
        raise PlanError(str(err)) from None
    read_w = device_power_limit_w(device)
    if read_w is None or abs(read_w - limit_w) > READ_BACK_TOLERANCE_W:
        raise DeviceError(
            f"powerlib set a {limit_w:.0f} W power limit but the device "
            f"reads {read_w if read_w is None else f'{read_w:.0f} W'}",
            device=device.device_id,
        )
    return limit_w
