"""``powerlib measure -- CMD ARGS``: the energy of an unmodified command, per device.

Parses the options, runs :func:`powerlib.measure_api.command.run_command` (the child process,
signal forwarding, the steps the child reports; docs/measurement.md §6) and formats its result:
a table on stderr, or ``--json`` on stdout, ``--out`` and ``--plot`` files. With ``--json`` the
child's stdout goes to stderr, so that ``> file`` holds one JSON document. powerlib exits with
the child's status (128 + N when signal N killed it).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from powerlib.cli.format import fmt
from powerlib.cli.options import Number, Options, OutputPath, open_backend_for
from powerlib.errors import InvalidArgumentError

__all__ = ["measure"]


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option(
    "--device",
    "selectors",
    metavar="I",
    multiple=True,
    help="Device index or id to measure (repeatable; default: every device).",
)
@click.option(
    "--sample-period-s",
    type=Number(min=0.001, max=10.0),
    default=0.01,
    show_default=True,
    help="How often the devices are read.",
)
@click.option(
    "--jsonl",
    "jsonl_path",
    type=OutputPath(),
    default=None,
    help="While the command runs, append one JSON line per device every --jsonl-interval-s.",
)
@click.option(
    "--jsonl-interval-s",
    type=Number(min=0.05, max=3600.0),
    default=1.0,
    show_default=True,
    help="Seconds between --jsonl lines.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the result as JSON when it ends: stdout holds that one document, and the "
    "command's own stdout goes to stderr.",
)
@click.option(
    "--out", "out_path", type=OutputPath(), default=None, help="Also write the JSON here."
)
@click.option(
    "--plot",
    "plot_path",
    type=OutputPath(),
    default=None,
    help="Draw power per device over time, steps marked (PNG/SVG/PDF; needs matplotlib).",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def measure(
    opts: Options,
    selectors: tuple[str, ...],
    sample_period_s: float,
    jsonl_path: str | None,
    jsonl_interval_s: float,
    as_json: bool,
    out_path: str | None,
    plot_path: str | None,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND unmodified and report the energy each device used while it ran.

    \b
    powerlib measure -- python train.py --epochs 1
    powerlib measure --json --plot power.png -- torchrun --nproc-per-node 8 train.py
    """  # noqa: D301 - "\b" is click's keep-these-lines marker (a backspace), not "\\b"
    from powerlib.measure_api.command import run_command  # noqa: PLC0415 - a command loads only what it runs (fast --help)
    from powerlib.measure_api.result import finite_json  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise InvalidArgumentError("no command to run: powerlib measure -- CMD ARGS")
    if plot_path is not None:
        from powerlib.planning.perseus.report import pyplot  # noqa: PLC0415 - a command loads only what it runs (fast --help)

        pyplot()  # matplotlib missing: say so before the job runs, not after
    backend = open_backend_for(opts)
    try:
        devices = [backend.device(s) for s in selectors] or None
        run = run_command(
            argv,
            devices,
            backend=backend,
            sample_period_s=sample_period_s,
            jsonl=jsonl_path,
            jsonl_interval_s=jsonl_interval_s,
            warn=_warn,
            stdout=2 if as_json else None,  # fd 2: stdout is the JSON document's alone
        )
    finally:
        backend.close()
    doc = run.to_json()
    if out_path is not None:
        Path(out_path).write_text(finite_json(doc, indent=2) + "\n", encoding="utf-8")
    if plot_path is not None:
        from powerlib.measure_api.plot import plot_power  # noqa: PLC0415 - a command loads only what it runs (fast --help)

        plot_power(run.power_series, run.result, plot_path, title=" ".join(argv))
    if as_json:
        click.echo(finite_json(doc))
    else:
        _table(doc)
    if run.exit_code:
        sys.exit(run.exit_code)


def _warn(message: str) -> None:
    click.echo(f"powerlib: warning: {message}", err=True)


def _table(doc: dict[str, Any]) -> None:
    rows = [
        (
            str(d["index"]),
            d["name"],
            fmt(d["energy_j"], 1),
            fmt(d["time_s"], 2),
            fmt(d["average_power_w"], 1),
            d["source"] + (" (estimated)" if d["estimated"] else ""),
        )
        for d in doc["devices"]
    ]
    rows.append(
        (
            "",
            "total",
            fmt(doc["energy_j"], 1),
            fmt(doc["time_s"], 2),
            fmt(doc["average_power_w"], 1),
            "estimated" if doc["estimated"] else "",
        )
    )
    header = ("IDX", "DEVICE", "ENERGY J", "TIME S", "AVG W", "SOURCE")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {2, 3, 4}

    def line(r: tuple[str, ...]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        )

    click.echo(click.style(line(header), bold=True), err=True)
    for r in rows:
        click.echo(line(r), err=True)
    if doc["steps"]:
        per_token = doc["energy_per_token_j"]
        click.echo(
            f"{doc['steps']} steps: {fmt(doc['energy_per_step_j'], 2)} J/step"
            + ("" if per_token is None else f", {per_token:.4g} J/token"),
            err=True,
        )
    click.echo(f"exit status {doc['exit_status']}", err=True)
