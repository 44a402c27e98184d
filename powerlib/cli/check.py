"""``powerlib check``: is this node ready? (docs/real-gpu.md §8).

Parses the options, makes one call into :func:`powerlib.node_check.check.check_settings`
and prints the report (a block per device ending in its verdict, or ``--json``); exits with the
report's code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from powerlib.cli.options import Number, Options, emit_json, settings_for

if TYPE_CHECKING:
    from powerlib.node_check.report import DeviceCheck, NodeCheck

__all__ = ["check"]


@click.command()
@click.option(
    "--device", "selector", metavar="I", default=None, help="Device index or id (default: all)."
)
@click.option(
    "--duration-s",
    type=Number(min=0.0, min_open=True, max=60.0),
    default=1.0,
    show_default=True,
    help="How long each device's energy counter is read back to back.",
)
@click.option(
    "--load",
    is_flag=True,
    help="Also measure the clock-change landing latency under a short load (locks clocks "
    "through a journaled session and puts them back).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def check(
    ctx: click.Context, selector: str | None, duration_s: float, load: bool, as_json: bool
) -> None:
    """Check that this node is ready: permissions, MIG, locks, counter, latency; one verdict each.

    Exit code: 0 every device ready; else the first failing device's (4 no permission, 5 MIG or
    no clock control, 9 device lost; 3 when the backend is unavailable).
    """
    from powerlib.node_check.check import check_settings  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    opts: Options = ctx.obj
    report = check_settings(settings_for(opts), selector=selector, duration_s=duration_s, load=load)
    if as_json:
        emit_json(report.to_json())
    else:
        _print(report)
    ctx.exit(report.exit_code)


def _ms(value_s: float | None) -> str:
    return "n/a" if value_s is None else f"{value_s * 1e3:.2f} ms"


def _yes_no(value: bool | None, yes: str = "on", no: str = "off") -> str:
    return "unknown" if value is None else (yes if value else no)


def _print(report: NodeCheck) -> None:
    if not report.available:
        click.echo(f"backend          {report.backend}: {report.error}")
        click.echo(
            click.style(f"node: not ready: the {report.backend} backend cannot start", fg="red")
            + f" (exit {report.exit_code})"
        )
        return
    versions = ", ".join(f"{k} {v}" for k, v in report.versions.items() if v is not None)
    click.echo(f"backend          {report.backend} ({versions})")
    for dev in report.devices:
        click.echo("")
        _print_device(dev, load=report.load)
    click.echo("")
    ready = sum(d.ready for d in report.devices)
    summary = f"{ready} of {len(report.devices)} device(s) ready"
    if report.ready:
        click.echo(click.style(f"node: ready ({summary})", fg="green"))
    else:
        click.echo(click.style(f"node: not ready ({summary}; exit {report.exit_code})", fg="red"))


def _row(label: str, value: str, fg: str | None = None) -> None:
    padded = f"{label:<17}"
    click.echo(f"  {click.style(padded, fg=fg) if fg else padded} {value}")


def _print_device(dev: DeviceCheck, *, load: bool) -> None:
    click.echo(click.style(f"[{dev.index}] {dev.name}  {dev.device_id}", bold=True))
    if dev.permission is not None:
        _row(
            "permission",
            dev.permission + (f" ({dev.control_refusal})" if dev.control_refusal else ""),
        )
    _row("persistence mode", _yes_no(dev.persistence_mode))
    _row("MIG", _yes_no(dev.mig_enabled))
    _row("clock control", "yes" if dev.can_lock_sm_clocks else "no")
    _row("clock lock", _lock_text(dev))
    if dev.power_limit_w is not None:
        default = (
            ""
            if dev.default_power_limit_w is None
            else f" (default {dev.default_power_limit_w:g} W)"
        )
        _row("power limit", f"{dev.power_limit_w:g} W{default}")
    _print_newer_controls(dev)
    counter = dev.counter
    if counter is not None:
        if not counter.has_counter:
            period = "none (integrated from power)"
        elif counter.period_s is None:
            period = "period unknown"
        else:
            bound = {"at_most": "at most ", "at_least": "at least "}.get(
                counter.period_bound or "", ""
            )
            period = f"period {bound}{counter.period_s * 1e3:.1f} ms ({counter.changes} changes)"
        _row("energy counter", period)
        _row(
            "read cost",
            f"{_ms(counter.read_cost_median_s)} median, {_ms(counter.read_cost_p99_s)} p99 "
            f"({counter.reads} reads in {counter.duration_s:.2f} s)",
        )
    latency = dev.latency
    if latency is None:
        _row(
            "landing latency",
            "skipped: the check stopped earlier" if load else "not measured (--load)",
        )
    elif not latency.measured:
        _row("landing latency", f"not measured: {latency.reason}")
    else:
        missed = f", {latency.missed} missed" if latency.missed else ""
        _row(
            "landing latency",
            f"{_ms(latency.median_s)} median, {_ms(latency.max_s)} max "
            f"({len(latency.samples_s)} changes {latency.low_mhz:g}<->{latency.high_mhz:g} MHz"
            f"{missed}; load: {latency.load})",
        )
    if dev.power_scope is not None:
        _row("power scope", dev.power_scope)
    for warning in dev.warnings:
        _row("warning", warning, fg="yellow")
    colour = "green" if dev.ready else "red"
    code = "" if dev.ready else f" (exit {dev.exit_code})"
    _row("verdict", click.style(dev.verdict, fg=colour) + code)


def _print_newer_controls(dev: DeviceCheck) -> None:
    """Power smoothing, workload power profile, a foreign limit: rows only where present."""
    smoothing = dev.power_smoothing
    if smoothing is not None:
        text = "on" if smoothing.get("enabled") else "off"
        floor_w = smoothing.get("floor_w")
        if smoothing.get("enabled") and isinstance(floor_w, float):
            text += f", floor {floor_w:g} W"
        if "preset_profile" in smoothing:
            text += f" (preset profile {smoothing['preset_profile']})"
        _row("power smoothing", text)
    if dev.workload_power_profiles is not None:
        _row("power profile", ", ".join(dev.workload_power_profiles) or "none in force")
    foreign = dev.foreign_power_limit
    if foreign is not None:
        _row(
            "foreign limit",
            f"{foreign['limit_w']:g} W (default {foreign['default_w']:g} W), set {foreign['set_by']}",
            fg="yellow",
        )


def _lock_text(dev: DeviceCheck) -> str:
    lock = dev.lock
    if lock is None or lock.locked is None:
        return "unknown (the driver does not say)"
    if not lock.locked:
        return "none"
    if lock.range_mhz is None:
        return "in force (range not reported by the driver)"
    return "in force, {:g}-{:g} MHz".format(*lock.range_mhz)
