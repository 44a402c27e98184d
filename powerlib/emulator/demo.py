"""``powerlib demo`` and ``powerlib simulate``: the whole method on emulated GPUs, no GPU needed.

The demo drives an emulated pipeline (by default GPT-3 175B in 8 stages on A100s, from the Perseus
artifact's measured profile, see ``data/SOURCE.md``) through the *same* session code a training
job uses: one :class:`~powerlib.runtime.session.Session` per stage, coordinated in-process the way
``torch.distributed`` coordinates ranks; profile (frequency sweep on the emulated devices), plan
on rank 0, apply through the frequency controllers, and the sessions' closed loop, which measures
the plan against interleaved all-max windows.

The emulated GPUs behave like NVML by default (:data:`~powerlib.emulator.engine.NVML_LIKE_MODEL`:
a counter that publishes every 100 ms, driver reads that cost 3 ms, a clock latency of
20 ms +- 50 % that the sessions measure, hierarchical noise, thermal drift); ``ideal`` selects the old
idealized device, kept only to validate the planner. The report gives three figures side by
side: the planner's prediction, what the sessions measured, and the truth: the emulator's exact
time and energy of the plan the sessions applied, run by the session's own apply phase, against
all-max iterations on the same noise draws, paired over ``truth_iterations`` (200) draws, each
figure with its standard error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from powerlib.emulator.demo_result import (
    DemoProfiling,
    DemoResult,
    DemoWorkload,
)
from powerlib.emulator.engine import (
    LIVE_NOISE_KEYS,
    NVML_LIKE_MODEL,
    Emulator,
    IterationResult,
    NvmlLikeModel,
)
from powerlib.emulator.truth import (
    DEFAULT_P_BLOCK_W,
    default_profile,
    paired_truth,
    run_plan,
    simulate_plan,
)
from powerlib.errors import BackendUnavailableError, InvalidArgumentError
from powerlib.planning.perseus.report import PlanOutputs, pyplot
from powerlib.planning.pipeline import KIND_LETTERS
from powerlib.planning.plan import FrequencyPlan
from powerlib.planning.profile import Profile
from powerlib.planning.schedules import build_schedule
from powerlib.planning.workflow import PlanRequest, check_work, default_unit_time_s
from powerlib.progress import Progress
from powerlib.runtime.coordination import LocalGroup
from powerlib.runtime.phases import SessionPhase
from powerlib.runtime.records import SessionReport
from powerlib.runtime.session import Session, optimize

__all__ = [
    "DEFAULT_P_BLOCK_W",
    "DemoConfig",
    "default_profile",
    "paired_truth",
    "run_demo",
    "run_plan",
    "simulate_plan",
    "write_timeline",
]


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
        noise: Overrides the model's run-to-run noise (its independent part; after
            ``noise_model``).
        noise_model: Overrides the model's noise structure: ``fixed-length``,
            ``variable-length`` or ``iid`` (:data:`~powerlib.emulator.noise_model.NOISE_MODELS`),
            with that preset's independent part unless ``noise`` is given.
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
        request_ahead: The sessions request a switch to a faster clock ahead, so it lands by
            the instruction's start (docs/perseus.md §2.8); ``False``: at the previous
            instruction's end.
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
    noise_model: str | None = None
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
    request_ahead: bool = True
    progress: bool = True

    def effective_model(self) -> NvmlLikeModel:
        """:attr:`model` with the overrides that were given.

        Raises:
            InvalidArgumentError: An unknown :attr:`noise_model`.
        """
        overrides = {
            name: getattr(self, name)
            for name in ("switch_latency_s", "counter_period_s", "noise", "duty", "read_cost_s",
                         "drift")
            if getattr(self, name) is not None
        }  # fmt: skip
        model = self.model
        if self.noise_model is not None:
            try:
                model = model.with_noise_model(self.noise_model)
            except ValueError as err:
                raise InvalidArgumentError(str(err)) from None
        model = dataclasses.replace(model, **overrides)
        if model == self.model:
            return self.model
        return dataclasses.replace(model, name=f"{self.model.name} (modified)")


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
            request_ahead=config.request_ahead,
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
    first = emulator.run_iteration()
    # at the job-wide noise factor 1: the straggler's iterations carry that factor too
    base_makespan = first.makespan_s / emulator.noise_draws.iteration_factor(
        LIVE_NOISE_KEYS + first.index
    )
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
