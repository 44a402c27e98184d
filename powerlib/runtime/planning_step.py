"""What rank 0 does between the gather and the broadcast: the ranks' payloads in, an outcome out.

A thin adapter in front of the one planning pipeline
(:func:`powerlib.planning.workflow.plan_profile`): :func:`make_plan` turns what the ranks sent
(:data:`~powerlib.runtime.records.Payload`) into a merged
:class:`~powerlib.planning.profile.Profile` and the facts the ranks measured (blocking power,
idle power, clock-change latency, the noise of instruction times, the instruction order the
loop ran), hands them to the pipeline, writes the pipeline's files to ``out_dir``, and returns
the outcome every rank gets: :class:`~powerlib.runtime.records.Planned` or
:class:`~powerlib.runtime.records.NoPlan`.

When the profile cannot resolve per-instruction energy (:func:`check_resolution`), or the
chosen plan would cost more energy than all maximum clocks (or run past the allowed slowdown),
rank 0 sends :class:`~powerlib.runtime.records.NoPlan` instead of a plan: every session then runs
at the baseline clocks, and rank 0 says why in one warning line; ``summary.json`` gives the
reason (``refused``) either way (:func:`write_no_plan` when there is no frontier to write).

Where a rank's GPU holds a power-smoothing floor (``ProfilePayload.power_floor_w``), the highest
one is planned with (:mod:`powerlib.planning.power_floor`: no row's energy, and no blocking
power, below it), and rank 0 says in one warning line when the floor cancels (part of) the
predicted saving (docs/real-gpu.md §8).
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from powerlib.config import direct_solver
from powerlib.device import Device
from powerlib.errors import PlanError, PowerlibError
from powerlib.planning.names import POWER_BUDGET
from powerlib.planning.perseus.counterfactual import replay_model
from powerlib.planning.perseus.replay import ReplayModel
from powerlib.planning.perseus.report import PlanOutputs
from powerlib.planning.pipeline import Instruction
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.power_floor import floor_effect, floor_from_details
from powerlib.planning.profile import Profile
from powerlib.planning.profile_rows import CSV_COLUMNS, ProfileRow
from powerlib.planning.workflow import (
    PlanRequest,
    PlanResult,
    SessionInputs,
    plan_profile,
    replan,
    resolve_p_block,
)
from powerlib.progress import Progress
from powerlib.runtime.gathered import (
    GATHERED,
    as_profiles,
    check_resolution,
    latency_samples_for,
    measured_latency_s,
    merge_profiles,
    time_cv_for,
    time_noise_for,
    time_se_for,
)
from powerlib.runtime.power_budget_step import plan_budget
from powerlib.runtime.records import (
    NoPlan,
    Payload,
    Planned,
    ProfileOnly,
    ProfilePayload,
    Realized,
    SavedPlan,
    SavedProfile,
    StopPayload,
)
from powerlib.runtime.session_config import DEFAULT_SWITCH_LATENCY_S, Mode, SessionConfig

__all__ = [
    "NO_PLAN_SCHEMA",
    "KeptFrontier",
    "add_measured",
    "device_power_floor_w",
    "floor_line",
    "judge_model",
    "make_plan",
    "rank0_turn",
    "stopped_profiles",
    "write_no_plan",
    "write_profile",
]

logger = logging.getLogger(__name__)

_SUMMARY_POINTS = 32
"""Exact frontier points a direct solve writes to ``frontier.csv`` (evenly spaced; as the CLI)."""

NO_PLAN_SCHEMA = "powerlib.no-plan.v1"
"""``summary.json`` of a run that applies no plan: the planner's verdict ``refused`` it (a
profile that cannot resolve per-instruction energy, a rank that failed), or the run ended before
its plan (``ended_before_plan``)."""


def write_no_plan(
    out_dir: Path | None, info: Mapping[str, Any], rows: Sequence[ProfileRow] = ()
) -> bool:
    """Rank 0: what a run that applies no plan has, in ``out_dir``; never raises.

    Writes ``summary.json`` (``{"schema": NO_PLAN_SCHEMA, "plan": null, **info}``) and, when
    ``rows`` are given, ``profile.partial.csv`` (the profile's columns; the rows measured so far,
    which the planner refuses until every stage has two clocks of each kind).

    Returns:
        Whether the files were written (``False``: no ``out_dir``, or writing failed, logged).
    """
    if out_dir is None:
        return False
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if rows:
            lines = [",".join(CSV_COLUMNS)]
            lines += [
                f"{r.stage},{r.instruction},{r.freq_mhz:g},{r.time_s!r},{r.energy_j!r}"
                for r in rows
            ]
            (out / "profile.partial.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
        summary_info = {"schema": NO_PLAN_SCHEMA, "plan": None, **info}
        (out / "summary.json").write_text(
            json.dumps(summary_info, indent=1) + "\n", encoding="utf-8"
        )
    except OSError as err:
        logger.warning("powerlib: could not write to %s: %s", out, err)
        return False
    return True


def add_measured(out_dir: Path | None, realized: Realized) -> None:
    """Rank 0: the closed loop's figures into ``summary.json`` (``measured``); never raises."""
    if out_dir is None:
        return
    path = Path(out_dir) / "summary.json"
    try:
        info = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        info["measured"] = realized.to_json()
        path.write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    except (OSError, ValueError) as err:
        logger.warning("powerlib: could not add the measured figures to %s: %s", path, err)


