"""``powerlib demo`` and ``powerlib simulate``: the whole method on emulated GPUs, no GPU needed.

The demo drives an emulated pipeline (by default GPT-3 175B in 8 stages on A100s, from the Perseus
artifact's measured profile, see ``data/SOURCE.md``) through the *same* session code a training
job uses: one :class:`~powerlib.runtime.session.Session` per stage, coordinated in-process the way
``torch.distributed`` coordinates ranks; profile (frequency sweep on the emulated devices), plan
on rank 0, apply through the frequency controllers, and the sessions' closed loop, which measures
the plan against interleaved all-max windows.

The emulated GPUs behave like NVML by default (:data:`~powerlib.emulator.engine.NVML_LIKE_MODEL`:
a counter that publishes every 100 ms, driver reads that cost 3 ms, a clock latency of
20 ms +- 50 % that the sessions measure, 2 % noise, thermal drift); ``ideal`` selects the old
idealized device, kept only to validate the planner. The report gives three figures side by
side: the planner's prediction, what the sessions measured, and the truth: the emulator's exact
time and energy of the plan the sessions applied, run by the session's own apply phase, against
all-max iterations on the same noise draws, paired over ``truth_iterations`` (200) draws, each
figure with its standard error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from powerlib.control import ControlSession
from powerlib.emulator.demo_result import DemoProfiling, DemoResult, DemoTruth, DemoWorkload
from powerlib.emulator.engine import (
    NVML_LIKE_MODEL,
    Emulator,
    IterationResult,
    NvmlLikeModel,
)
from powerlib.errors import BackendUnavailableError, InvalidArgumentError, PlanError
from powerlib.planning.perseus.report import PlanOutputs, pyplot
from powerlib.planning.pipeline import KIND_LETTERS
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.profile import Profile
from powerlib.planning.schedules import build_schedule
from powerlib.planning.workflow import PlanRequest, check_work, default_unit_time_s
from powerlib.progress import Progress
from powerlib.runtime.apply_phase import ApplyPhase
from powerlib.runtime.controller import FrequencyController
from powerlib.runtime.coordination import LocalGroup
from powerlib.runtime.phases import SessionPhase
from powerlib.runtime.records import SessionReport
from powerlib.runtime.session import Session, optimize

__all__ = [
    "DemoConfig",
    "default_profile",
    "paired_truth",
    "run_demo",
    "simulate_plan",
    "write_timeline",
]

DEFAULT_P_BLOCK_W = 83.64  # A100 blocking power of the Perseus artifact (docs/perseus.md §1.4)


def default_profile() -> Profile:
    """The shipped GPT-3 175B A100-SXM stage profile (8 stages, 38 clocks)."""
    ref = resources.files("powerlib.emulator").joinpath("data/gpt3-175b_a100_sxm.csv")
    return Profile.from_csv_text(ref.read_text(encoding="utf-8"), source="gpt3-175b_a100_sxm.csv")


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    """What the demo runs.

    Attributes:
        profile_path: Ground-truth profile of the emulated GPUs; ``None``: the shipped GPT-3 one.
        num_microbatches: Microbatches per iteration.
        schedule: Pipeline schedule.
        num_chunks: Chunks per stage (interleaved).
        p_block_w: Power of a waiting emulated GPU (the sessions measure it, they are not told).
        model: What the emulated GPUs do besides their table (default: NVML-like).
        switch_latency_s: Overrides the model's mean clock-change latency.
        counter_period_s: Overrides the model's energy-counter period.
        noise: Overrides the model's run-to-run noise.
        duty: Overrides the model's power-sampling duty (0.25: A100/H100 part-time sampling).
        read_cost_s: Overrides the model's driver read cost.
        drift: Overrides the model's thermal drift.
        straggler: Another data-parallel pipeline is this many times slower (T′ = ratio x T).
        policy: ``fastest`` (default), ``min-energy``; ``deadline`` with a straggler.
        apply_iterations: Iterations the sessions run once their check is over (the
            timeline picture shows the last).
        truth_iterations: Paired noise draws of the truth: the plan the sessions applied, run
            by the session's apply phase, and all-max, on each draw.
        out_dir: Where profile, frontier, plan, summary and pictures go; ``None``: nowhere.
        plot: Draw ``frontier.png`` and ``timeline.png`` (``plot`` extra).
        seed: Noise seed.
        progress: Progress on stderr.
    """

    profile_path: str | None = None
    num_microbatches: int = 12
    schedule: str = "1f1b"
    num_chunks: int = 1
    p_block_w: float = DEFAULT_P_BLOCK_W
    model: NvmlLikeModel = NVML_LIKE_MODEL
    switch_latency_s: float | None = None
    counter_period_s: float | None = None
    noise: float | None = None
    duty: float | None = None
    read_cost_s: float | None = None
    drift: float | None = None
    straggler: float | None = None
    policy: str | None = None
    apply_iterations: int = 6
    truth_iterations: int = 200
    out_dir: str | None = "powerlib-demo"
    plot: bool = True
    seed: int = 0
    progress: bool = True

    def effective_model(self) -> NvmlLikeModel:
        """:attr:`model` with the overrides that were given."""
        overrides = {
            name: getattr(self, name)
            for name in ("switch_latency_s", "counter_period_s", "noise", "duty", "read_cost_s",
                         "drift")
            if getattr(self, name) is not None
        }  # fmt: skip
        if not overrides:
            return self.model
        return dataclasses.replace(self.model, name=f"{self.model.name} (modified)", **overrides)


def _mean(results: list[IterationResult]) -> tuple[float, float]:
    return (
        statistics.fmean(r.time_s for r in results),
        statistics.fmean(r.energy_j for r in results),
    )


@dataclass(slots=True)
class _Drive:
    """What driving the sessions gave: managed iterations, the plan, profiling, their reports."""

    managed: list[IterationResult] = field(default_factory=list)
    plan: FrequencyPlan | None = None
    profile_iterations: int = 0
    stall_s: float = 0.0
    instructions: int = 0
    reports: list[SessionReport] = field(default_factory=list)


def _check(config: DemoConfig, profile: Profile) -> None:
    """Refuse bad parameters, and work the sessions' planner would refuse, before emulating."""
    if config.straggler is not None and not config.straggler >= 1.0:
        raise InvalidArgumentError(
            f"--straggler must be >= 1 (a slowdown factor), got {config.straggler}"
        )
    if config.apply_iterations < 1:
        raise InvalidArgumentError("apply_iterations must be >= 1")
    if config.truth_iterations < 2:
        raise InvalidArgumentError("truth_iterations must be >= 2 (a standard error needs two)")
    # The sessions plan at the end of profiling: refuse work they would refuse, before emulating
    # tens of iterations of it (and before building a schedule of 100000 microbatches).
    check_work(
        profile,
        PlanRequest(
            num_stages=profile.num_stages,
            num_microbatches=config.num_microbatches,
            schedule=config.schedule,
            num_chunks=config.num_chunks,
            unit_time_s=default_unit_time_s(profile),  # the gathered profile carries no τ
            work_hint="use fewer --microbatches",
        ),
    )


