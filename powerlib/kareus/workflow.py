"""Kareus studies as single calls: what ``powerlib kareus search`` and ``kareus plan`` run.

:func:`search_study` searches every partition type of a workload with a given evaluator and
measures the other components into a study directory; :func:`plan_from_study` composes a study
into per-instruction options, solves the iteration frontier and applies the policy step.
:func:`compose_methods` and :func:`solve_methods` are the compose -> frontier loop both use, for
callers that hold measurements in memory (the benchmark, the tests).

Planning imports no emulator: the caller passes the evaluator (the CLI builds the simulated one;
:class:`powerlib.kareus.meter.DeviceEvaluator` measures real GPUs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from powerlib.errors import PlanError
from powerlib.planning.perseus.work import DEFAULT_MAX_WORK

if TYPE_CHECKING:
    from powerlib.kareus.comparison import FrontierComparison
    from powerlib.kareus.compose import Components, ComposedOptions, Knob
    from powerlib.kareus.evaluator import Evaluator
    from powerlib.kareus.partition import PartitionWorkload
    from powerlib.kareus.partition_types import Config, PartitionType
    from powerlib.kareus.shapes import Parallelism
    from powerlib.kareus.study import Study
    from powerlib.planning.choice import Choice, Policy
    from powerlib.planning.perseus.frontier import Frontier
    from powerlib.planning.perseus.report import PlanSummary

__all__ = [
    "METHODS",
    "SCHEDULES",
    "KareusPlanMetadata",
    "KareusPlanSummary",
    "OverlapSummary",
    "PartitionSearch",
    "StudyPlanResult",
    "StudySearchResult",
    "compose_methods",
    "plan_from_study",
    "search_study",
    "solve_methods",
]

#: Kareus, then the baselines ``--compare`` adds.
METHODS = ("kareus", "perseus", "nanobatch")

#: The pipeline schedules a Kareus plan is solved on: those of
#: :data:`~powerlib.planning.schedules.SCHEDULE_NAMES` with one model chunk per stage.
SCHEDULES = ("1f1b", "gpipe")

#: ``progress(phase, done, total)``: a phase (partition type, ``components`` or a method) starts
#: with ``done == 0`` and advances to ``total``.
PhaseProgress = Callable[[str, int, int], None]

Records = Mapping[str, Sequence[tuple["Config", float, float]]]
Options = Mapping[tuple[int, str], Sequence[tuple[float, float, float, "Knob"]]]


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionSearch:
    """One partition type's search, as ``powerlib kareus search`` reports it."""

    partition: str
    space: int
    budget: int
    evaluations: int
    batches: int
    stopped: str
    pareto_points: int
    profiling_h: float
    fastest_s: float | None
    log: str

    def to_json(self) -> dict[str, Any]:
        """The row of ``powerlib.overlap-search.v1``."""
        return {
            "partition": self.partition,
            "space": self.space,
            "budget": self.budget,
            "evaluations": self.evaluations,
            "batches": self.batches,
            "stopped": self.stopped,
            "pareto_points": self.pareto_points,
            "profiling_h": self.profiling_h,
            "fastest_s": self.fastest_s,
            "log": self.log,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class StudySearchResult:
    """What :func:`search_study` measured and wrote.

    Attributes:
        study_path: The ``study.json`` written.
        workload_label: The workload searched.
        freqs_mhz: The clocks searched (the evaluator's).
        partitions: One row per partition type searched.
        elapsed_s: Wall time of the whole search.
    """

    study_path: Path
    workload_label: str
    freqs_mhz: tuple[float, ...]
    partitions: tuple[PartitionSearch, ...]
    elapsed_s: float

    def to_json(self) -> dict[str, Any]:
        """``powerlib.overlap-search.v1`` (what ``powerlib kareus search --json`` prints)."""
        return {
            "schema": "powerlib.overlap-search.v1",
            "study": str(self.study_path),
            "workload": self.workload_label,
            "partitions": [p.to_json() for p in self.partitions],
            "evaluations": sum(p.evaluations for p in self.partitions),
            "profiling_gpu_h_equivalent": sum(p.profiling_h for p in self.partitions),
            "elapsed_s": self.elapsed_s,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class OverlapSummary:
    """How the chosen plan's instructions run (the summary's ``overlap``).

    Attributes:
        workload: The workload planned.
        instructions: Instructions of the plan.
        nanobatch_instructions: Those that run as overlapped nanobatches.
        sequential_instructions: Those that run sequentially.
        partition_types: The workload's partition types.
        megatron_time_s: Megatron-LM's iteration time (sequential, highest clock).
    """

    workload: str
    instructions: int
    nanobatch_instructions: int
    sequential_instructions: int
    partition_types: tuple[str, ...]
    megatron_time_s: float

    def to_json(self) -> dict[str, object]:
        """Every field, by name."""
        return {
            "workload": self.workload,
            "instructions": self.instructions,
            "nanobatch_instructions": self.nanobatch_instructions,
            "sequential_instructions": self.sequential_instructions,
            "partition_types": list(self.partition_types),
            "megatron_time_s": self.megatron_time_s,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class KareusPlanSummary:
    """What ``powerlib kareus plan --json`` prints.

    Attributes:
        plan: The planner's summary of the choice (``powerlib.plan-summary.v2``).
        overlap: How the chosen plan's instructions run.
        comparison: The frontier against the baselines (``compare`` only).
    """

    plan: PlanSummary
    overlap: OverlapSummary
    comparison: FrontierComparison | None = None

    def to_json(self) -> dict[str, object]:
        """The plan summary's keys, then ``overlap`` (and ``comparison``)."""
        data = self.plan.to_json()
        data["overlap"] = self.overlap.to_json()
        if self.comparison is not None:
            data["comparison"] = self.comparison.to_json()
        return data


@dataclass(frozen=True, slots=True, kw_only=True)
class KareusPlanMetadata:
    """The Kareus fields a plan from a study carries (its workload's ``kareus``).

    Attributes:
        model: The model key.
        workload: The workload's label.
        stage_layers: Layers per pipeline stage.
        correction: The factor on composed partition sums.
        p_static_w: The static power of the study's dynamic energies.
        evaluator: How the study's evaluator is described.
    """

    model: str
    workload: str
    stage_layers: tuple[int, ...]
    correction: float
    p_static_w: float
    evaluator: Mapping[str, object]

    def to_json(self) -> dict[str, object]:
        """``{"kareus": {...}}``: the fields by name."""
        return {
            "kareus": {
                "model": self.model,
                "workload": self.workload,
                "stage_layers": list(self.stage_layers),
                "correction": self.correction,
                "p_static_w": self.p_static_w,
                "evaluator": dict(self.evaluator),
            }
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class StudyPlanResult:
    """What :func:`plan_from_study` found.

    Attributes:
        study: The study read.
        frontiers: Each solved method's frontier (``kareus`` always; the baselines with
            ``compare``).
        choice: The policy's point of the Kareus frontier, guarded and judged.
        summary: What ``powerlib kareus plan --json`` prints: the plan summary plus ``overlap``
            (and ``comparison`` with ``compare``).
        solve_time_s: Wall time of every frontier solve together.
        plan_metadata: The Kareus fields the plan file carries (their ``to_json()`` for
            :func:`powerlib.planning.perseus.report.write_plan_outputs`).
    """

    study: Study
    frontiers: dict[str, Frontier]
    choice: Choice
    summary: KareusPlanSummary
    solve_time_s: float
    plan_metadata: KareusPlanMetadata

    @property
    def frontier(self) -> Frontier:
        """The Kareus frontier."""
        return self.frontiers["kareus"]

    @property
    def nanobatch_instructions(self) -> int:
        """Instructions of the chosen plan that run as overlapped nanobatches."""
        return self.summary.overlap.nanobatch_instructions


def compose_methods(
    workload: PartitionWorkload,
    records: Records,
    components: Components,
    *,
    methods: Sequence[str] = METHODS,
    correction: float = 1.0,
) -> dict[str, ComposedOptions]:
    """Each method's per-instruction options (:func:`~.compose.compose_options`)."""
    from powerlib.kareus.compose import compose_options  # noqa: PLC0415 - search and plan each load only their own parts

    return {
        method: compose_options(workload, records, components, method=method, correction=correction)
        for method in methods
    }


def solve_methods(
    workload: PartitionWorkload,
    composed: Mapping[str, Options],
    components: Components,
    *,
    microbatches: int,
    schedule: str = "1f1b",
    unit_time_s: float = 1e-3,
    cost_model: str = "convex",
    max_work: int | None = DEFAULT_MAX_WORK,
    progress: PhaseProgress | None = None,
) -> dict[str, Frontier]:
    """Solve each method's iteration frontier on one pipeline schedule.

    The work estimate of every method is checked against ``max_work`` before the schedule is
    built.

    Raises:
        PlanError: Too much work, or options the solver refuses.
    """
    from powerlib.kareus.compose import method_frontier  # noqa: PLC0415 - search and plan each load only their own parts
    from powerlib.planning.perseus.work import WORK_HINT, estimate_pipeline_work  # noqa: PLC0415 - search and plan each load only their own parts
    from powerlib.planning.schedules import build_schedule  # noqa: PLC0415 - search and plan each load only their own parts

    for options in composed.values():
        estimate_pipeline_work(
            {key: [(o[1], o[2]) for o in opts] for key, opts in options.items()},
            num_stages=len(workload.stages),
            num_microbatches=microbatches,
            unit_time_s=unit_time_s,
        ).check(max_work, hint=WORK_HINT)
    sched = build_schedule(schedule, len(workload.stages), microbatches, 1)
    frontiers = {}
    for method, options in composed.items():
        on_step = None
        if progress is not None:
            progress(method, 0, 1)
            on_step = _phase(progress, method)
        frontiers[method] = method_frontier(
            workload,
            options,
            components,
            sched,
            schedule_name=schedule,
            num_microbatches=microbatches,
            unit_time_s=unit_time_s,
            cost_model=cost_model,
            progress=on_step,
            max_work=max_work,
        )
    return frontiers


def _phase(progress: PhaseProgress, phase: str) -> Callable[[int, int], None]:
    def step(done: int, total: int) -> None:
        progress(phase, done, total)

    return step


def read_records(study: Study) -> dict[str, list[tuple[Config, float, float]]]:
    """Every partition type's (config, time, dynamic energy) measurements from a study's logs.

    Raises:
        PlanError: A partition type without a log, or an unreadable log.
    """
    from powerlib.kareus.evaluation_log import read_log  # noqa: PLC0415 - search and plan each load only their own parts
    from powerlib.kareus.study import log_path  # noqa: PLC0415 - search and plan each load only their own parts

    records = {}
    for p in study.workload.partitions:
        path = log_path(study.directory, p.key)
        if not path.exists():
            raise PlanError(
                f"{path}: no evaluation log for partition type {p.key}; run "
                f"`powerlib kareus search {study.directory} --partition {p.key}`"
            )
        records[p.key] = [
            (r.config, r.time_s, r.dynamic_energy_j) for r in read_log(path, partition=p.key)
        ]
    return records


def plan_from_study(
    study_dir: str | Path,
    *,
    microbatches: int,
    schedule: str = "1f1b",
    unit_time_s: float = 1e-3,
    cost_model: str = "convex",
    correction: float = 1.0,
    policy: Policy,
    compare: bool = False,
    max_work: int | None = DEFAULT_MAX_WORK,
    progress: PhaseProgress | None = None,
) -> StudyPlanResult:
    """Compose a study into instruction options, solve the frontier and choose a plan.

    Savings are against Megatron-LM: sequential execution at the highest clock.

    Args:
        study_dir: A directory :func:`search_study` wrote.
        microbatches: Microbatches M per iteration.
        schedule: ``1f1b`` or ``gpipe``.
        unit_time_s: Time quantum τ.
        cost_model: ``convex`` (frontiers of nested option sets nest) or ``exp``.
        correction: Factor on composed partition sums (isolated vs in-situ gap).
        policy: Which frontier point becomes the plan.
        compare: Also solve Perseus-only and nanobatch+Perseus and compare the frontiers.
        max_work: Refuse a frontier estimated past this many instruction-steps (``None``: no
            limit).
        progress: ``progress(method, done, total)`` as each solve advances.

    Raises:
        PlanError: A missing or invalid study or log, too much work, or a deadline the frontier
            cannot meet.
    """
    from powerlib.kareus.comparison import compare_frontiers  # noqa: PLC0415 - search and plan each load only their own parts
    from powerlib.kareus.study import read_study  # noqa: PLC0415 - search and plan each load only their own parts
    from powerlib.planning.choice import choose  # noqa: PLC0415 - search and plan each load only their own parts
    from powerlib.planning.perseus.report import summary  # noqa: PLC0415 - search and plan each load only their own parts

    study = read_study(study_dir)
    workload = study.workload
    records = read_records(study)
    composed = compose_methods(
        workload,
        records,
        study.components,
        methods=METHODS if compare else ("kareus",),
        correction=correction,
    )
    started = time.perf_counter()
    frontiers = solve_methods(
        workload,
        composed,
        study.components,
        microbatches=microbatches,
        schedule=schedule,
        unit_time_s=unit_time_s,
        cost_model=cost_model,
        max_work=max_work,
        progress=progress,
    )
    solve_time_s = time.perf_counter() - started
    frontier = frontiers["kareus"]
    choice = choose(frontier, policy)
    comparison = None
    if compare:
        comparison = compare_frontiers(frontier, frontiers["perseus"], frontiers["nanobatch"])
    return StudyPlanResult(
        study=study,
        frontiers=frontiers,
        choice=choice,
        summary=KareusPlanSummary(
            plan=summary(choice, solve_time_s=solve_time_s),
            overlap=_overlap_summary(workload, choice, frontier),
            comparison=comparison,
        ),
        solve_time_s=solve_time_s,
        plan_metadata=_plan_metadata(study, correction),
    )


def _plan_metadata(study: Study, correction: float) -> KareusPlanMetadata:
    """The Kareus fields a plan from ``study`` carries."""
    return KareusPlanMetadata(
        model=study.model_key,
        workload=study.workload.label,
        stage_layers=study.stage_layers,
        correction=correction,
        p_static_w=study.components.p_static_w,
        evaluator=study.evaluator,
    )


def _overlap_summary(
    workload: PartitionWorkload, choice: Choice, frontier: Frontier
) -> OverlapSummary:
    """How the chosen plan's instructions run."""
    nano = sum(1 for o in choice.options if o.knob is not None and o.knob.execution == "nanobatch")
    return OverlapSummary(
        workload=workload.label,
        instructions=len(choice.options),
        nanobatch_instructions=nano,
        sequential_instructions=len(choice.options) - nano,
        partition_types=tuple(p.key for p in workload.partitions),
        megatron_time_s=frontier.baseline_time_s,
    )


def search_study(
    study_dir: str | Path,
    *,
    model: str,
    parallelism: Parallelism,
    stage_layers: Sequence[int],
    evaluator: Evaluator,
    evaluator_info: Mapping[str, Any],
    partitions: Sequence[str] = (),
    seed: int = 0,
    progress: PhaseProgress | None = None,
) -> StudySearchResult:
    """Search a workload's partition types and measure its other components into a study.

    Resumable: each partition type's evaluations go to ``<type>.jsonl`` in ``study_dir``, and
    a rerun with the same arguments continues from them.

    Args:
        study_dir: Where ``study.json`` and the logs go (created if missing).
        model: A key of :data:`~powerlib.kareus.partition.MODEL_SHAPES`.
        parallelism: Tensor/context parallelism, micro-batch, sequence length, recompute.
        stage_layers: Layers per pipeline stage (they must add up to the model's layers).
        evaluator: What measures (the simulator or GPUs); its clocks are the ones searched.
        evaluator_info: How the evaluator is described in ``study.json``.
        partitions: Partition types to search (default: all).
        seed: Search seed.
        progress: ``progress(phase, done, total)``: one phase per partition type (its key),
            then ``components``.

    Raises:
        PlanError: A stage split or partition type the model does not have.
    """
    from powerlib.kareus.compose import measure_components  # noqa: PLC0415 - search and plan each load only their own parts
    from powerlib.kareus.partition import build_workload  # noqa: PLC0415 - search and plan each load only their own parts
    from powerlib.kareus.shapes import MODEL_SHAPES  # noqa: PLC0415 - search and plan each load only their own parts
    from powerlib.kareus.study import write_study  # noqa: PLC0415 - search and plan each load only their own parts

    layers = tuple(stage_layers)
    workload = build_workload(MODEL_SHAPES[model], parallelism, layers)
    wanted = (
        [workload.partition(k) for k in partitions] if partitions else list(workload.partitions)
    )
    freqs = evaluator.freqs_mhz
    out = Path(study_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows = [_search_one(ptype, evaluator, freqs, out, seed, progress) for ptype in wanted]
    on_component = None
    if progress is not None:
        progress("components", 0, 1)
        on_component = _component_phase(progress)
    components = measure_components(workload, evaluator, freqs, progress=on_component)
    path = write_study(
        out,
        model_key=model,
        parallelism=parallelism,
        stage_layers=layers,
        freqs_mhz=freqs,
        components=components,
        evaluator=evaluator_info,
    )
    return StudySearchResult(
        study_path=path,
        workload_label=workload.label,
        freqs_mhz=tuple(freqs),
        partitions=tuple(rows),
        elapsed_s=time.perf_counter() - started,
    )


def _search_one(
    ptype: PartitionType,
    evaluator: Evaluator,
    freqs: Sequence[float],
    out: Path,
    seed: int,
    progress: PhaseProgress | None,
) -> PartitionSearch:
    """Search one partition type at clocks ``freqs``; its log goes into ``out``."""
    from powerlib.kareus.partition import config_space, search_budget  # noqa: PLC0415 - search and plan each load only their own parts
    from powerlib.kareus.search import search_partition  # noqa: PLC0415 - search and plan each load only their own parts
    from powerlib.kareus.study import log_path  # noqa: PLC0415 - search and plan each load only their own parts

    space = config_space(ptype, freqs)
    budget = search_budget(ptype)
    on_step = None
    if progress is not None:
        progress(ptype.key, 0, budget.total)
        on_step = _search_phase(progress, ptype.key)
    result = search_partition(
        ptype,
        space,
        evaluator,
        budget=budget,
        seed=seed,
        log_path=log_path(out, ptype.key),
        progress=on_step,
    )
    front = result.pareto("total")
    return PartitionSearch(
        partition=ptype.key,
        space=len(space),
        budget=budget.total,
        evaluations=result.evaluations_used,
        batches=result.batches_run,
        stopped=result.stopped,
        pareto_points=len(front),
        profiling_h=result.wall_s / 3600.0,
        fastest_s=front[0].time_s if front else None,
        log=str(log_path(out, ptype.key)),
    )


def _search_phase(progress: PhaseProgress, phase: str) -> Callable[[int, int, str], None]:
    def step(done: int, total: int, message: str) -> None:
        progress(phase, done, total)

    return step


def _component_phase(progress: PhaseProgress) -> Callable[[int, int, str], None]:
    def step(done: int, total: int, what: str) -> None:
        progress("components", done, total)

    return step
