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
warning line.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from powerlib.errors import BackendUnavailableError, PlanError
from powerlib.planning.choice import Policy, check_policy, choose
from powerlib.planning.perseus.frontier import Frontier, Wanted, compute_frontier
from powerlib.planning.perseus.report import plot_frontier, summary, write_frontier_csv
from powerlib.planning.pipeline import (
    PLACEMENTS,
    Instruction,
    Schedule,
    build_dag,
    build_schedule,
)
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.profile import Profile, ProfileRow
from powerlib.planning.workflow import wanted_for
from powerlib.profiling.meter import energy_error
from powerlib.profiling.sweep import aggregate_stage_rows
from powerlib.progress import Progress

__all__ = [
    "MAX_ENERGY_ERROR",
    "PlanSpec",
    "PlanningOutcome",
    "Replanner",
    "auto_unit_time_s",
    "check_resolution",
    "make_plan",
    "merge_profiles",
    "rows_from_payload",
    "rows_to_payload",
    "write_profile",
]

logger = logging.getLogger(__name__)

RECORDED = "recorded"
"""The schedule name that means: plan on the order the hooks recorded, there is no other."""

_SUMMARY_POINTS = 32
"""Exact frontier points a direct solve writes to ``frontier.csv`` (evenly spaced; as the CLI)."""

