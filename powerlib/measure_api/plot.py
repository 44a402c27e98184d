"""Power per device over time, with a measurement's steps and windows marked.

What ``powerlib measure --plot FILE`` draws (docs/measuring.md,
``docs/images/measure_power.png``), from :meth:`Measurement.power_series
<powerlib.measure_api.measure.Measurement.power_series>` and its result. matplotlib is the
optional ``plot`` extra, imported only when a plot is drawn.
"""

from __future__ import annotations

import os

from powerlib.measure_api.result import MeasurementResult

__all__ = ["plot_power"]


def plot_power(
    series: dict[str, tuple[list[float], list[float | None]]],
    result: MeasurementResult,
    path: str | os.PathLike[str],
    *,
    title: str = "",
) -> None:
    """Power per device over time, with the steps shaded (alternating) and windows outlined.

    Args:
        series: Per device id: times (s after the start) and power (W), as
            :meth:`~powerlib.measure_api.measure.Measurement.power_series` returns them.
        result: The measurement's result: device names, steps, windows and totals.
        path: The image to write; its suffix picks the format (PNG, SVG, PDF).
        title: A first title line (cut at 70 characters); the second gives the totals.

    Raises:
        BackendUnavailableError: matplotlib is not installed (``pip install 'powerlib[plot]'``).
    """
    # The one matplotlib loader (Agg backend, the error naming the extra) is the planner
    # report's; imported here, when a plot is drawn, so that measuring never loads planning.
    from powerlib.planning.perseus.report import pyplot  # noqa: PLC0415 - only when a plot is drawn

    plt = pyplot()
    names = {d.device_id: f"{d.index}: {d.name}" for d in result.devices}
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=120)
    for dev_id, (times, power) in series.items():
        pts = [(t, p) for t, p in zip(times, power) if p is not None]
        if pts:
            ax.plot(
                [t for t, _ in pts], [p for _, p in pts], lw=1.0, label=names.get(dev_id, dev_id)
            )
    for w in result.steps:
        if w.rank == min((s.rank for s in result.steps), default=0):
            ax.axvspan(
                w.start_s,
                w.start_s + w.time_s,
                color="0.85" if w.index % 2 else "0.93",
                lw=0,
                zorder=0,
            )
    for w in result.windows:
        if w.kind == "window":
            ax.axvline(w.start_s, color="0.4", ls="--", lw=0.8)
            ax.text(
                w.start_s,
                1.0,
                f" {w.name}",
                transform=ax.get_xaxis_transform(),
                va="top",
                fontsize=8,
            )
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("power (W)")
    subtitle = f"{result.energy_j:.0f} J in {result.time_s:.1f} s"
    if result.num_steps:
        subtitle += f", {result.num_steps} steps (shaded), {result.energy_per_step_j:.1f} J/step"
    ax.set_title((title[:70] + "\n" if title else "") + subtitle, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