def write_profile(
    config: SessionConfig, payloads: Sequence[Payload], *, progress: bool = False
) -> ProfileOnly:
    """Rank 0 in ``profile`` mode: merge the profiles and write ``profile.csv``; no plan.

    A profile that cannot resolve per-instruction energy (:func:`check_resolution`) is not
    written; the outcome says why (``reason``).
    """
    profiles = as_profiles(payloads)
    rows, p_block_w = merge_profiles(profiles)
    reason = check_resolution(rows, profiles)
    out_dir = config.run.out_dir
    if reason is not None:
        write_no_plan(out_dir, {"refused": reason})
        return ProfileOnly(p_block_w=p_block_w, reason=reason)
    if out_dir is not None and rows:
        out_dir.mkdir(parents=True, exist_ok=True)
        # the profile carries P_block, so `powerlib plan profile.csv` needs no --p-block-w
        Profile(rows, source=GATHERED, p_block_w=p_block_w).write_csv(out_dir / "profile.csv")
        Progress(progress).say(f"profile written to {out_dir / 'profile.csv'}")
    return ProfileOnly(p_block_w=p_block_w)


def stopped_profiles(payloads: Sequence[Payload]) -> str | None:
    """Why profiling stopped on every rank (some rank's stop payload), or ``None``."""
    stops = [p for p in payloads if isinstance(p, StopPayload)]
    if not stops:
        return None
    why = "; ".join(p.reason for p in stops if p.reason) or "a rank failed"
    return f"{why}; powerlib stopped profiling on every rank"


def rank0_turn(
    config: SessionConfig,
    payloads: Sequence[Payload],
    *,
    progress: bool,
    keep: Callable[[KeptFrontier], None] | None = None,
) -> Planned | NoPlan | ProfileOnly:
    """Rank 0 inside the exchange after profiling (or with a saved input): the outcome.

    A rank that failed while profiling makes every rank stop (its reason in ``summary.json``);
    ``profile`` mode merges and writes the profile (:func:`write_profile`); the others plan
    (:func:`make_plan`).

    Raises:
        PlanError: See :func:`make_plan` (every rank gets it).
    """
    stopped = stopped_profiles(payloads)
    profile_only = config.run.mode is Mode.PROFILE
    if stopped is not None:
        write_no_plan(config.run.out_dir, {"refused": stopped})
        return ProfileOnly(reason=stopped) if profile_only else NoPlan(reason=stopped)
    if profile_only:
        return write_profile(config, payloads, progress=progress)
    return make_plan(config, payloads, progress=progress, keep=keep)


def recorded_order(profiles: Sequence[ProfilePayload]) -> dict[int, list[Instruction]] | None:
    """The instruction order each stage's ranks recorded while profiling, or ``None``.

    Raises:
        PlanError: The ranks of one stage ran different orders.
    """
    if not profiles or not all(p.order for p in profiles):
        return None
    by_stage: dict[int, list[tuple[int, int, str]]] = {}
    for p in profiles:
        order = list(p.order)
        first = by_stage.setdefault(p.stage, order)
        if first != order:
            raise PlanError(
                f"the ranks of stage {p.stage} ran different instruction orders while profiling"
            )
    return {
        stage: [Instruction(stage=stage, microbatch=m, kind=k, chunk=c) for c, m, k in order]
        for stage, order in by_stage.items()
    }


