"""Frontier outputs: the CSV, the summary, the plot (matplotlib, extra ``plot``).

:func:`write_plan_outputs` is the one writer of a plan's files.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from powerlib.errors import BackendUnavailableError
from powerlib.planning.perseus.frontier import Frontier
from powerlib.planning.perseus.noise import TimeNoise
from powerlib.planning.perseus.points import FrontierPoint
from powerlib.progress import Progress

if TYPE_CHECKING:
    from powerlib.planning.choice import Choice
    from powerlib.planning.profile import Profile

__all__ = [
    "FRONTIER_COLUMNS",
    "PLAN_SUMMARY_SCHEMA",
    "ChosenPoint",
    "GuardInputs",
    "PerIteration",
    "PlanOutputs",
    "PlanSummary",
    "ReplayGuard",
    "SummaryBaseline",
    "plot_frontier",
    "pyplot",
    "summary",
    "write_frontier_csv",
    "write_plan_outputs",
]

FRONTIER_COLUMNS = ("iteration", "time_s", "energy_j", "effective_energy_j", "cost_change_j")


def write_frontier_csv(frontier: Frontier, path: str | Path) -> None:
    """One row per frontier point, slowest first.

    The walk writes every quantum; a direct solve the points it solved (evenly spaced with
    ``sweep``, plus T_min, T* and the chosen point), each exact.
    """
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(FRONTIER_COLUMNS)
        for p in frontier.points:
            writer.writerow(
                [
                    p.iteration,
                    repr(p.time_s),
                    repr(p.energy_j),
                    repr(p.effective_energy_j),
                    repr(p.cost_change_j),
                ]
            )


PLAN_SUMMARY_SCHEMA = "powerlib.plan-summary.v2"
"""The schema of :meth:`PlanSummary.to_json` (``summary.json``, ``powerlib plan --json``).