MAX_ENERGY_ERROR = 0.05
"""The largest relative error (bound on the standard error, :func:`energy_error`) of a profiled
instruction energy the planner accepts: adjacent clocks differ by a few percent of energy."""


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
        switch_latency_s: Clock-change latency the guard assumes (Kareus: "several ms").
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
    switch_latency_s: float = 0.005
    p_block_w: float | None = None
    unit_time_s: float | None = None
    out_dir: Path | None = None
    progress: bool = True
    plot: bool = False

    def __post_init__(self) -> None:
        check_policy(
            self.policy, max_slowdown=self.max_slowdown, switch_latency_s=self.switch_latency_s
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


def rows_to_payload(rows: list[ProfileRow]) -> list[list[Any]]:
    """Compact, picklable rows for the gather."""
    return [[r.stage, r.instruction, r.freq_mhz, r.time_s, r.energy_j] for r in rows]


def rows_from_payload(data: list[list[Any]]) -> list[ProfileRow]:
    """Inverse of :func:`rows_to_payload`."""
    return [
        ProfileRow(
            stage=int(s), instruction=str(k), freq_mhz=float(f), time_s=float(t), energy_j=float(e)
        )
        for s, k, f, t, e in data
    ]


def auto_unit_time_s(profile: Profile) -> float:
    """τ: a power of ten at most 1/20 of the shortest instruction.

    That is 1 ms for 50 ms instructions, as the Perseus artifact used on A100; 0.1 ms for 5 ms.
    """
    shortest = min(r.time_s for r in profile.rows)
    return 10.0 ** math.floor(math.log10(shortest / 20.0))


GATHERED = "the gathered profile"


def merge_profiles(payloads: list[dict[str, Any]]) -> tuple[list[ProfileRow], float | None]:
    """Every rank's rows merged per stage, and P_block measured between instructions.

    P_block is time-weighted over all ranks' gaps; ``None`` when no rank has usable gaps (a
    counter that never moved in them tells nothing).
    """
    rows = aggregate_stage_rows(rows_from_payload(p["rows"]) for p in payloads)
    gap_s = sum(p.get("gap_time_s", 0.0) for p in payloads)
    gap_j = sum(p.get("gap_energy_j", 0.0) for p in payloads)
    return rows, (gap_j / gap_s if gap_s > 0 and gap_j > 0 else None)


def _fmt_s(time_s: float) -> str:
    return f"{time_s * 1e3:.3g} ms" if time_s < 1.0 else f"{time_s:.3g} s"


def check_resolution(rows: list[ProfileRow], payloads: list[dict[str, Any]]) -> str | None:
    """Why the gathered profile cannot resolve per-instruction energy, or ``None`` if it can.

    Two signs, both of an energy counter that publishes more coarsely than the instructions
    last: a profiled (stage, kind, clock) whose energy is zero (the counter never moved during
    it), or one whose mean energy is known to worse than :data:`MAX_ENERGY_ERROR`, from the
    counter period each rank's meter observed (``payload["counter"]``, the coarsest rank of the
    stage counts), the instruction's time and the number of samples (``payload["samples"]``;
    :func:`~powerlib.profiling.meter.energy_error`). A counter that moved between every two
    reads, and payloads without these fields (older callers), are only checked for zero energy.

    Args:
        rows: The merged rows (:func:`merge_profiles`).
        payloads: What the ranks sent.

    Returns:
        One line naming the worst case and what to change, or ``None``.
    """
    still = [r for r in rows if r.energy_j <= 0]
    if still:
        first = still[0]
        return (
            f"the energy counter did not move during {len(still)} of {len(rows)} profiled "
            f"(stage, kind, clock) cases, e.g. stage {first.stage} {first.instruction} at "
            f"{first.freq_mhz:g} MHz ({_fmt_s(first.time_s)}): the device publishes energy more "
            "coarsely than the instructions last, so the profile cannot resolve per-instruction "
            "energy; profile longer instructions (larger microbatches)"
        )
    period_s: dict[int, float] = {}
    samples: dict[tuple[int, str, float], int] = {}
    for p in payloads:
        stage = int(p.get("stage", 0))
        counter = p.get("counter") or {}
        # A counter that moved between every two reads is finer than the reads can tell (only
        # "at most the shortest interval" is known): no evidence against it.
        if counter.get("period_s") is not None and not counter.get("at_most"):
            period_s[stage] = max(period_s.get(stage, 0.0), float(counter["period_s"]))
        for kind, freq, n in p.get("samples", ()):
            key = (stage, str(kind), float(freq))
            samples[key] = samples.get(key, 0) + int(n)
    # The planner fits each (stage, kind)'s energy over all its clocks (the exponential cost
    # model), so what must be resolved is that curve: the rows' errors pool over the clocks.
    errors: dict[tuple[int, str], list[tuple[float, ProfileRow, int]]] = {}
    for r in rows:
        n = samples.get((r.stage, r.instruction, r.freq_mhz))
        if r.stage in period_s and n:
            error = energy_error(r.time_s, period_s[r.stage], n)
            errors.setdefault((r.stage, r.instruction), []).append((error, r, n))
    worst: tuple[float, tuple[int, str]] | None = None
    coarse = 0
    for pair, cases in errors.items():
        pooled = math.sqrt(math.fsum(e * e for e, _, _ in cases)) / len(cases)
        if pooled > MAX_ENERGY_ERROR:
            coarse += 1
            if worst is None or pooled > worst[0]:
                worst = (pooled, pair)
    if worst is None:
        return None
    pooled, (stage, kind) = worst
    cases = errors[(stage, kind)]
    times_s = sorted(r.time_s for _, r, _ in cases)
    lasts = _fmt_s(times_s[0]) + ("" if len(times_s) == 1 else f" to {_fmt_s(times_s[-1])}")
    n = min(n for _, _, n in cases)
    more = math.ceil((pooled / MAX_ENERGY_ERROR) ** 2)
    return (
        f"the energy counter cannot resolve per-instruction energy: it updates about every "
        f"{_fmt_s(period_s[stage])}, but stage {stage} {kind} lasts {lasts}, so its energy over "
        f"{len(cases)} clocks x {n} samples is known to +-{100 * pooled:.0f} % "
        f"({coarse} of {len(errors)} profiled (stage, kind) worse than "
        f"+-{100 * MAX_ENERGY_ERROR:.0f} %); profile longer instructions (larger microbatches), "
        f"more clocks, or about {more}x the measured iterations per clock"
    )


def write_profile(spec: PlanSpec, payloads: list[dict[str, Any]]) -> PlanningOutcome:
    """Rank 0 in ``profile`` mode: merge the profiles and write ``profile.csv``; no plan.

    A profile that cannot resolve per-instruction energy (:func:`check_resolution`) is not
    written; the outcome carries the reason (``baseline_reason``).
    """
    rows, p_block_w = merge_profiles(payloads)
    reason = check_resolution(rows, payloads) if rows else None
    if reason is not None:
        return PlanningOutcome(profile_only=True, p_block_w=p_block_w, baseline_reason=reason)
    if spec.out_dir is not None and rows:
        spec.out_dir.mkdir(parents=True, exist_ok=True)
        Profile(rows, source=GATHERED).write_csv(spec.out_dir / "profile.csv")
        Progress(spec.progress).say(f"profile written to {spec.out_dir / 'profile.csv'}")
    return PlanningOutcome(profile_only=True, p_block_w=p_block_w)


def _schedule_for(spec: PlanSpec, payloads: list[dict[str, Any]]) -> tuple[Schedule, str]:
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

    if not payloads or not all(p.get("order") for p in payloads):
        return fallback("no instruction order was recorded")
    by_stage: dict[int, list[tuple[int, int, str]]] = {}
    for p in payloads:
        order = [(int(c), int(m), str(k)) for c, m, k in p["order"]]
        first = by_stage.setdefault(int(p["stage"]), order)
        if first != order:
            raise PlanError(
                f"the ranks of stage {p['stage']} ran different instruction orders while profiling"
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

    def plan_for(self, deadline_s: float) -> PlanningOutcome:
        """The ``deadline`` plan for iteration time ``deadline_s`` (clipped up to T_min)."""
        spec = self.spec
        deadline_s = max(float(deadline_s), self.frontier.fastest.time_s)
        policy = Policy(
            name="deadline",
            deadline_s=deadline_s,
            argmin=spec.argmin,
            max_slowdown=spec.max_slowdown,
            switch_latency_s=spec.switch_latency_s,
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
    payloads: list[dict[str, Any]],
    *,
    keep: Callable[[Replanner], None] | None = None,
) -> PlanningOutcome:
    """Rank 0: merge the profiles, plan, write the files, and return the outcome.

    Each payload: ``{"stage": s, "rows": [...], "gap_time_s": ..., "gap_energy_j": ...,
    "counter": {...}, "samples": [[kind, freq_mhz, n], ...]}`` (time and energy between
    instructions, for P_block; the meter's counter resolution and the samples per row, for
    :func:`check_resolution`); or, for a saved profile, ``{"profile_path": ...}`` on rank 0; or,
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
    if "plan_path" in first:
        return PlanningOutcome(plan=FrequencyPlan.read(first["plan_path"]))
    if "profile_path" in first:
        profile = Profile.read(first["profile_path"])
        measured_p_block: list[float] = []
    else:
        rows, measured = merge_profiles(payloads)
        if not rows:
            raise PlanError("no rank measured any instruction: was the session's step() called?")
        reason = check_resolution(rows, payloads)
        if reason is not None:
            return PlanningOutcome(baseline_reason=reason, p_block_w=measured)
        profile = Profile(rows, source=GATHERED)
        measured_p_block = [] if measured is None else [measured]
    profile.validate_for(spec.num_stages, ())  # kinds: checked against the order
    if spec.p_block_w is not None:
        p_block_w = spec.p_block_w
    elif measured_p_block:
        p_block_w = sum(measured_p_block) / len(measured_p_block)
    elif idle := [p["idle_power_w"] for p in payloads if p.get("idle_power_w")]:
        p_block_w = sum(idle) / len(idle)
        Progress(spec.progress).say(
            f"no usable gaps between instructions for P_block; using the devices' power before "
            f"the session, {p_block_w:.1f} W (pass p_block_w to set it)",
        )
    else:
        raise PlanError(
            "P_block is unknown: no rank measured time between instructions; pass p_block_w"
        )
    unit_time_s = spec.unit_time_s or auto_unit_time_s(profile)
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
        schedule_name=spec.schedule,
        num_microbatches=num_microbatches,
        num_chunks=num_chunks,
        placement=spec.placement,
        p_block_w=p_block_w,
        unit_time_s=unit_time_s,
        solver="auto",
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
    policy = Policy(
        name=spec.policy,
        deadline_s=deadline_s,
        argmin=spec.argmin,
        max_slowdown=spec.max_slowdown,
        switch_latency_s=spec.switch_latency_s,
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
            )
        )
    info = summary(choice, solve_time_s=solve_s)
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
        profile.write_csv(out / "profile.csv")
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