@dataclass(frozen=True, slots=True)
class KeptFrontier:
    """Rank 0's solved frontier, kept to re-plan for a new straggler deadline at run time.

    :meth:`plan_for` adds the deadline's point to the frontier (the direct solve from its last
    basis, docs/perseus.md §2.6: seconds where the first solve took tens), guards and judges it
    like the first plan, and returns the outcome every rank switches to. Runs off the training
    thread (the session's planning thread); the frontier's own lock serialises solves.
    """

    result: PlanResult
    request: PlanRequest

    def plan_for(self, deadline_s: float) -> Planned | NoPlan:
        """The ``deadline`` plan for iteration time ``deadline_s`` (clipped up to T_min)."""
        result = replan(self.result, self.request, deadline_s)
        plan = result.frequency_plan()
        if plan is None:
            assert result.refused is not None
            return NoPlan(reason=result.refused, summary=result.summary)
        return Planned(plan=plan, summary=result.summary)


def _request(
    config: SessionConfig,
    profiles: Sequence[ProfilePayload],
    measured_p_block_w: float | None,
    say: Progress,
) -> PlanRequest:
    """The pipeline's request: the session's workload and policy, and what the ranks measured."""
    workload, policy = config.workload, config.policy
    layout = workload.layout
    latency = measured_latency_s(profiles)
    samples = latency_samples_for(profiles)
    if policy.switch_latency_s is not None:
        switch_latency_s, source, samples = policy.switch_latency_s, "given", ()
    elif samples:
        # the typical landing for the exact replay; the noise stage draws every switch's
        # latency from the measured ones (issue 45: the 90th percentile cost 0.5-1 pt)
        switch_latency_s, source = statistics.median(samples), "measured"
    elif latency is not None:
        switch_latency_s, source = latency, "measured"
    else:
        switch_latency_s, source = DEFAULT_SWITCH_LATENCY_S, "default"
    return PlanRequest(
        num_stages=workload.num_stages,
        num_microbatches=workload.num_microbatches,
        schedule=layout.schedule,
        num_chunks=layout.num_chunks,
        placement=layout.placement,
        recorded=recorded_order(profiles),
        policy=policy.policy,
        deadline_s=policy.deadline_s,
        deadline_ratio=policy.deadline_ratio,
        argmin=policy.argmin,
        max_slowdown=policy.max_slowdown,
        switch_latency_s=switch_latency_s,
        time_cv=time_cv_for(profiles),
        time_se=time_se_for(profiles),
        time_noise=time_noise_for(profiles),
        latency_samples_s=samples,
        # the apply phase requests switches up this long ahead: the typical landing (later
        # ones the guard draws per switch; a longer lead runs more of the tail fast: GPT-3 8 x 12
        # seeds 0 and 2 realized 13.78 %, 14.06 % with the 90th percentile, 14.06 %, 14.37 %
        # with the median, docs/perseus.md §2.8)
        request_ahead_s=switch_latency_s if config.apply.request_ahead else None,
        p_block_w=policy.p_block_w,
        unit_time_s=policy.unit_time_s,
        work_hint=None,
        direct_solver=direct_solver(),  # POWERLIB_DIRECT_SOLVER, as `powerlib plan` honours it
        frontier_points=_SUMMARY_POINTS if config.run.out_dir is not None else 0,
        session=SessionInputs(
            p_block_w=measured_p_block_w,
            idle_power_w=tuple(p.idle_power_w for p in profiles if p.idle_power_w),
            switch_latency_source=source,
            power_floor_w=max((_power_floor_w(p) for p in profiles), default=0.0),
        ),
        say=say,
    )


def device_power_floor_w(device: Device) -> float | None:
    """The power-smoothing floor ``device`` holds (W), for its rank's payload; never raises.

    ``None`` where it has no power smoothing, has it off, or its details cannot be read.
    """
    try:
        return floor_from_details(device.details())
    except PowerlibError as err:
        logger.debug("%s: power smoothing not read: %s", device.device_id, err)
        return None


def _power_floor_w(payload: ProfilePayload) -> float:
    """The power-smoothing floor a rank's GPU holds (W; 0: none or not reported).

    Each rank fills ``power_floor_w`` from its device (:func:`device_power_floor_w`).
    """
    floor_w = payload.power_floor_w
    return float(floor_w) if isinstance(floor_w, int | float) and floor_w > 0 else 0.0