def _sessions(
    config: DemoConfig, emulator: Emulator, num_stages: int, policy: str
) -> list[Session]:
    """One session per emulated stage, coordinated in-process, applying inline."""
    group = LocalGroup(num_stages)
    return [
        optimize(
            num_stages=num_stages,
            num_microbatches=config.num_microbatches,
            schedule=config.schedule,
            num_chunks=config.num_chunks,
            stage=s,
            backend=emulator.backend,
            device=s,
            coordinator=group.member(s),
            clock=emulator.clock,
            threaded=False,
            policy=policy,
            deadline_ratio=config.straggler if policy == "deadline" else None,
            out_dir=None if config.out_dir is None else Path(config.out_dir),
            plot=config.plot,
            progress=config.progress and s == 0,
        )
        for s in range(num_stages)
    ]


def _drive(sessions: list[Session], emulator: Emulator, apply_iterations: int) -> _Drive:
    """Run iterations until ``apply_iterations`` managed ones (or the sessions are done)."""
    drive = _Drive()
    keys = iter(range(1, 1 << 30))
    with contextlib.ExitStack() as stack:
        for session in sessions:
            stack.enter_context(session)
        cap = sessions[0].iteration_budget() + apply_iterations + 5
        for _ in range(cap):
            if all(s.phase is SessionPhase.APPLY for s in sessions):
                drive.managed.append(emulator.run_iteration(sessions, noise_key=next(keys)))
                if len(drive.managed) >= apply_iterations:
                    break
                continue
            result = emulator.run_iteration(sessions)
            if SessionPhase.PROFILE in result.phases:
                drive.profile_iterations += 1
                drive.stall_s += result.stall_s
                drive.instructions += len(result.executed)
            if all(s.phase is SessionPhase.DONE for s in sessions):
                break
        drive.plan = sessions[0].plan
        drive.reports = [s.report() for s in sessions]
    return drive