Described by ``powerlib/planning/perseus/plan_summary.schema.json`` (JSON Schema draft 2020-12).
v2 (issue 44): ``saving_percent`` and ``slowdown_percent`` are the plan's one predicted figure,
per iteration as the job runs it; the Perseus figure at the plan's own time is
``saving_at_plan_time_percent``.
"""

_ALL_MAX = "every instruction at its maximum frequency, blocking power up to the chosen time"
_MEGATRON = (
    "Megatron-LM: sequential execution at the maximum clock, blocking power up to the chosen "
    "time (or its own, if slower)"
)
_PER_ITERATION = (
    "per iteration as the job runs it: the plan replayed on the measured profile against "
    "iterations at the baseline clocks ({}), both held to the straggler's T' under deadline"
)
_REPLAYED = "the plan replayed on the measured profile at the switch latency planned for"


@dataclass(frozen=True, slots=True, kw_only=True)
class ChosenPoint:
    """The policy's frontier point: as planned, and replayed on the profile (``chosen``).

    Attributes:
        policy: The policy's name.
        iteration: The point's solver step.
        time_s: Planned iteration time.
        energy_j: Planned iteration energy.
        realized_time_s: The applied options replayed on the profile: iteration time.
        realized_energy_j: Likewise, energy.
    """

    policy: str
    iteration: int
    time_s: float
    energy_j: float
    realized_time_s: float
    realized_energy_j: float

    def to_json(self) -> dict[str, object]:
        """Every field, by name."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class PerIteration:
    """The plan's predicted iteration against a baseline one, as the job runs them.

    The ``per_iteration`` block of ``summary.json``: what :attr:`PlanSummary.saving_percent` and
    :attr:`PlanSummary.slowdown_percent` are computed from (see :func:`_per_iteration`).

    Attributes:
        description: In words (all-max, or Kareus's Megatron-LM baseline).
        time_s: The plan's iteration time, replayed on the profile (held to T′ under deadline).
        energy_j: Its energy, every stage, blocking power while held included.
        baseline_time_s: The baseline iteration's time (its own, or T′ under deadline).
        baseline_energy_j: Its energy, likewise.
    """

    description: str
    time_s: float
    energy_j: float
    baseline_time_s: float
    baseline_energy_j: float

    @property
    def saving_percent(self) -> float | None:
        """Energy saved per iteration; ``None`` when the baseline's is not positive."""
        return _saving_percent(self.energy_j, self.baseline_energy_j)

    @property
    def slowdown_percent(self) -> float:
        """Iteration time against the baseline's (negative: faster)."""
        return 100.0 * (self.time_s / self.baseline_time_s - 1.0)

    def to_json(self) -> dict[str, object]:
        """Every field, by name."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class SummaryBaseline:
    """What :attr:`PlanSummary.saving_at_plan_time_percent` is against (``baseline``).

    The Perseus convention (docs/perseus.md §4.4, Table 6): the baseline charged at the chosen
    point's time, blocking power up to it.

    Attributes:
        description: In words (all-max, or Kareus's Megatron-LM baseline).
        own_time_s: The baseline's own iteration time.
        time_s: The time it is charged at (the chosen point's, or its own if slower).
        energy_j: Its energy at that time, blocking power included.
    """

    description: str
    own_time_s: float
    time_s: float
    energy_j: float

    def to_json(self) -> dict[str, object]:
        """Every field, by name."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayGuard:
    """How the plan was replayed on the measured profile, and what the guard did (``replay``).

    Attributes:
        max_slowdown_guard: The guard's allowed slowdown (``fastest``, ``deadline``), else
            ``None``.
        switch_latency_s: The clock-change latency the replay assumed.
        instructions_sped_up: Instructions the guard sped up (guarded policies), else ``None``.
    """

    max_slowdown_guard: float | None
    switch_latency_s: float
    instructions_sped_up: int | None

    def to_json(self) -> dict[str, object]:
        """Every field by name, after the ``description``."""
        return {"description": _REPLAYED, **dataclasses.asdict(self)}


@dataclass(frozen=True, slots=True, kw_only=True)
class GuardInputs:
    """What a session's guard planned for (top-level keys of a session's ``summary.json``).

    Attributes:
        switch_latency_s: The clock-change latency.
        time_cv: The run-to-run spread of instruction times (0: none).
        time_se: The relative standard error of a profiled row's mean time.
        switch_latency_source: ``given``, ``measured`` or ``default``.
        time_noise: Where the noise is shared, when the profile told (issue 45).
        latency_samples: How many measured latencies the noise stage drew switches from.
    """

    switch_latency_s: float
    time_cv: float
    time_se: float
    switch_latency_source: str
    time_noise: TimeNoise | None = None
    latency_samples: int = 0

    def to_json(self) -> dict[str, object]:
        """Every field, by name."""
        out: dict[str, object] = {
            "switch_latency_s": self.switch_latency_s,
            "time_cv": self.time_cv,
            "time_se": self.time_se,
            "switch_latency_source": self.switch_latency_source,
            "latency_samples": self.latency_samples,
        }
        out["time_noise"] = None if self.time_noise is None else self.time_noise.to_json()
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSummary:
    """The planner's summary of a choice (:data:`PLAN_SUMMARY_SCHEMA`, :meth:`to_json`).

    What ``powerlib plan --json`` prints and a session's ``summary.json`` holds. The plan's one
    predicted figure is :attr:`saving_percent` and :attr:`slowdown_percent`: per iteration, as
    the job runs it (what a session's ``Prediction`` carries, the planning log line prints and
    the closed loop measures).

    Attributes:
        solver: ``walk`` (complete frontier) or ``direct``.
        complete_frontier: Whether the frontier holds every quantum.
        num_points: Frontier points solved.
        t_min_s: The fastest point's time.
        t_max_s: The all-slowest start (not a point).
        t_star_s: T*, when solved.
        t_star_energy_j: Its energy, when solved.
        per_iteration: The plan's iteration against the baseline's, as the job runs them.
        chosen: The policy's point.
        baseline: What :attr:`saving_at_plan_time_percent` is against.
        saving_at_plan_time_percent: The chosen point as planned against :attr:`baseline` at
            the point's own time (the Perseus convention, the paper's Table 6 figure); not
            what a job saves per iteration. ``None``: no positive baseline energy.
        replay: How the plan was replayed and guarded.
        solve_time_s: Wall time of the solve.
        guard: A session's guard inputs (``None`` for ``powerlib plan``: no keys written).
        refused: Why a session does not apply the plan (the choice's objection); ``None``: no
            key written.
    """

    solver: str
    complete_frontier: bool
    num_points: int
    t_min_s: float
    t_max_s: float
    t_star_s: float | None
    t_star_energy_j: float | None
    per_iteration: PerIteration
    chosen: ChosenPoint
    baseline: SummaryBaseline
    saving_at_plan_time_percent: float | None
    replay: ReplayGuard
    solve_time_s: float
    guard: GuardInputs | None = None
    refused: str | None = None

    @property
    def saving_percent(self) -> float | None:
        """The predicted energy saving per iteration, as the job runs it (percent).

        ``None``: no positive baseline energy.
        """
        return self.per_iteration.saving_percent

    @property
    def slowdown_percent(self) -> float:
        """The predicted iteration time against the baseline's, as the job runs it (percent)."""
        return self.per_iteration.slowdown_percent

    def to_json(self) -> dict[str, object]:
        """The ``powerlib.plan-summary.v2`` record (``plan_summary.schema.json``)."""
        data: dict[str, object] = {
            "schema": PLAN_SUMMARY_SCHEMA,
            "solver": self.solver,
            "complete_frontier": self.complete_frontier,
            "num_points": self.num_points,
            "t_min_s": self.t_min_s,
            "t_max_s": self.t_max_s,
            "t_star_s": self.t_star_s,
            "t_star_energy_j": self.t_star_energy_j,
            "saving_percent": self.saving_percent,
            "slowdown_percent": self.slowdown_percent,
            "per_iteration": self.per_iteration.to_json(),
            "chosen": self.chosen.to_json(),
            "baseline": self.baseline.to_json(),
            "saving_at_plan_time_percent": self.saving_at_plan_time_percent,
            "replay": self.replay.to_json(),
            "solve_time_s": self.solve_time_s,
        }
        if self.guard is not None:
            data.update(self.guard.to_json())
        if self.refused is not None:
            data["refused"] = self.refused
        return data


def summary(
    choice: Choice,
    *,
    solve_time_s: float,
    guard: GuardInputs | None = None,
    refused: str | None = None,
) -> PlanSummary:
    """The planner's summary of ``choice`` (what ``powerlib plan --json`` prints).

    The predicted figures and the slowdown guard's effect come from the choice's options.

    Args:
        choice: The chosen point, guarded and judged.
        solve_time_s: Wall time of the solve.
        guard: A session's guard inputs, recorded beside the figures.
        refused: Why a session does not apply the plan.
    """
    frontier, chosen, policy = choice.frontier, choice.point, choice.policy
    baseline = frontier.baseline(chosen.time_s)
    realized = choice.realized
    t_star = frontier.min_energy if frontier.has_t_star else None
    first = frontier.points[0]
    return PlanSummary(
        solver="walk" if frontier.complete else "direct",
        complete_frontier=frontier.complete,
        num_points=len(frontier.points),
        t_min_s=frontier.fastest.time_s,
        # the all-slowest start, which is not a point
        t_max_s=first.time_s + frontier.settings.unit_time_s,
        t_star_s=None if t_star is None else t_star.time_s,
        t_star_energy_j=None if t_star is None else t_star.energy_j,
        per_iteration=_per_iteration(choice),
        chosen=ChosenPoint(
            policy=policy.name,
            iteration=chosen.iteration,
            time_s=chosen.time_s,
            energy_j=chosen.energy_j,
            realized_time_s=realized.time_s,
            realized_energy_j=realized.energy_j,
        ),
        baseline=SummaryBaseline(
            description=_ALL_MAX if frontier.reference_times is None else _MEGATRON,
            own_time_s=frontier.baseline_time_s,
            time_s=baseline.time_s,
            energy_j=baseline.energy_j,
        ),
        saving_at_plan_time_percent=_saving_percent(chosen.energy_j, baseline.energy_j),
        replay=ReplayGuard(
            max_slowdown_guard=policy.max_slowdown if choice.guarded else None,
            switch_latency_s=policy.switch_latency_s,
            instructions_sped_up=choice.instructions_sped_up if choice.guarded else None,
        ),
        solve_time_s=solve_time_s,
        guard=guard,
        refused=refused,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOutputs:
    """Where :func:`write_plan_outputs` writes; ``None``: that file is not written.

    Attributes:
        profile_csv: The profile, with the P_block and τ planned with.
        frontier_csv: The frontier, one row per point.
        plan_json: The plan (``powerlib.plan.v1``), when there is one.
        summary_json: The summary (``powerlib.plan-summary.v2``).
        frontier_png: The frontier plot (``powerlib[plot]``).
        folder: The folder of :meth:`in_dir` (created; the files written are said).
    """

    profile_csv: Path | None = None
    frontier_csv: Path | None = None
    plan_json: Path | None = None
    summary_json: Path | None = None
    frontier_png: Path | None = None
    folder: Path | None = None

    @classmethod
    def files(
        cls,
        *,
        frontier: str | Path | None = None,
        plan: str | Path | None = None,
        plot: str | Path | None = None,
    ) -> PlanOutputs:
        """The files a plan command was asked for (``--frontier-out --plan-out --plot``)."""
        return cls(
            frontier_csv=None if not frontier else Path(frontier),
            plan_json=None if not plan else Path(plan),
            frontier_png=None if not plot else Path(plot),
        )

    @classmethod
    def in_dir(cls, out_dir: str | Path, *, plot: bool = False) -> PlanOutputs:
        """A session's files in ``out_dir``.

        ``profile.csv``, ``frontier.csv``, ``plan.json``, ``summary.json`` and, with ``plot``,
        ``frontier.png``.
        """
        out = Path(out_dir)
        return cls(
            profile_csv=out / "profile.csv",
            frontier_csv=out / "frontier.csv",
            plan_json=out / "plan.json",
            summary_json=out / "summary.json",
            frontier_png=out / "frontier.png" if plot else None,
            folder=out,
        )


def write_plan_outputs(
    outputs: PlanOutputs,
    choice: Choice,
    *,
    plan_metadata: Mapping[str, object] | None = None,
    refused: bool = False,
    profile: Callable[[], Profile] | None = None,
    info: PlanSummary | None = None,
    say: Progress | None = None,
) -> None:
    """Write a plan's files: profile, frontier, plan, summary, then the plot.

    The one writer of plan outputs (``powerlib plan``, ``powerlib kareus plan``, rank 0).

    Args:
        outputs: Where.
        choice: The chosen point and its frontier.
        plan_metadata: Extra workload fields of the plan file.
        refused: The plan was refused: no plan file (a session's).
        profile: Makes the profile to write (with the P_block and τ planned with).
        info: The summary.
        say: Where a folder's files and a missing plot are said (default: nowhere).

    Raises:
        BackendUnavailableError: ``frontier_png`` without matplotlib, outside a folder.
    """
    say = say or Progress(False)
    if outputs.folder is not None:
        outputs.folder.mkdir(parents=True, exist_ok=True)
    if outputs.profile_csv and profile is not None:
        profile().write_csv(outputs.profile_csv)
    if outputs.frontier_csv:
        write_frontier_csv(choice.frontier, outputs.frontier_csv)
    if outputs.plan_json and not refused:
        choice.plan(metadata=plan_metadata).write(outputs.plan_json)
    if outputs.summary_json and info is not None:
        outputs.summary_json.write_text(
            json.dumps(info.to_json(), indent=1) + "\n", encoding="utf-8"
        )
    if outputs.folder is not None:
        say.say(
            f"profile, frontier, {'plan and ' if not refused else ''}summary written to "
            f"{outputs.folder}/",
        )
    if outputs.frontier_png:
        try:
            plot_frontier(choice.frontier, choice.point, outputs.frontier_png)
        except BackendUnavailableError as err:
            if outputs.folder is None:
                raise
            say.say(f"no frontier.png: {err}")


def _per_iteration(choice: Choice) -> PerIteration:
    """The plan's iteration against the baseline's, as the job runs them.

    ``saving_at_plan_time_percent`` charges the baseline at the plan's own time (all-max plus
    blocking power up to it, the Perseus convention); a job compares iterations. A baseline
    iteration lasts its own time (T_min, all-max), the plan's its replayed time; under
    ``deadline`` a straggler holds both to its T′ and the held stages draw blocking power
    meanwhile. For a plan slower than T_min (``min-energy``) the two conventions differ by the
    baseline's blocking energy of the extra time.
    """
    frontier, policy, realized = choice.frontier, choice.policy, choice.realized
    hold_s = 0.0
    if policy.name == "deadline" and policy.deadline_s is not None:
        hold_s = policy.deadline_s
    base = frontier.baseline(max(frontier.baseline_time_s, hold_s))
    time_s = max(realized.time_s, hold_s)
    blocking_w = frontier.settings.p_block_w * frontier.dag.num_stages
    what = "every instruction at its maximum frequency"
    if frontier.reference_times is not None:
        what = "Megatron-LM, sequential execution at the maximum clock"
    return PerIteration(
        description=_PER_ITERATION.format(what),
        time_s=time_s,
        energy_j=realized.energy_j + blocking_w * (time_s - realized.time_s),
        baseline_time_s=base.time_s,
        baseline_energy_j=base.energy_j,
    )


def _saving_percent(energy_j: float, baseline_j: float) -> float | None:
    """Saving against a baseline; ``None`` when the baseline is not a positive energy."""
    return 100.0 * (1.0 - energy_j / baseline_j) if baseline_j > 0 else None


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (the optional ``plot`` extra).

    Raises:
        BackendUnavailableError: matplotlib is not installed (``pip install 'powerlib[plot]'``).
    """
    try:
        import matplotlib  # noqa: PLC0415 - optional extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 - optional extra, after use("Agg")
    except ImportError as err:
        raise BackendUnavailableError(
            "plotting needs matplotlib: pip install 'powerlib[plot]'"
        ) from err
    return plt


def plot_frontier(frontier: Frontier, chosen: FrontierPoint, path: str | Path) -> None:
    """Frontier energy vs time with T_min, T* and the chosen plan marked.

    Raises:
        BackendUnavailableError: matplotlib is not installed (``pip install 'powerlib[plot]'``).
    """
    plt = pyplot()
    times = [p.time_s for p in frontier.points]
    energies = [p.energy_j for p in frontier.points]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(times, energies, color="#1f77b4", lw=1.6, label="frontier (model)")
    marks = [
        (frontier.fastest, "T_min", "#d62728", "o"),
        (frontier.min_energy, "T* (min energy)", "#2ca02c", "s"),
        (chosen, "chosen plan", "#ff7f0e", "*"),
    ]
    for point, label, colour, marker in marks:
        ax.scatter(
            [point.time_s],
            [point.energy_j],
            color=colour,
            marker=marker,
            s=80 if marker == "*" else 45,
            zorder=3,
            label=f"{label}: {point.time_s:.3f} s, {point.energy_j:.1f} J",
        )
    base = frontier.baseline(frontier.fastest.time_s)
    ax.scatter(
        [base.time_s],
        [base.energy_j],
        color="black",
        marker="x",
        s=45,
        zorder=3,
        label=f"all max frequency: {base.energy_j:.1f} J",
    )
    ax.set_xlabel("iteration time (s)")
    ax.set_ylabel("iteration energy (J)")
    ax.set_title(
        f"Perseus frontier: {frontier.num_stages} stages, {frontier.num_microbatches} microbatches, "
        f"{frontier.schedule_name}"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
