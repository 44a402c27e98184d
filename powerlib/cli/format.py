"""How the commands print: aligned tables and readings that may be absent."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import click

__all__ = ["CAPABILITY_LABELS", "fmt", "freq_summary", "pct", "table", "versus_all_max"]

#: Capability flags as ``powerlib status`` names them.
CAPABILITY_LABELS = (
    ("can_lock_sm_clocks", "SM clock lock"),
    ("can_lock_memory_clocks", "memory clock lock"),
    ("can_set_power_limit", "power limit control"),
    ("can_reset_power_limit", "power limit reset"),
    ("has_energy_counter", "energy counter"),
    ("has_power_reading", "power reading"),
    ("has_temperature", "temperature"),
)


def pct(value: float | None) -> str:
    """A percentage, or "n/a" when it could not be computed."""
    return "n/a" if value is None else f"{value:.2f} %"


def fmt(value: float | None, digits: int = 1, unit: str = "") -> str:
    """Format a reading for a table; absent values read "n/a" (never a fake number or unit)."""
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" + (f" {unit}" if unit else "")


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    colour: Callable[[int, str], str | None] | None = None,
) -> None:
    """Print aligned columns.

    ``colour(column, cell)`` names a colour applied after padding; click drops colours when
    stdout is not a terminal.
    """
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    click.echo(
        click.style("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(), bold=True)
    )
    for row in rows:
        cells = []
        for i, (cell, width) in enumerate(zip(row, widths)):
            padded = cell.ljust(width) if i < len(row) - 1 else cell
            fg = colour(i, cell) if colour else None
            cells.append(click.style(padded, fg=fg) if fg else padded)
        click.echo("  ".join(cells))


def freq_summary(freqs: Sequence[float]) -> str:
    """Supported clocks in one phrase: range, count and step."""
    if not freqs:
        return "none (clocks cannot be locked)"
    steps = {round(b - a, 3) for a, b in zip(freqs, freqs[1:])}
    step = f", step {steps.pop():g} MHz" if len(steps) == 1 else ""
    return f"{freqs[0]:g}-{freqs[-1]:g} MHz, {len(freqs)} values{step}"


def versus_all_max(base: dict[str, Any], label: str, run: dict[str, Any]) -> None:
    """The all-max-clock vs plan table of `demo` and `simulate`."""
    table(
        ["", "iteration time", "energy / iteration"],
        [
            ["all max clock", f"{base['time_s']:.4f} s", f"{base['energy_j']:.1f} J"],
            [label, f"{run['time_s']:.4f} s", f"{run['energy_j']:.1f} J"],
        ],
    )
