"""``powerlib kareus`` (alias ``overlap``): the Kareus overlap scheduler from the command line.

``search`` runs the per-partition multi-pass search for a model's partition types and measures
the sequential, stock and non-partition components, into a *study* directory (resumable: rerun
the same command to continue an interrupted search). ``plan`` composes the study into
per-instruction options, solves the iteration frontier with the Perseus solver and writes a plan
whose instructions carry their partition settings.

Measurements come from the simulated partition evaluator (A100 or H100 parameters). Measuring
real GPUs needs the partition kernels of the training framework: use
:class:`powerlib.kareus.meter.DeviceEvaluator` from Python with a callable that runs one
partition, and the same study layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from powerlib.cli.format import pct
from powerlib.cli.options import Number, OutputPath, PhaseBars, emit_json, plan_outputs
from powerlib.errors import PlanError
from powerlib.kareus.shapes import MODEL_SHAPES
from powerlib.kareus.sim_params import GPUS
from powerlib.kareus.workflow import SCHEDULES
from powerlib.planning.names import COST_MODELS, POLICIES

if TYPE_CHECKING:
    from powerlib.kareus.workflow import StudyPlanResult

__all__ = ["kareus", "overlap"]


def _freqs(text: str) -> tuple[float, ...]:
    """``900:1410:30`` (inclusive range) or ``900,1200,1410``."""
    try:
        if ":" in text:
            lo, hi, step = (float(x) for x in text.split(":"))
            if step <= 0 or hi < lo:
                raise ValueError
            n = int(round((hi - lo) / step))
            return tuple(lo + i * step for i in range(n + 1) if lo + i * step <= hi + 1e-9)
        return tuple(sorted({float(x) for x in text.split(",") if x.strip()}))
    except ValueError as err:
        raise PlanError(
            f"--freqs must be LOW:HIGH:STEP or a comma-separated list of MHz values, got {text!r}"
        ) from err


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError as err:
        raise PlanError(
            f"--stage-layers must be comma-separated layer counts, got {text!r}"
        ) from err


@click.group()
def kareus() -> None:
    """Kareus: per-partition launch point, SM share and clock, planned with Perseus."""


@kareus.command()
@click.argument("study_dir", metavar="STUDY_DIR", type=OutputPath(folder=True))
@click.option(
    "--model",
    type=click.Choice(list(MODEL_SHAPES)),
    default="llama3.2-3b",
    show_default=True,
    help="Layer shapes (docs/kareus.md §5.4).",
)
@click.option(
    "--tp", type=click.IntRange(min=1), default=8, show_default=True, help="Tensor parallel."
)
@click.option(
    "--cp", type=click.IntRange(min=1), default=1, show_default=True, help="Context parallel."
)
@click.option("--micro-batch", type=click.IntRange(min=2), default=8, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option(
    "--stage-layers",
    default="15,13",
    show_default=True,
    help="Layers per pipeline stage (comma-separated; must add up to the model's layers).",
)
@click.option("--no-recompute", is_flag=True, help="No activation checkpointing.")
@click.option(
    "--freqs",
    "freqs_text",
    default="900:1410:30",
    show_default=True,
    help="Clocks to search: LOW:HIGH:STEP or a list (MHz).",
)
@click.option(
    "--partition",
    "partitions",
    multiple=True,
    help="Search only these partition types (repeatable; default all).",
)
@click.option("--gpu", type=click.Choice(list(GPUS)), default="a100", show_default=True)
@click.option(
    "--noise",
    type=Number(min=0.0, max=0.2),
    default=0.01,
    show_default=True,
    help="Simulated measurement noise (relative standard deviation).",
)
@click.option(
    "--window-s",
    type=Number(min=0.1),
    default=5.0,
    show_default=True,
    help="Measurement window per candidate.",
)
@click.option(
    "--cooldown-s",
    type=Number(min=0.0),
    default=5.0,
    show_default=True,
    help="Idle time between candidates.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary.")
def search(
    study_dir: str,
    model: str,
    tp: int,
    cp: int,
    micro_batch: int,
    seq_len: int,
    stage_layers: str,
    no_recompute: bool,
    freqs_text: str,
    partitions: tuple[str, ...],
    gpu: str,
    noise: float,
    window_s: float,
    cooldown_s: float,
    seed: int,
    as_json: bool,
) -> None:
    """Search every partition type of a model's layer and measure the other components.

    Writes STUDY_DIR/study.json and one resumable evaluation log per partition type
    (STUDY_DIR/<type>.jsonl). Rerunning with the same options continues from the logs.
    """
    from powerlib.kareus.evaluator import MeasureProtocol  # noqa: PLC0415 - a command loads only what it runs (fast --help)
    from powerlib.kareus.shapes import Parallelism  # noqa: PLC0415 - a command loads only what it runs (fast --help)
    from powerlib.kareus.sim_model import SimulatedOverlapEvaluator  # noqa: PLC0415 - keep CLI start fast
    from powerlib.kareus.workflow import search_study  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    par = Parallelism(
        tp=tp, cp=cp, micro_batch=micro_batch, seq_len=seq_len, recompute=not no_recompute
    )
    layers = _layers(stage_layers)
    evaluator = SimulatedOverlapEvaluator(
        GPUS[gpu],
        protocol=MeasureProtocol(window_s=window_s, cooldown_s=cooldown_s),
        noise=noise,
        seed=seed,
        freqs_mhz=_freqs(freqs_text),
    )
    with PhaseBars(lambda phase: f"{phase:<12}", in_logs=True) as bars:
        result = search_study(
            study_dir,
            model=model,
            parallelism=par,
            stage_layers=layers,
            evaluator=evaluator,
            evaluator_info={
                "kind": "simulated",
                "gpu": gpu,
                "noise": noise,
                "seed": seed,
                "window_s": window_s,
                "cooldown_s": cooldown_s,
            },
            partitions=partitions,
            seed=seed,
            progress=bars,
        )
    rows, path, freqs = result.partitions, result.study_path, result.freqs_mhz
    if as_json:
        emit_json(result.to_json())
        return
    click.echo(f"{result.workload_label}: {len(rows)} partition type(s), {len(freqs)} clocks")
    click.echo(
        f"{'partition':<12} {'space':>5} {'evals':>5} {'budget':>6} {'front':>5} "
        f"{'stopped':<9} {'profiling':>9}"
    )
    for r in rows:
        click.echo(
            f"{r.partition:<12} {r.space:>5} {r.evaluations:>5} {r.budget:>6} "
            f"{r.pareto_points:>5} {r.stopped:<9} {r.profiling_h:>8.2f}h"
        )
    click.echo(f"study written to {path}; next: powerlib kareus plan {study_dir} --microbatches 8")


@kareus.command(name="plan")
@click.argument("study_dir", metavar="STUDY_DIR", type=click.Path(file_okay=False))
@click.option(
    "--microbatches",
    type=click.IntRange(min=1),
    required=True,
    help="Microbatches M per iteration.",
)
@click.option("--schedule", type=click.Choice(SCHEDULES), default="1f1b", show_default=True)
@click.option(
    "--unit-time-s",
    type=Number(min=0.0, min_open=True),
    default=0.001,
    show_default=True,
    help="Time quantum τ.",
)
@click.option(
    "--cost-model",
    type=click.Choice(COST_MODELS),
    default="convex",
    show_default=True,
    help="Exponential fit, or the lower convex hull (frontiers of nested option sets nest).",
)
@click.option(
    "--correction",
    type=Number(min=0.0, min_open=True),
    default=1.0,
    show_default=True,
    help="Factor on composed partition sums (isolated vs in-situ gap; the artifact: 1.15).",
)
@click.option(
    "--policy",
    type=click.Choice(POLICIES),
    default="fastest",
    show_default=True,
)
@click.option(
    "--compare",
    is_flag=True,
    help="Also solve Perseus-only and nanobatch+Perseus and report the paper's metrics.",
)
@plan_outputs
def plan_(
    study_dir: str,
    microbatches: int,
    schedule: str,
    unit_time_s: float,
    cost_model: str,
    correction: float,
    policy: str,
    deadline_s: float | None,
    max_slowdown: float,
    switch_latency_s: float,
    compare: bool,
    frontier_out: str | None,
    plan_out: str | None,
    plot_path: str | None,
    max_work: int,
    as_json: bool,
) -> None:
    """Compose a study into instruction options, solve the frontier and pick a plan.

    Same outputs as `powerlib plan`, plus each instruction's execution mode (sequential or
    nanobatch) and per-partition launch slot and SM count. Savings are against Megatron-LM:
    sequential execution at the highest clock.
    """
    from powerlib.kareus.workflow import plan_from_study  # noqa: PLC0415 - a command loads only what it runs (fast --help)
    from powerlib.planning.choice import Policy  # noqa: PLC0415 - keep CLI start fast
    from powerlib.planning.perseus.report import PlanOutputs, write_plan_outputs  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    if policy == "deadline" and deadline_s is None:
        raise click.UsageError("--policy deadline needs --deadline-s")
    if policy == "power-budget":  # limits, not a frontier point (docs/perseus.md §7)
        raise click.UsageError(
            "kareus plan picks a frontier point and cannot hold a power budget: plan one with "
            "`powerlib plan PROFILE --policy power-budget --budget F`"
        )
    chosen_policy = Policy(
        name=policy,
        deadline_s=deadline_s,
        max_slowdown=max_slowdown,
        switch_latency_s=switch_latency_s,
    )
    with PhaseBars(lambda method: f"solving {method:<9}") as bars:
        result = plan_from_study(
            study_dir,
            microbatches=microbatches,
            schedule=schedule,
            unit_time_s=unit_time_s,
            cost_model=cost_model,
            correction=correction,
            policy=chosen_policy,
            compare=compare,
            max_work=max_work,
            progress=bars,
        )
    write_plan_outputs(
        PlanOutputs.files(frontier=frontier_out, plan=plan_out, plot=plot_path),
        result.choice,
        plan_metadata=result.plan_metadata.to_json(),
    )
    if as_json:
        emit_json(result.summary.to_json())
        return
    _echo_plan(result, policy)
    for label, written in (("frontier", frontier_out), ("plan", plan_out), ("plot", plot_path)):
        if written:
            click.echo(f"{label} written to {written}")


def _echo_plan(result: StudyPlanResult, policy: str) -> None:
    """``kareus plan``'s text report: the frontier, the chosen point, the comparison."""
    data, frontier = result.summary.plan, result.frontier
    c = data.chosen
    click.echo(
        f"frontier: {data.num_points} points, {data.t_max_s:.4f} s -> "
        f"{data.t_min_s:.4f} s (T_min); minimum energy {data.t_star_energy_j:.1f} J at "
        f"T* = {data.t_star_s:.4f} s; Megatron-LM (sequential, max clock) "
        f"{frontier.baseline_time_s:.4f} s; solved in {result.solve_time_s:.1f} s"
    )
    click.echo(
        f"chosen ({policy}): {c.time_s:.4f} s, {c.energy_j:.1f} J planned; "
        f"{c.realized_time_s:.4f} s, {c.realized_energy_j:.1f} J replayed; "
        f"{result.nanobatch_instructions} of {len(result.choice.options)} instructions "
        "nanobatched"
    )
    click.echo(
        f"Megatron-LM energy at that time: {data.baseline.energy_j:.1f} J "
        f"({pct(data.saving_at_plan_time_percent)} less at the plan's time); predicted "
        f"{pct(data.saving_percent)} per iteration at {data.slowdown_percent:+.3f} %"
    )
    cmp_ = result.summary.comparison
    if cmp_ is None:
        return
    iso_t, iso_e = cmp_.iso_time_energy_reduction, cmp_.iso_energy_time_reduction
    click.echo(
        "vs Perseus-only: iso-time energy reduction "
        + ("n/a" if iso_t is None else f"{100 * iso_t:.2f} %")
        + ", iso-energy time reduction "
        + ("n/a" if iso_e is None else f"{100 * iso_e:.2f} %")
    )
    for name, d in cmp_.dominance.items():
        click.echo(
            f"  weakly dominates {name}+Perseus at {d.samples} sampled points: "
            f"{'yes' if d.weakly_dominated else 'NO'}"
        )


#: ``powerlib overlap``: the group's former name, kept as a hidden alias.
overlap = click.Group(name="overlap", commands=kareus.commands, help=kareus.help, hidden=True)
