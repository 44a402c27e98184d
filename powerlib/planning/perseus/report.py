"""Frontier outputs: the CSV, the summary, and the plot (matplotlib, extra ``plot``)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING, Any

from powerlib.errors import BackendUnavailableError
from powerlib.planning.perseus.frontier import Frontier
from powerlib.planning.perseus.points import FrontierPoint

if TYPE_CHECKING:
    from powerlib.planning.choice import Choice

__all__ = [
    "FRONTIER_COLUMNS",
    "plot_frontier",
    "pyplot",
    "summary",
    "write_frontier_csv",
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


def summary(choice: Choice, *, solve_time_s: float) -> dict[str, Any]:
    """What ``powerlib plan --json`` prints (and a session's ``summary.json`` holds).

    The realized figures and the slowdown guard's effect come from the choice's options.
    """
    frontier, chosen, policy = choice.frontier, choice.point, choice.policy
    baseline = frontier.baseline(chosen.time_s)
    realized = choice.realized
    own = frontier.baseline()
    t_star = frontier.min_energy if frontier.has_t_star else None
    first = frontier.points[0]
    return {
        "schema": "powerlib.plan-summary.v1",
        "solver": "walk" if frontier.complete else "direct",
        "complete_frontier": frontier.complete,
        "num_points": len(frontier.points),
        "t_min_s": frontier.fastest.time_s,
        "t_max_s": first.time_s
        + frontier.settings.unit_time_s,  # the all-slowest start, which is not a point
        "t_star_s": None if t_star is None else t_star.time_s,
        "t_star_energy_j": None if t_star is None else t_star.energy_j,
        "chosen": {
            "policy": policy.name,
            "iteration": chosen.iteration,
            "time_s": chosen.time_s,
            "energy_j": chosen.energy_j,
            "realized_time_s": realized.time_s,
            "realized_energy_j": realized.energy_j,
        },
        "baseline": {
            "description": (
                "every instruction at its maximum frequency, blocking power up to the chosen time"
                if frontier.reference_times is None
                else "Megatron-LM: sequential execution at the maximum clock, blocking power up "
                "to the chosen time (or its own, if slower)"
            ),
            "own_time_s": frontier.baseline_time_s,
            "time_s": baseline.time_s,
            "energy_j": baseline.energy_j,
        },
        "saving_percent": _saving_percent(chosen.energy_j, baseline.energy_j),
        "realized": {
            "description": "the plan replayed on the measured profile, against all max frequency at its own time",
            "slowdown_percent": 100.0 * (realized.time_s / own.time_s - 1.0),
            "saving_percent": _saving_percent(
                realized.energy_j, frontier.baseline(realized.time_s).energy_j
            ),
            "saving_per_iteration_percent": _per_iteration_saving(choice),
            "max_slowdown_guard": policy.max_slowdown if choice.guarded else None,
            "switch_latency_s": policy.switch_latency_s,
            "instructions_sped_up": choice.instructions_sped_up if choice.guarded else None,
        },
        "solve_time_s": solve_time_s,
    }


def _per_iteration_saving(choice: Choice) -> float | None:
    """What a job saves per iteration: the plan against all-max iterations as they really run.

    ``saving_percent`` compares at the plan's own time (all-max plus blocking power up to it,
    the Perseus convention); a job compares iterations. All-max iterations last T_min, or the
    straggler's T′ under ``deadline`` (the iteration is held until then either way), and so does
    a faster plan. For ``min-energy`` (slower than T_min) the two figures differ by the
    blocking energy of the extra time.
    """
    frontier, policy, realized = choice.frontier, choice.policy, choice.realized
    reference_s = frontier.baseline_time_s
    if policy.name == "deadline" and policy.deadline_s is not None:
        reference_s = max(reference_s, policy.deadline_s)
    base = frontier.baseline(reference_s).energy_j
    energy = realized.energy_j
    if realized.time_s < reference_s:  # held until the reference: blocking power meanwhile
        stages = frontier.dag.num_stages
        energy += frontier.settings.p_block_w * stages * (reference_s - realized.time_s)
    return _saving_percent(energy, base)


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