def floor_line(result: PlanResult, raw: Profile, request: PlanRequest) -> str | None:
    """One line when the request's power floor cancels (part of) the plan's predicted saving."""
    floor_w = request.session.power_floor_w if request.session else 0.0
    if floor_w <= 0:
        return None
    raw_p_block_w, _ = resolve_p_block(raw, request, Progress(False))
    it = result.summary.per_iteration
    effect = floor_effect(
        result.choice.plan(),  # a plan the floor made refused is still compared
        raw,
        floor_w,
        raw_p_block_w=raw_p_block_w,
        iteration=(it.time_s, it.energy_j, it.baseline_time_s, it.baseline_energy_j),
    )
    return None if effect is None else effect.line()


def make_plan(
    config: SessionConfig,
    payloads: Sequence[Payload],
    *,
    progress: bool = False,
    keep: Callable[[KeptFrontier], None] | None = None,
) -> Planned | NoPlan:
    """Rank 0: merge the profiles, plan, write the files, and return the outcome.

    Args:
        config: The session's configuration (workload, policy, ``out_dir``, ``plot``).
        payloads: Every rank's :class:`~powerlib.runtime.records.ProfilePayload`; or, on rank 0
            alone, a :class:`~powerlib.runtime.records.SavedProfile` (``plan`` mode) or a
            :class:`~powerlib.runtime.records.SavedPlan` (``apply`` mode: checked against the
            workload by each session).
        progress: Say what the planner does on stderr.
        keep: Called with the solved frontier, to re-plan from later.

    Returns:
        The plan and the planner's summary, or :class:`~powerlib.runtime.records.NoPlan` when
        the profile cannot resolve per-instruction energy or the chosen plan would not pay
        (:attr:`Choice.objection <powerlib.planning.choice.Choice.objection>`): then no
        ``plan.json`` is written.

    Raises:
        PlanError: Incomplete or malformed profiles, or a plan the policy cannot meet.
    """
    first = payloads[0]
    if isinstance(first, SavedPlan):
        return Planned(plan=FrequencyPlan.read(first.path))
    say = Progress(progress)
    if isinstance(first, SavedProfile):
        profile, profiles, measured = Profile.read(first.path), [], None
    else:
        profiles = as_profiles(payloads)
        rows, measured = merge_profiles(profiles)
        if not rows and not any(p.gave_up for p in profiles):
            raise PlanError("no rank measured any instruction: was the session's step() called?")
        reason = check_resolution(rows, profiles)
        if reason is not None:
            write_no_plan(config.run.out_dir, {"refused": reason})
            return NoPlan(reason=reason, p_block_w=measured)
        profile = Profile(rows, source=GATHERED)
    if config.policy.policy == POWER_BUDGET:  # limits, not a frontier point (docs/perseus.md §7)
        recorded = recorded_order(profiles)
        return plan_budget(
            config, profile, profiles, recorded=recorded, measured_p_block_w=measured, say=say
        )
    request = _request(config, profiles, measured, say)
    result = plan_profile(profile, request)
    if (line := floor_line(result, profile, request)) is not None:
        logger.warning("powerlib: %s", line)
    if keep is not None:
        keep(KeptFrontier(result, request))
    if config.run.out_dir is not None:
        result.write(PlanOutputs.in_dir(config.run.out_dir, plot=config.run.plot), say=say)
    plan = result.frequency_plan()
    if plan is None:
        assert result.refused is not None
        return NoPlan(reason=result.refused, summary=result.summary, p_block_w=result.p_block_w)
    return Planned(plan=plan, summary=result.summary, p_block_w=result.p_block_w)


def judge_model(
    config: SessionConfig, kept: KeptFrontier | None, plan: FrequencyPlan
) -> ReplayModel | None:
    """Rank 0: the planned workload the closed loop replays its plan iterations on.

    The frontier rank 0 planned on; for a saved plan, the profile it was made from when the
    session was given one (``profile_path``: its rows and carried P_block); else ``None`` (only
    the interleaved windows measure the plan).
    """
    if kept is not None:
        return kept.result.frontier.model
    path = config.run.profile_path
    if config.run.mode is not Mode.APPLY or path is None:
        return None
    try:
        profile = Profile.read(path)
        if profile.p_block_w is None:
            raise PlanError(f"{path}: the profile carries no blocking power (p_block_w)")
        return replay_model(plan, profile, profile.p_block_w)
    except PowerlibError as err:
        logger.warning("powerlib: the closed loop measures unpaired: %s", err)
        return None