def _write_pictures(
    config: DemoConfig, managed: IterationResult, policy: str, progress: Progress
) -> dict[str, str]:
    """The files the sessions wrote, and the timeline of one managed iteration."""
    if config.out_dir is None:
        return {}
    out_dir = Path(config.out_dir)
    files = PlanOutputs.in_dir(out_dir, plot=True)  # the names rank 0's writer uses
    written = (files.profile_csv, files.frontier_csv, files.plan_json, files.summary_json)
    outputs = {path.name: str(path) for path in written if path is not None}
    if config.plot:
        if files.frontier_png is not None and files.frontier_png.exists():
            outputs[files.frontier_png.name] = str(files.frontier_png)
        try:
            write_timeline(
                managed, out_dir / "timeline.png", title=f"one managed iteration ({policy})"
            )
            outputs["timeline.png"] = str(out_dir / "timeline.png")
        except BackendUnavailableError as err:
            progress.say(f"no pictures: {err}")
    return outputs


def _emulator(
    config: DemoConfig, profile: Profile, progress: Progress
) -> tuple[Emulator, NvmlLikeModel, float, float | None]:
    """The emulated pipeline, its device model, its all-max makespan, the straggler's T′."""
    schedule = build_schedule(
        config.schedule, profile.num_stages, config.num_microbatches, config.num_chunks
    )
    model = config.effective_model()
    emulator = Emulator(
        profile,
        schedule,
        p_block_w=config.p_block_w,
        model=model,
        seed=config.seed,
        device_name="Emulated A100-SXM (Perseus GPT-3 175B profile)"
        if config.profile_path is None
        else "Emulated GPU",
    )
    progress.say(
        f"emulating {profile.num_stages} stages x {config.num_microbatches} microbatches "
        f"({config.schedule}) from {profile.source} on {model.describe()}",
    )
    base_makespan = emulator.run_iteration().makespan_s
    deadline_s = None
    if config.straggler is not None:
        deadline_s = config.straggler * base_makespan
        emulator.straggler_time_s = deadline_s
        progress.say(
            f"a straggler pipeline holds every iteration to {deadline_s:.4f} s ({config.straggler:g}x)",
        )
    return emulator, model, base_makespan, deadline_s


def run_demo(config: DemoConfig) -> DemoResult:
    """Baseline, then profile -> plan -> apply through sessions; returns the report.

    Raises:
        InvalidArgumentError: Bad parameters.
        PlanError: A bad profile.
    """
    started = time.perf_counter()
    progress = Progress(config.progress)
    profile = (
        default_profile() if config.profile_path is None else Profile.read(config.profile_path)
    )
    _check(config, profile)
    num_stages = profile.num_stages
    policy = config.policy or ("deadline" if config.straggler else "fastest")
    emulator, model, _, deadline_s = _emulator(config, profile, progress)
    sessions = _sessions(config, emulator, num_stages, policy)
    drive = _drive(sessions, emulator, config.apply_iterations)
    managed, reports = drive.managed, drive.reports
    if drive.plan is None or len(managed) < config.apply_iterations:
        raise InvalidArgumentError("the sessions never applied a plan; see the warnings above")
    emulator.unlock_all()
    truth = paired_truth(emulator, drive.plan, config.truth_iterations)
    outputs = _write_pictures(config, managed[-1], policy, progress)
    realized = reports[0].realized
    return DemoResult(
        model=model,
        workload=DemoWorkload(
            profile=profile.source,
            num_stages=num_stages,
            num_microbatches=config.num_microbatches,
            schedule=config.schedule,
            p_block_w=config.p_block_w,
            straggler=config.straggler,
            deadline_s=deadline_s,
        ),
        policy=policy,
        truth=truth,
        predicted=reports[0].predicted,
        # the sessions' record as they wrote it: read as a plain dict (its fields are theirs)
        measured_by_sessions=None if realized is None else dict(realized.to_json()),
        profile=DemoProfiling(
            iterations=drive.profile_iterations,
            freqs_mhz=reports[0].profiled_freqs_mhz,
            measured_p_block_w=tuple(r.measured_p_block_w for r in reports),
            measured_latency_s=tuple(r.measured_latency_s for r in reports),
            hook_stall_s_per_instruction=drive.stall_s / drive.instructions
            if drive.instructions
            else 0.0,
        ),
        apply_started_iteration=reports[0].apply_started_iteration,
        frequency_changes_per_iteration=sum(r.frequency_changes for r in reports)
        / max(len(managed), 1),
        elapsed_s=time.perf_counter() - started,
        outputs=outputs,
    )


