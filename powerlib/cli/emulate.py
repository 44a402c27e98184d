"""``powerlib demo`` and ``powerlib simulate``: the method on emulated GPUs.

Each is one call into :mod:`powerlib.emulator.demo` (imported when the command runs) and a
table of all maximum clocks against the plan; ``demo`` formats the typed
:class:`~powerlib.emulator.demo_result.DemoResult`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from powerlib.cli.format import pct, table, versus_all_max
from powerlib.cli.options import Number, OutputPath, emit_json
from powerlib.planning.names import POLICIES, POWER_BUDGET
from powerlib.planning.schedules import SCHEDULE_NAMES

if TYPE_CHECKING:
    from powerlib.emulator.demo import DemoConfig
    from powerlib.emulator.demo_result import DemoResult
    from powerlib.emulator.engine import NvmlLikeModel
    from powerlib.planning.plan import FrequencyPlan

__all__ = ["demo", "simulate"]

# Shared by `demo` and `simulate`: the emulated GPUs' ground truth.
_EMULATED_PROFILE = click.option(
    "--profile",
    "profile_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Ground-truth profile of the emulated GPUs (default: the shipped GPT-3 175B A100 one).",
)
_EMULATED_P_BLOCK = click.option(
    "--p-block-w",
    type=Number(min=0.0),
    default=83.64,
    show_default=True,
    help="Power of a waiting emulated GPU (ground truth: sessions measure it, they are not told).",
)
_EMULATED_SWITCH_LATENCY = click.option(
    "--switch-latency-s",
    type=Number(min=0.0),
    default=None,
    help="Mean clock-change latency of the emulated GPUs (NVML-like: 0.02; ideal: 0.005).",
)
_IDEAL = click.option(
    "--ideal",
    is_flag=True,
    help="The idealized GPU (1 ms counter, free reads, 5 ms latency, no noise or drift): only to "
    "validate the planner. Default: NVML-like (100 ms counter, 3 ms reads, 20 ms +- 50 % "
    "latency, fixed-length hierarchical noise, 2 % thermal drift).",
)
# = powerlib.emulator.noise_model.NOISE_MODELS (tests/emulator/test_noise_model.py holds it),
# spelled out so that `powerlib --help` does not load the emulator
_NOISE_MODEL_NAMES = ("fixed-length", "variable-length", "iid")
_NOISE_MODEL = click.option(
    "--noise-model",
    type=click.Choice(_NOISE_MODEL_NAMES),
    default=None,
    help="How the emulated GPUs' noise is structured (docs/emulator.md): fixed-length (1 % per "
    "iteration + 0.5 % drift, 0.4 % independent, per-GPU offsets, rare fail-slows), "
    "variable-length (adds 1.7 % per microbatch, 0.35 % independent), iid (independent "
    "--noise only, 2 % by default: the stress case). Default: the model's (NVML-like: "
    "fixed-length; --ideal: none).",
)


def _with_noise_model(model: NvmlLikeModel, noise_model: str | None) -> NvmlLikeModel:
    """``model`` with the ``--noise-model`` preset, if one was given."""
    return model if noise_model is None else model.with_noise_model(noise_model)


@click.command()
@_EMULATED_PROFILE
@click.option("--microbatches", type=click.IntRange(min=1), default=12, show_default=True)
@click.option(
    "--schedule",
    type=click.Choice(SCHEDULE_NAMES),
    default="1f1b",
    show_default=True,
)
@click.option(
    "--straggler",
    type=Number(min=1.0),
    default=None,
    help="Another pipeline is this many times slower (e.g. 1.2): plan for its iteration time.",
)
@click.option(
    "--policy",
    type=click.Choice(POLICIES),
    default=None,
    help="Plan policy (default: fastest; deadline with --straggler; power-budget with --budget "
    "or --budget-w).",
)
@click.option(
    "--budget",
    "budget_fraction",
    type=Number(min=0.0),
    default=None,
    help="Power-budget policy: per-GPU power limits whose sum is this share of the GPUs' "
    "summed limits (0.8), beside the uniform cap (docs/perseus.md).",
)
@click.option(
    "--budget-w",
    type=Number(min=0.0),
    default=None,
    help="Power-budget policy, the budget in watts (instead of --budget).",
)
@_EMULATED_P_BLOCK
@_IDEAL
@_EMULATED_SWITCH_LATENCY
@click.option(
    "--counter-period-s",
    type=Number(min=0.0),
    default=None,
    help="Energy-counter update period of the emulated GPUs (NVML-like: 0.1; ideal: 0.001).",
)
@click.option(
    "--noise",
    type=Number(min=0.0, max=0.2),
    default=None,
    help="Independent multiplicative noise (std) on every instruction's time and power: the "
    "noise model's own part (fixed-length: 0.004, variable-length: 0.0035, iid: 0.02).",
)
@_NOISE_MODEL
@click.option(
    "--duty",
    type=Number(min=0.01, max=1.0),
    default=None,
    help="Share of each counter period in which power is sampled (A100/H100: 0.25; default 1).",
)
@click.option(
    "--read-cost-s",
    type=Number(min=0.0),
    default=None,
    help="Cost of one driver read to the thread that makes it (NVML-like: 0.003).",
)
@click.option(
    "--drift",
    type=Number(min=0.0, max=0.2),
    default=None,
    help="Thermal drift: powers rise by up to this share (NVML-like: 0.02).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Noise seed.")
@click.option(
    "--truth-iterations",
    type=click.IntRange(min=2, max=100_000),
    default=200,
    show_default=True,
    help="Paired noise draws of the true figures (the plan and all-max on each draw).",
)
@click.option(
    "--out-dir",
    type=OutputPath(folder=True),
    default="powerlib-demo",
    show_default=True,
    help="Where profile.csv, frontier.csv, plan.json, summary.json and the pictures go.",
)
@click.option(
    "--no-request-ahead",
    is_flag=True,
    help="The sessions request every clock at the previous instruction's end (default: a "
    "switch to a faster clock is requested ahead, to land by the instruction's start).",
)
@click.option("--no-plot", is_flag=True, help="Skip frontier.png and timeline.png.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def demo(
    profile_path: str | None,
    microbatches: int,
    schedule: str,
    straggler: float | None,
    policy: str | None,
    budget_fraction: float | None,
    budget_w: float | None,
    p_block_w: float,
    ideal: bool,
    switch_latency_s: float | None,
    counter_period_s: float | None,
    noise: float | None,
    noise_model: str | None,
    duty: float | None,
    read_cost_s: float | None,
    drift: float | None,
    seed: int,
    truth_iterations: int,
    out_dir: str,
    no_request_ahead: bool,
    no_plot: bool,
    as_json: bool,
) -> None:
    """The whole method on emulated GPUs, no GPU needed: profile -> plan -> apply.

    An 8-stage pipeline of emulated A100s runs GPT-3 175B's measured per-stage times and
    energies (the Perseus artifact's profile) in virtual time, through the same session code a
    training job uses. Prints all-max-clock vs powerlib: iteration time, energy per iteration,
    and the true saving and slowdown (paired over --truth-iterations noise draws, +- one
    standard error) beside what the sessions measured and the planner predicted.
    """
    from powerlib.emulator.demo import DemoConfig, run_demo  # noqa: PLC0415 - keep CLI start fast
    from powerlib.emulator.engine import IDEAL_MODEL, NVML_LIKE_MODEL  # noqa: PLC0415 - keep CLI start fast

    config = DemoConfig(
        profile_path=profile_path,
        num_microbatches=microbatches,
        schedule=schedule,
        num_chunks=2 if schedule == "interleaved" else 1,
        p_block_w=p_block_w,
        model=IDEAL_MODEL if ideal else NVML_LIKE_MODEL,
        switch_latency_s=switch_latency_s,
        counter_period_s=counter_period_s,
        noise=noise,
        noise_model=noise_model,
        duty=duty,
        read_cost_s=read_cost_s,
        drift=drift,
        straggler=straggler,
        policy=policy,
        out_dir=out_dir,
        plot=not no_plot,
        seed=seed,
        truth_iterations=truth_iterations,
        request_ahead=not no_request_ahead,
        progress=True,
    )
    if policy == POWER_BUDGET or budget_fraction is not None or budget_w is not None:
        _power_budget_demo(config, policy, budget_fraction, budget_w, as_json=as_json)
        return
    result = run_demo(config)
    if as_json:
        emit_json(result.to_json())
        return
    _echo_demo(result)


def _power_budget_demo(
    config: DemoConfig,
    policy: str | None,
    budget_fraction: float | None,
    budget_w: float | None,
    *,
    as_json: bool,
) -> None:
    """``demo --policy power-budget --budget``: the uniform cap beside the plan.

    ``--budget`` or ``--budget-w`` alone select the policy too (docs/perseus.md §7).
    """
    from powerlib.emulator.power_budget_demo import run_power_budget_demo  # noqa: PLC0415 - keep CLI start fast

    if policy not in (None, POWER_BUDGET):
        raise click.UsageError(f"--budget and --budget-w plan limits, not --policy {policy}")
    if budget_fraction is None and budget_w is None:
        raise click.UsageError("--policy power-budget needs --budget or --budget-w")
    result = run_power_budget_demo(config, budget_fraction=budget_fraction, budget_w=budget_w)
    if as_json:
        emit_json(result.to_json())
        return
    click.echo(
        f"power budget {result.plan.budget_w:.0f} W for {len(result.plan.admin_limits_w)} GPUs "
        f"(limits {max(result.plan.admin_limits_w):.0f} W each), emulated from {result.profile} "
        f"on {result.model.describe()}"
    )
    plan = result.plan
    rows = []
    for name, label, limits in (
        ("uncapped", "uncapped", plan.uncapped.limits_w),
        ("uniform_cap", "uniform cap", plan.uniform.limits_w),
        ("powerlib", "powerlib", plan.plan.limits_w),
    ):
        fig = result.figures(name)
        rows.append(
            [
                label,
                f"{fig['time_s']:.4f} s",
                f"{fig['energy_j']:.1f} J",
                f"{fig['slowdown_percent']:+.2f} %",
                " ".join(f"{w:.0f}" for w in limits),
            ]
        )
    table(["", "iteration time", "energy / iteration", "vs uncapped", "limits (W)"], rows)


def _signed(value: float | None) -> str:
    """A signed percentage, or "n/a"."""
    return "n/a" if value is None else f"{value:+.3f} %"


def _echo_demo(result: DemoResult) -> None:
    """The demo in words: workload, the all-max vs powerlib table, the three figures, files."""
    w = result.workload
    click.echo(
        f"{w.num_stages} stages x {w.num_microbatches} microbatches ({w.schedule}), "
        f"emulated from {w.profile} on {result.model.describe()}"
        + (
            f", straggler {w.straggler:g}x (T' = {w.deadline_s:.4f} s)"
            if w.straggler and w.deadline_s is not None
            else ""
        )
    )
    versus_all_max(
        result.baseline.to_json(), f"powerlib ({result.policy})", result.powerlib.to_json()
    )
    truth = result.truth
    click.echo(
        click.style(
            f"energy saved: {truth.saving_percent:.3f} +- {truth.saving_se_percent:.3f} %  "
            f"(slowdown {truth.slowdown_percent:+.3f} +- {truth.slowdown_se_percent:.3f} %)",
            bold=True,
        )
        + f"  true, paired with all-max over {truth.iterations} noise draws (+- 1 SE)"
    )
    measured, predicted = result.measured_by_sessions, result.predicted
    said = (
        "the planner predicted n/a"
        if predicted is None
        else f"the planner predicted {pct(predicted.saving_percent)} (slowdown "
        f"{_signed(predicted.slowdown_percent)})"
    )
    if measured is None:
        click.echo(f"the sessions reached no measured verdict; {said}")
    else:
        click.echo(
            f"the sessions measured {measured['saving_percent']:.2f} +- "
            f"{measured['saving_ci_percent']:.2f} % (slowdown "
            f"{measured['slowdown_percent']:+.3f} +- {measured['slowdown_ci_percent']:.3f} %, "
            f"95 % intervals); {said}"
        )
    prof = result.profile
    click.echo(
        f"profiled {len(prof.freqs_mhz)} clocks in {prof.iterations} iterations; "
        f"plan applied from iteration {result.apply_started_iteration}; "
        f"{result.elapsed_s:.1f} s"
    )
    for name, path in result.outputs.items():
        click.echo(f"  {name}: {path}")


@click.command()
@click.argument("plan_path", metavar="PLAN.json", type=click.Path(exists=True, dir_okay=False))
@_EMULATED_PROFILE
@_EMULATED_P_BLOCK
@_IDEAL
@_EMULATED_SWITCH_LATENCY
@_NOISE_MODEL
@click.option(
    "--deadline-s",
    type=Number(min=0.0),
    default=None,
    help="A straggler holds every iteration to this time.",
)
@click.option(
    "--iterations",
    type=click.IntRange(min=2, max=100_000),
    default=200,
    show_default=True,
    help="Paired noise draws: the plan and all-max each run every draw (interleaved, after a "
    "warm-up); the saving and slowdown come with their standard errors.",
)
@click.option(
    "--no-request-ahead",
    is_flag=True,
    help="Request every clock at the previous instruction's end. Default: as the plan's "
    "sessions do, a switch to a faster clock ahead by the lead the plan records "
    "(workload.request_ahead_s), if it records one.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Noise seed.")
@click.option(
    "--no-grid", is_flag=True, help="Do not print the plan as a stage x time grid before the table."
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def simulate(
    plan_path: str,
    profile_path: str | None,
    p_block_w: float,
    ideal: bool,
    switch_latency_s: float | None,
    noise_model: str | None,
    deadline_s: float | None,
    iterations: int,
    no_request_ahead: bool,
    seed: int,
    no_grid: bool,
    as_json: bool,
) -> None:
    """Replay a saved PLAN.json on the emulator and compare it with all maximum clocks.

    Prints the plan as a stage x time grid (what runs when, and at which clock), then the
    replayed iteration time and energy against all maximum clocks, and the saving and slowdown
    paired with all-max over --iterations noise draws (+- one standard error).
    """
    from powerlib.emulator.demo import simulate_plan  # noqa: PLC0415 - keep CLI start fast
    from powerlib.emulator.engine import IDEAL_MODEL, NVML_LIKE_MODEL  # noqa: PLC0415 - keep CLI start fast
    from powerlib.planning.plan import FrequencyPlan  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    plan = FrequencyPlan.read(plan_path)
    result = simulate_plan(
        plan,
        profile_path=profile_path,
        p_block_w=p_block_w,
        model=_with_noise_model(IDEAL_MODEL if ideal else NVML_LIKE_MODEL, noise_model),
        switch_latency_s=switch_latency_s,
        straggler_time_s=deadline_s,
        iterations=iterations,
        seed=seed,
        lead_s=None if no_request_ahead else _recorded_lead_s(plan),
    )
    if as_json:
        emit_json(result)
        return
    if not no_grid:
        click.echo(plan.grid())
    b, r = result["baseline"], result["plan_result"]
    click.echo(f"emulated on {result['model_description']}")
    versus_all_max(b, "plan", r)
    click.echo(
        f"energy saved: {result['saving_percent']:.3f} +- {result['saving_se_percent']:.3f} %  "
        f"(slowdown {result['slowdown_percent']:+.3f} +- {result['slowdown_se_percent']:.3f} %)  "
        f"paired with all-max over {result['iterations']} noise draws (+- 1 SE)"
    )


def _recorded_lead_s(plan: FrequencyPlan) -> float | None:
    """The request-ahead lead a session's plan records (``workload.request_ahead_s``), if any.

    Raises:
        PlanError: A recorded lead that is not a finite number >= 0.
    """
    from powerlib.errors import PlanError  # noqa: PLC0415 - keep CLI start fast

    value = plan.workload.get("request_ahead_s")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e3:
        raise PlanError(
            f"{plan.source}: workload.request_ahead_s must be a number of seconds >= 0, "
            f"not {str(value)[:40]!r}"
        )
    return float(value)
