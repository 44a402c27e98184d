"""What rank 0 does between the gather and the broadcast: profiles in, plan JSON out.

Pure apart from writing the output files: merges the ranks' profiles (time = max, energy = mean
per stage), checks that the energy counter resolved every instruction (:func:`check_resolution`),
picks P_block, computes the Perseus frontier, selects the plan by policy (with the slowdown guard
for ``fastest`` and ``deadline``), refuses a plan that would not pay (:attr:`Choice.objection <powerlib.planning.choice.Choice.objection>`), and
writes ``profile.csv``, ``frontier.csv``, ``plan.json`` and ``summary.json`` to the output
directory.

When the profile cannot resolve per-instruction energy, or the chosen plan would cost more energy
than all maximum clocks (or run past the allowed slowdown), rank 0 returns ``{"baseline": reason}``
instead of a plan: every session then runs at the baseline clocks, and rank 0 says why in one
warning line; ``summary.json`` gives the reason (``refused``) either way (:func:`write_no_plan`
when there is no frontier to write).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from powerlib.errors import BackendUnavailableError, PlanError
from powerlib.planning.choice import Policy, check_policy, choose
from powerlib.planning.perseus.frontier import Frontier, FrontierSettings, compute_frontier
from powerlib.planning.perseus.points import Wanted
from powerlib.planning.perseus.report import plot_frontier, summary, write_frontier_csv
from powerlib.planning.pipeline import PLACEMENTS, Instruction, Schedule, build_dag
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.profile import CSV_COLUMNS, Profile, ProfileRow
from powerlib.planning.schedules import build_schedule
from powerlib.planning.workflow import default_unit_time_s, wanted_for
from powerlib.progress import Progress
from powerlib.runtime.gathered import (
    GATHERED,
    Payload,
    as_profiles,
    check_resolution,
    measured_latency_s,
    merge_profiles,
    time_cv_for,
    time_se_for,
)
from powerlib.runtime.records import Prediction, Realized

__all__ = [
    "NO_PLAN_SCHEMA",
    "PlanSpec",
    "PlanningOutcome",
    "Replanner",
    "make_plan",
    "write_no_plan",
    "write_profile",
]

logger = logging.getLogger(__name__)

RECORDED = "recorded"
"""The schedule name that means: plan on the order the hooks recorded, there is no other."""

_SUMMARY_POINTS = 32
"""Exact frontier points a direct solve writes to ``frontier.csv`` (evenly spaced; as the CLI)."""

DEFAULT_SWITCH_LATENCY_S = 0.005
"""The clock-change latency the guard assumes when nothing measured it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSpec:
    """The workload and the planning choices (the same on every rank).

    Attributes:
        num_stages: Pipeline stages.
        num_microbatches: Microbatches per iteration.
        schedule: ``1f1b``, ``gpipe`` or ``interleaved``; or ``recorded``: no built-in order,
            only the one the hooks recorded while profiling (zero-bubble and V schedules).
        num_chunks: Model chunks per stage (interleaved, V schedules).
        placement: ``looped`` (chunk ``c`` of stage ``s`` is model piece ``c*N + s``) or ``v``
            (two chunks: pieces ``s`` and ``2N-1-s``).
        policy: ``fastest``, ``deadline`` or ``min-energy``.
        deadline_s: T′ for ``deadline``.
        deadline_ratio: T′ as a multiple of the all-max iteration time (a straggler factor), for
            ``deadline`` when ``deadline_s`` is not given.
        argmin: The paper's emulation rule for ``deadline`` (see ``Frontier.select``).
        max_slowdown: Realized-slowdown guard for ``fastest`` (against all-max) and
            ``deadline`` (against T′), as a fraction.
        switch_latency_s: Clock-change latency the guard assumes; ``None``: the latency the
            ranks measured while warming up (the slowest rank's), else
            :data:`DEFAULT_SWITCH_LATENCY_S`.
        p_block_w: Blocking power; ``None`` uses the power measured between instructions.
        unit_time_s: Planner time unit τ; ``None`` picks one from the profile.
        out_dir: Where rank 0 writes its files; ``None`` writes nothing.
        progress: Print progress to stderr.
        plot: Also draw ``frontier.png`` in ``out_dir`` (needs the ``plot`` extra).
    """

    num_stages: int
    num_microbatches: int
    schedule: str = "1f1b"
    num_chunks: int = 1
    placement: str = "looped"
    policy: str = "fastest"
    deadline_s: float | None = None
    deadline_ratio: float | None = None
    argmin: bool = False
    max_slowdown: float = 0.001
    switch_latency_s: float | None = None
    p_block_w: float | None = None
    unit_time_s: float | None = None
    out_dir: Path | None = None
    progress: bool = True
    plot: bool = False

    def __post_init__(self) -> None:
        check_policy(
            self.policy,
            max_slowdown=self.max_slowdown,
            switch_latency_s=DEFAULT_SWITCH_LATENCY_S
            if self.switch_latency_s is None
            else self.switch_latency_s,
        )
        if self.policy == "deadline" and self.deadline_s is None and self.deadline_ratio is None:
            raise PlanError("the deadline policy needs deadline_s or deadline_ratio")
        if self.deadline_ratio is not None and not (
            math.isfinite(self.deadline_ratio) and self.deadline_ratio >= 1.0
        ):
            raise PlanError(f"deadline_ratio must be >= 1, got {self.deadline_ratio}")
        if self.placement not in PLACEMENTS:
            raise PlanError(
                f"unknown placement {self.placement!r}; choose one of {', '.join(PLACEMENTS)}"
            )
        if self.placement == "v" and self.num_chunks != 2:
            raise PlanError(f"the v placement needs num_chunks=2, got {self.num_chunks}")
        if self.schedule != RECORDED:
            build_schedule(self.schedule, self.num_stages, self.num_microbatches, self.num_chunks)

    def check_saved_plan(self, plan: FrequencyPlan, layout_given: Collection[str]) -> None:
        """A saved plan must be for this workload (schedule, chunks, placement where given).

        Args:
            plan: The plan.
            layout_given: Which of ``schedule``, ``num_chunks``, ``placement`` were stated
                (the others are defaults, and a saved plan may have its own).

        Raises:
            PlanError: The plan was made for another workload.
        """
        plan.check_workload(
            num_stages=self.num_stages,
            num_microbatches=self.num_microbatches,
            schedule=self.schedule if "schedule" in layout_given else None,
            num_chunks=self.num_chunks if "num_chunks" in layout_given else None,
            placement=self.placement if "placement" in layout_given else None,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanningOutcome:
    """What rank 0 sends every rank at the end of profiling (the coordinator ships it).

    Exactly one of these holds: ``plan`` is set (apply it), ``baseline_reason`` is set (run at
    the baseline clocks; rank 0 warns once), ``profile_only`` (``profile`` mode: no plan was
    asked for), or ``error`` (planning failed; every rank raises or disables with it).

    Attributes:
        plan: The plan to apply.
        summary: The planner's summary of the plan (``summary.json``: frontier, chosen point,
            baseline, realized saving), when rank 0 planned.
        baseline_reason: Why no plan is applied (a profile that cannot resolve per-instruction
            energy, or a plan that would not pay), one line.
        profile_only: ``profile`` mode: the profile was merged (and written); nothing to apply.
        p_block_w: The blocking power measured between instructions, when known.
        error: Planning failed on rank 0 (one line).
    """

    plan: FrequencyPlan | None = None
    summary: Mapping[str, Any] | None = None
    baseline_reason: str | None = None
    profile_only: bool = False
    p_block_w: float | None = None
    error: str | None = None
    switch_iteration: int | None = None
    """A re-plan: the iteration every rank starts it at (one past the latest rank's)."""
    realized: Realized | None = None
    """The closed loop's verdict (rank 0 judged every rank's windows)."""

    @property
    def prediction(self) -> Prediction | None:
        """The planner's figures for the plan (from :attr:`summary`)."""
        return Prediction.from_summary(self.summary)


def switch_latency_for(spec: PlanSpec, payloads: Sequence[Payload]) -> float:
    """The latency the guard plans for: the spec's, else the measured one, else the default."""
    if spec.switch_latency_s is not None:
        return spec.switch_latency_s
    measured = measured_latency_s(payloads)
    return DEFAULT_SWITCH_LATENCY_S if measured is None else measured


def write_profile(spec: PlanSpec, payloads: Sequence[Payload]) -> PlanningOutcome:
    """Rank 0 in ``profile`` mode: merge the profiles and write ``profile.csv``; no plan.

    A profile that cannot resolve per-instruction energy (:func:`check_resolution`) is not
    written; the outcome carries the reason (``baseline_reason``).
    """
    rows, p_block_w = merge_profiles(payloads)
    reason = check_resolution(rows, payloads)
    if reason is not None:
        write_no_plan(spec.out_dir, {"refused": reason})
        return PlanningOutcome(profile_only=True, p_block_w=p_block_w, baseline_reason=reason)
    if spec.out_dir is not None and rows:
        spec.out_dir.mkdir(parents=True, exist_ok=True)
        # the profile carries P_block, so `powerlib plan profile.csv` needs no --p-block-w
        Profile(rows, source=GATHERED, p_block_w=p_block_w).write_csv(spec.out_dir / "profile.csv")
        Progress(spec.progress).say(f"profile written to {spec.out_dir / 'profile.csv'}")
    return PlanningOutcome(profile_only=True, p_block_w=p_block_w)


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


def _schedule_for(spec: PlanSpec, payloads: Sequence[Payload]) -> tuple[Schedule, str]:
    """The order the ranks recorded while profiling, else the named schedule's.

    Every rank sends the order its hooks saw in the last profiled iteration; the ranks of a
    stage must agree. The recorded order is used when it forms a complete, deadlock-free
    pipeline the planner models; otherwise the generated order of ``spec.schedule`` is
    (``recorded`` has none: then the recorded order must do).
    """
    generated: Schedule | None = None
    if spec.schedule != RECORDED:
        generated = build_schedule(
            spec.schedule, spec.num_stages, spec.num_microbatches, spec.num_chunks
        )

    def fallback(why: str) -> tuple[Schedule, str]:
        if generated is None:
            raise PlanError(f"schedule 'recorded' but {why}; there is no built-in order to use")
        return generated, "generated"

    profiles = as_profiles(payloads)
    if not profiles or not all(p.order for p in profiles):
        return fallback("no instruction order was recorded")
    by_stage: dict[int, list[tuple[int, int, str]]] = {}
    for p in profiles:
        order = list(p.order)
        first = by_stage.setdefault(p.stage, order)
        if first != order:
            raise PlanError(
                f"the ranks of stage {p.stage} ran different instruction orders while profiling"
            )
    if sorted(by_stage) != list(range(spec.num_stages)):
        return fallback(f"the recorded orders cover stages {sorted(by_stage)}")
    recorded = [
        [Instruction(stage=s, microbatch=m, kind=k, chunk=c) for c, m, k in by_stage[s]]
        for s in range(spec.num_stages)
    ]
    try:
        build_dag(recorded, spec.placement)
    except PlanError as err:
        if generated is None:
            raise PlanError(
                f"the recorded order is not a pipeline the planner models: {err}"
            ) from None
        Progress(spec.progress).say(
            f"the recorded order is not a pipeline the planner models ({err}); "
            f"planning on the {spec.schedule} order",
        )
        return generated, "generated"
    if generated is not None and recorded != generated:
        Progress(spec.progress).say(
            f"the recorded instruction order differs from {spec.schedule}'s; planning on it"
        )
    return recorded, "recorded"


@dataclass(frozen=True, slots=True)
class Replanner:
    """Rank 0's solved frontier, kept to re-plan for a new straggler deadline at run time.

    :meth:`plan_for` adds the deadline's point to the frontier (the direct solve from its last
    basis, docs/perseus.md §2.6: seconds where the first solve took tens), guards and judges it
    like the first plan, and returns the outcome every rank switches to. Runs off the training
    thread (the session's planning thread); the frontier's own lock serialises solves.
    """

    frontier: Frontier
    spec: PlanSpec
    metadata: Mapping[str, Any]
    switch_latency_s: float = DEFAULT_SWITCH_LATENCY_S
    time_cv: float = 0.0
    time_se: float = 0.0

    def plan_for(self, deadline_s: float) -> PlanningOutcome:
        """The ``deadline`` plan for iteration time ``deadline_s`` (clipped up to T_min)."""
        spec = self.spec
        deadline_s = max(float(deadline_s), self.frontier.fastest.time_s)
        policy = Policy(
            name="deadline",
            deadline_s=deadline_s,
            argmin=spec.argmin,
            max_slowdown=spec.max_slowdown,
            switch_latency_s=self.switch_latency_s,
            time_cv=self.time_cv,
            time_se=self.time_se,
        )
        started = time.perf_counter()
        frontier = self.frontier.extend(wanted_for(policy))
        choice = choose(frontier, policy)
        info = summary(choice, solve_time_s=time.perf_counter() - started)
        if choice.objection is not None:
            info["refused"] = choice.objection
            return PlanningOutcome(summary=info, baseline_reason=choice.objection)
        plan = choice.plan(metadata={**self.metadata, "deadline_s": deadline_s})
        return PlanningOutcome(plan=plan, summary=info)


def make_plan(
    spec: PlanSpec,
    payloads: Sequence[Payload],
    *,
    keep: Callable[[Replanner], None] | None = None,
) -> PlanningOutcome:
    """Rank 0: merge the profiles, plan, write the files, and return the outcome.

    Each payload: ``{"stage": s, "rows": [...], "errors": [[kind, freq_mhz, error], ...],
    "p_block_w": ..., "latency_s": ..., "order": [...]}`` (the rank's attributed profile, each
    row's relative 95 % half-width for :func:`check_resolution`, the blocking power, the
    measured clock-change latency, the order its loop ran; or ``"unresolved"``: why its sweep
    gave up); or, for a saved profile, ``{"profile_path": ...}`` on rank 0; or,
    for a saved plan, ``{"plan_path": ...}`` (checked against the session's workload by the
    session).

    Returns:
        The plan and the planner's summary, or a ``baseline_reason`` when the profile cannot
        resolve per-instruction energy or the chosen plan would not pay
        (:attr:`Choice.objection <powerlib.planning.choice.Choice.objection>`): then no
        ``plan.json`` is written.

    Raises:
        PlanError: Incomplete or malformed profiles, or a plan the policy cannot meet.
    """
    first = payloads[0]
    saved = first if isinstance(first, Mapping) else {}
    if "plan_path" in saved:
        return PlanningOutcome(plan=FrequencyPlan.read(saved["plan_path"]))
    if "profile_path" in saved:
        profile = Profile.read(saved["profile_path"])
        measured_p_block: list[float] = []
        payloads = []
    else:
        payloads = as_profiles(payloads)
        rows, measured = merge_profiles(payloads)
        if not rows and not any(p.gave_up for p in payloads):
            raise PlanError("no rank measured any instruction: was the session's step() called?")
        reason = check_resolution(rows, payloads)
        if reason is not None:
            write_no_plan(spec.out_dir, {"refused": reason})
            return PlanningOutcome(baseline_reason=reason, p_block_w=measured)
        profile = Profile(rows, source=GATHERED)
        measured_p_block = [] if measured is None else [measured]
    profile.validate_for(spec.num_stages, ())  # kinds: checked against the order
    if spec.p_block_w is not None:
        p_block_w = spec.p_block_w
    elif profile.p_block_w is not None and not measured_p_block:  # a saved profile carries it
        p_block_w = profile.p_block_w
    elif measured_p_block:
        p_block_w = sum(measured_p_block) / len(measured_p_block)
    elif idle := [p.idle_power_w for p in payloads if p.idle_power_w]:
        p_block_w = sum(idle) / len(idle)
        Progress(spec.progress).say(
            f"no usable gaps between instructions for P_block; using the devices' power before "
            f"the session, {p_block_w:.1f} W (pass p_block_w to set it)",
        )
    else:
        raise PlanError(
            "P_block is unknown: no rank measured time between instructions; pass p_block_w"
        )
    unit_time_s = spec.unit_time_s or profile.unit_time_s or default_unit_time_s(profile)
    schedule, order_source = _schedule_for(spec, payloads)
    num_microbatches = 1 + max(ins.microbatch for order in schedule for ins in order)
    num_chunks = 1 + max(ins.chunk for order in schedule for ins in order)
    Progress(spec.progress).say(
        f"planning {spec.num_stages} stages x {num_microbatches} microbatches "
        f"({spec.schedule}, {order_source} order), P_block {p_block_w:.2f} W, "
        f"tau {unit_time_s * 1e3:g} ms",
    )
    started = time.perf_counter()
    frontier = compute_frontier(
        profile,
        schedule,
        settings=FrontierSettings(unit_time_s=unit_time_s, p_block_w=p_block_w, solver="auto"),
        schedule_name=spec.schedule,
        num_microbatches=num_microbatches,
        num_chunks=num_chunks,
        placement=spec.placement,
        # The deadline is known once the frontier is: its point is added below.
        wanted=Wanted(t_star=True, sweep=_SUMMARY_POINTS if spec.out_dir is not None else 0),
    )
    deadline_s = spec.deadline_s
    if spec.policy == "deadline" and deadline_s is None:
        assert spec.deadline_ratio is not None
        deadline_s = spec.deadline_ratio * frontier.baseline_time_s
    if spec.policy == "deadline":
        assert deadline_s is not None
        deadline_s = max(deadline_s, frontier.fastest.time_s)
    switch_latency_s = switch_latency_for(spec, payloads)
    time_cv = time_cv_for(payloads)
    time_se = time_se_for(payloads)
    policy = Policy(
        name=spec.policy,
        deadline_s=deadline_s,
        argmin=spec.argmin,
        max_slowdown=spec.max_slowdown,
        switch_latency_s=switch_latency_s,
        time_cv=time_cv,
        time_se=time_se,
    )
    frontier = frontier.extend(wanted_for(policy))
    solve_s = time.perf_counter() - started
    choice = choose(frontier, policy)
    if keep is not None:
        keep(
            Replanner(
                frontier,
                spec,
                {"profile_source": profile.source, "order_source": order_source},
                switch_latency_s,
                time_cv,
                time_se,
            )
        )
    info = summary(choice, solve_time_s=solve_s)
    info["switch_latency_s"] = switch_latency_s
    info["time_cv"] = time_cv
    info["time_se"] = time_se
    info["switch_latency_source"] = (
        "given"
        if spec.switch_latency_s is not None
        else ("measured" if measured_latency_s(payloads) is not None else "default")
    )
    objection = choice.objection
    if objection is not None:
        info["refused"] = objection
    # A refused plan is never built: nothing could apply it, or find it later as plan.json.
    plan = None
    if objection is None:
        plan = choice.plan(
            metadata={
                "deadline_s": deadline_s,
                "profile_source": profile.source,
                "order_source": order_source,
            },
        )
    Progress(spec.progress).say(
        f"frontier of {len(frontier.points)} points"
        f"{'' if frontier.complete else ' (solved directly)'} in {solve_s:.1f} s; "
        f"{spec.policy} plan saves "
        f"{info['realized']['saving_percent'] or 0.0:.2f} % at "
        f"{info['realized']['slowdown_percent']:+.3f} % "
        "(replayed on the profile)",
    )
    if spec.out_dir is not None:
        out = Path(spec.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        # with the P_block and τ it was planned with: `powerlib plan` on it plans the same way
        Profile(
            profile.rows, source=profile.source, p_block_w=p_block_w, unit_time_s=unit_time_s
        ).write_csv(out / "profile.csv")
        write_frontier_csv(frontier, out / "frontier.csv")
        if plan is not None:
            plan.write(out / "plan.json")
        (out / "summary.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
        Progress(spec.progress).say(
            f"profile, frontier, {'plan and ' if plan is not None else ''}summary written to "
            f"{out}/",
        )
        if spec.plot:
            try:
                plot_frontier(frontier, choice.point, out / "frontier.png")
            except BackendUnavailableError as err:
                Progress(spec.progress).say(f"no frontier.png: {err}")
    if plan is None:
        return PlanningOutcome(baseline_reason=objection, summary=info, p_block_w=p_block_w)
    return PlanningOutcome(plan=plan, summary=info, p_block_w=p_block_w)