def paired_truth(
    emulator: Emulator, plan: FrequencyPlan, iterations: int, *, block: int = 25
) -> DemoTruth:
    """``plan`` against all-max on ``emulator``, paired over noise draws ``1..iterations``.

    The plan runs through the session's own apply phase (:func:`run_plan`: what a session
    applies once its check is over), all-max unlocked, each draw once each. The draws run in
    blocks of ``block`` whose order alternates (all-max first, then the plan first), so that
    the emulated GPUs' slow thermal drift weighs on both alike; each plan block starts with one
    unmeasured iteration that lands its first clocks.
    """
    base: list[IterationResult] = []
    runs: list[IterationResult] = []
    for j, first in enumerate(range(1, iterations + 1, block)):
        count = min(block, iterations + 1 - first)
        if j % 2:
            runs += run_plan(emulator, plan, count, first_key=first)
        base += [emulator.run_iteration(noise_key=k) for k in range(first, first + count)]
        if not j % 2:
            runs += run_plan(emulator, plan, count, first_key=first)
    return DemoTruth.paired(base, runs)


def simulate_plan(
    plan: str | FrequencyPlan,
    *,
    profile_path: str | None = None,
    p_block_w: float = DEFAULT_P_BLOCK_W,
    model: NvmlLikeModel = NVML_LIKE_MODEL,
    switch_latency_s: float | None = None,
    straggler_time_s: float | None = None,
    iterations: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """Replay a saved plan on the emulator and compare it with all maximum clocks.

    The plan is applied by the session's own apply phase
    (:class:`~powerlib.runtime.apply_phase.ApplyPhase`, one per stage, over inline frequency
    controllers on the emulated GPUs): each clock is requested when the previous instruction
    ends and lands after the switch latency. The emulator runs the plan's own order, so the
    first iteration's order check is skipped (it could not fail) and prefetching starts at once.

    Args:
        plan: The plan file, or a plan already read (its ``source`` names it in the result).
        profile_path: Ground-truth profile of the emulated GPUs; ``None``: the shipped one.
        p_block_w: Power of a waiting emulated GPU.
        model: What the emulated GPUs do (default NVML-like; :data:`IDEAL_MODEL` to check a
            plan against the planner's own replay).
        switch_latency_s: Overrides the model's mean clock-change latency.
        straggler_time_s: A straggler holds every iteration to this time.
        iterations: Managed iterations replayed (their mean is reported); the all-max
            baseline runs the same noise draws (paired).
        seed: Noise seed.

    Raises:
        PlanError: A malformed plan, or one that does not fit the profile: another number of
            stages (the message names both), a workload its own instructions contradict, kinds
            or clocks the profile lacks. Nothing is run then.
    """
    if not isinstance(plan, FrequencyPlan):
        plan = FrequencyPlan.read(plan)
    plan_path = plan.source
    profile = default_profile() if profile_path is None else Profile.read(profile_path)
    plan.check_workload(num_stages=profile.num_stages, against=f"the profile {profile.source}")
    # The plan lists every stage's instructions in execution order: that is the schedule.
    schedule = [[p.instruction for p in plan.stage(s)] for s in range(plan.num_stages)]
    if switch_latency_s is not None:
        model = dataclasses.replace(model, switch_latency_s=switch_latency_s)
    try:
        emulator = Emulator(
            profile,
            schedule,
            placement=str(plan.workload.get("placement", "looped")),
            p_block_w=p_block_w,
            model=model,
            straggler_time_s=straggler_time_s,
            seed=seed,
        )
    except PlanError as err:  # the plan's order is no pipeline, or it needs what the profile lacks
        if str(err).startswith((f"{profile.source}:", f"{plan_path}:")):
            raise
        raise PlanError(f"{plan_path}: {err}") from err
    base_runs = [emulator.run_iteration(noise_key=k) for k in range(1, iterations + 1)]
    for s in range(plan.num_stages):
        plan.check_frequencies(emulator.devices[s].info.supported_sm_freqs_mhz, s)
    runs = run_plan(emulator, plan, iterations)
    time_s, energy_j = _mean(runs)
    base_time_s, base_energy_j = _mean(base_runs)
    return {
        "schema": "powerlib.simulate.v2",
        "plan": plan_path,
        "profile": profile.source,
        "model": model.to_json(),
        "model_description": model.describe(),
        "baseline": {"time_s": base_time_s, "energy_j": base_energy_j},
        "plan_result": {"time_s": time_s, "energy_j": energy_j},
        "saving_percent": 100.0 * (1.0 - energy_j / base_energy_j),
        "slowdown_percent": 100.0 * (time_s / base_time_s - 1.0),
        "planned": {k: plan.summary.get(k) for k in ("policy", "time_s", "energy_j", "saving")},
    }


def run_plan(
    emulator: Emulator, plan: FrequencyPlan, iterations: int, *, first_key: int = 1
) -> list[IterationResult]:
    """Run ``plan`` on ``emulator`` for ``iterations`` noise draws from ``first_key`` on.

    The session's own apply phase, one per stage, over inline frequency controllers on the
    emulated GPUs. The emulator runs the plan's own order, so there is no order to check: every
    clock is prefetched from the first instruction on. One unmeasured iteration first lets the
    first clocks land; the GPUs are unlocked afterwards.
    """
    with ControlSession(emulator.backend) as control:
        phases = [
            ApplyPhase(
                plan,
                s,
                FrequencyController(control, device, threaded=False, clock=emulator.clock),
                check_order=False,
            )
            for s, device in enumerate(emulator.devices)
        ]
        emulator.run_iteration(phases)  # the first clocks land
        keys = range(first_key, first_key + iterations)
        runs = [emulator.run_iteration(phases, noise_key=k) for k in keys]
    emulator.unlock_all()
    return runs


def write_timeline(result: IterationResult, path: str | Path, *, title: str = "") -> None:
    """Per-stage Gantt chart of one iteration, each segment coloured by its SM clock.

    Raises:
        BackendUnavailableError: matplotlib is not installed (``pip install 'powerlib[plot]'``).
    """
    plt = pyplot()
    from matplotlib import cm, colors  # noqa: PLC0415 - installed: pyplot() imported it

    freqs = [f for ex in result.executed for _, _, f in ex.segments]
    norm = colors.Normalize(
        vmin=min(freqs), vmax=max(freqs) if max(freqs) > min(freqs) else min(freqs) + 1
    )
    cmap = plt.get_cmap("viridis")
    num_stages = 1 + max(ex.instruction.stage for ex in result.executed)
    fig, ax = plt.subplots(figsize=(11, 0.5 * num_stages + 1.6), dpi=120)
    for ex in result.executed:
        y = num_stages - 1 - ex.instruction.stage
        for t0, t1, f in ex.segments:
            ax.barh(
                y,
                t1 - t0,
                left=t0 - result.start_s,
                height=0.8,
                color=cmap(norm(f)),
                edgecolor="none",
            )
        ax.barh(
            y,
            ex.end_s - ex.start_s,
            left=ex.start_s - result.start_s,
            height=0.8,
            fill=False,
            edgecolor="white",
            linewidth=0.4,
        )
        if ex.end_s - ex.start_s > result.time_s / 80:
            ax.text(
                (ex.start_s + ex.end_s) / 2 - result.start_s,
                y,
                KIND_LETTERS[ex.instruction.kind] + str(ex.instruction.microbatch),
                ha="center",
                va="center",
                fontsize=5,
                color="white",
            )
    ax.set_yticks(range(num_stages), [f"stage {num_stages - 1 - i}" for i in range(num_stages)])
    ax.set_xlabel("time within the iteration (s)")
    ax.set_title(title or "one iteration")
    ax.set_xlim(0, result.time_s)
    fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="SM clock (MHz)", pad=0.01)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
