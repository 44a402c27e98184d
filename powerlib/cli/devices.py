"""Device commands: ``env``, ``devices``, ``status``, ``watch``, ``set`` and ``reset``.

Each parses its options, makes one call into :mod:`powerlib.inspection` or :mod:`powerlib.control.manual`
and prints the result (a table, or ``--json``).
"""

from __future__ import annotations

import json
import os
import platform
import time

import click

from powerlib._version import __version__
from powerlib.cli.format import CAPABILITY_LABELS, fmt, freq_summary, table
from powerlib.cli.options import Number, Options, emit_json, open_backend_for, settings_for
from powerlib.control import reset_devices, set_device
from powerlib.device import Device, PowerState
from powerlib.inspection import (
    SCHEMA_VERSION,
    env_report,
    select_devices,
    state_json,
    status_json,
    watch_samples,
)
from powerlib.node_check.check import foreign_power_limit
from powerlib.registry import AUTO_ORDER

__all__ = ["devices", "env", "reset", "set_", "status", "watch"]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def env(opts: Options, as_json: bool) -> None:
    """Show the backend that would be chosen, and why, probe by probe."""
    settings = settings_for(opts)
    report = env_report(settings)
    probes, chosen, why, versions = (
        report.probes,
        report.chosen_backend,
        report.reason,
        report.package_versions,
    )
    data = report.to_json()
    if as_json:
        emit_json(data)
        return
    click.echo(f"powerlib {__version__} (Python {platform.python_version()})")
    click.echo(f"requested backend: {settings.backend}")
    click.echo(f"chosen backend:    {chosen or 'none'} ({why})")
    click.echo("")
    table(
        ["BACKEND", "AUTO", "AVAILABLE", "REASON"],
        [
            [
                p.backend,
                "yes" if p.backend in AUTO_ORDER else "no",
                "yes" if p.is_available else "no",
                p.reason,
            ]
            for p in probes
        ],
        colour=lambda col, cell: {"yes": "green", "no": "red"}[cell] if col == 2 else None,
    )
    click.echo("")
    click.echo(
        f"sysfs root: {settings.sysfs_root}   state dir: {settings.state_dir}   euid: {os.geteuid()}"
    )
    installed = ", ".join(f"{k} {v}" for k, v in versions.items() if v) or "none"
    click.echo(f"packages: {installed}")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def devices(opts: Options, as_json: bool) -> None:
    """List devices: one row each, with power, limit, clock, energy and temperature."""
    with open_backend_for(opts) as backend:
        rows = [(dev, dev.read_state()) for dev in backend.devices()]
        if as_json:
            emit_json(
                {
                    "schema": f"powerlib.devices.v{SCHEMA_VERSION}",
                    "backend": backend.name,
                    "devices": [state_json(dev, st) for dev, st in rows],
                }
            )
            return
        table(
            ["IDX", "ID", "NAME", "BACKEND", "POWER W", "LIMIT W", "SM MHz", "ENERGY J", "TEMP C"],
            [
                [
                    str(dev.index),
                    dev.device_id,
                    dev.info.name,
                    dev.info.backend,
                    fmt(st.power_w),
                    fmt(st.power_limit_w),
                    fmt(st.sm_freq_mhz, 0),
                    fmt(st.energy_j, 3),
                    fmt(st.temperature_c),
                ]
                for dev, st in rows
            ],
        )


@click.command()
@click.option(
    "--device", "selector", metavar="I", default=None, help="Device index or id (default: all)."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def status(opts: Options, selector: str | None, as_json: bool) -> None:
    """Show full detail: identity, power state, supported clocks, limits, capabilities."""
    with open_backend_for(opts) as backend:
        found = [(dev, dev.read_state()) for dev in select_devices(backend, selector)]
        details = [dict(dev.details()) for dev, _ in found]  # read once: each asks the driver
        # a limit an administrator, a facility tool or the BMC set (docs/real-gpu.md §8)
        foreign = [
            foreign_power_limit(backend, dev, st.power_limit_w, more)
            for (dev, st), more in zip(found, details)
        ]
        if as_json:
            emit_json(
                {
                    "schema": f"powerlib.status.v{SCHEMA_VERSION}",
                    "backend": backend.name,
                    "devices": [
                        status_json(dev, st, more)
                        | ({} if other is None else {"foreign_power_limit": other})
                        for (dev, st), more, other in zip(found, details, foreign)
                    ],
                }
            )
            return
        for n, (dev, st) in enumerate(found):
            info = dev.info
            if n:
                click.echo("")
            click.echo(click.style(f"[{info.index}] {info.name}", bold=True))
            lines = _status_lines(dev, st, details[n], foreign[n])
            width = max(len(k) for k, _ in lines)
            for key, value in lines:
                click.echo(f"  {key.ljust(width)}  {value}")
            caps = set(info.capabilities.names())
            click.echo("  capabilities:")
            for name, label in CAPABILITY_LABELS:
                click.echo(f"    {label}: {'yes' if name in caps else 'no'}")


def _status_lines(
    dev: Device,
    st: PowerState,
    details: dict[str, object],
    foreign: dict[str, object] | None,
) -> list[tuple[str, str]]:
    """``powerlib status``'s ``(key, value)`` lines for one device (its title aside)."""
    info = dev.info
    lock = (
        "not locked"
        if st.locked_sm_freqs_mhz is None
        else ("locked to {:g}-{:g} MHz".format(*st.locked_sm_freqs_mhz))
    )
    limits = info.power_limit_range_w
    lines = [
        ("id", info.device_id),
        (
            "vendor / kind",
            f"{info.vendor} / {info.kind.value}" + (" (simulated)" if info.is_simulated else ""),
        ),
        ("backend", info.backend),
        ("power", fmt(st.power_w, unit="W")),
        (
            "energy counter",
            fmt(st.energy_j, 3, "J")
            + (
                "" if st.memory_energy_j is None else f" (memory {fmt(st.memory_energy_j, 3, 'J')})"
            ),
        ),
        ("SM clock", f"{fmt(st.sm_freq_mhz, 0, 'MHz')} ({lock})"),
        ("supported SM clocks", freq_summary(info.supported_sm_freqs_mhz)),
        (
            "power limit",
            fmt(st.power_limit_w, unit="W")
            + ("" if limits is None else f" (range {limits[0]:g}-{limits[1]:g} W")
            + (
                ""
                if limits is None
                else (
                    f", default {info.default_power_limit_w:g} W)"
                    if info.default_power_limit_w
                    else ")"
                )
            ),
        ),
        ("temperature", fmt(st.temperature_c, unit="C")),
    ]
    if foreign is not None:
        lines.append(
            (
                "foreign limit",
                f"{foreign['limit_w']:g} W (default {foreign['default_w']:g} W), set "
                f"{foreign['set_by']}",
            )
        )
    lines += [
        (key, json.dumps(value) if not isinstance(value, str) else value)
        for key, value in details.items()
    ]
    return lines


@click.command()
@click.option(
    "--interval-s",
    type=Number(min=0.01, max=86400.0),
    default=1.0,
    show_default=True,
    help="Seconds between samples.",
)
@click.option(
    "--count",
    type=click.IntRange(min=1),
    default=None,
    help="Stop after N samples (default: until Ctrl-C).",
)
@click.option(
    "--device", "selector", metavar="I", default=None, help="Device index or id (default: all)."
)
@click.option(
    "--json", "as_json", is_flag=True, help="One JSON object per sample per device (JSON lines)."
)
@click.pass_obj
def watch(
    opts: Options, interval_s: float, count: int | None, selector: str | None, as_json: bool
) -> None:
    """Sample power states periodically; AVG W is the energy-counter delta over the interval.

    Runs until Ctrl-C (or --count samples); Ctrl-C ends it quietly, exit status 0.
    """
    try:
        _watch(opts, interval_s, count, selector, as_json)
    except KeyboardInterrupt:  # the documented way to stop it: no error, no status 130
        return


def _watch(
    opts: Options, interval_s: float, count: int | None, selector: str | None, as_json: bool
) -> None:
    with open_backend_for(opts) as backend:
        chosen = select_devices(backend, selector)
        if not as_json:
            click.echo(
                click.style(
                    "  ".join(
                        [
                            "TIME".ljust(8),
                            "IDX",
                            "POWER W".rjust(8),
                            "AVG W".rjust(8),
                            "SM MHz".rjust(7),
                            "LIMIT W".rjust(8),
                            "ENERGY J".rjust(14),
                            "TEMP C".rjust(6),
                        ]
                    ),
                    bold=True,
                )
            )
        for sample in watch_samples(chosen, interval_s, count):
            dev, st, avg_w = sample.device, sample.state, sample.avg_power_w
            if as_json:
                click.echo(json.dumps(sample.to_json()))
            else:
                click.echo(
                    "  ".join(
                        [
                            time.strftime("%H:%M:%S", time.localtime(st.timestamp_s))
                            if st.timestamp_s > 1e9
                            else f"{st.timestamp_s:8.2f}",
                            str(dev.index).rjust(3),
                            fmt(st.power_w).rjust(8),
                            fmt(avg_w).rjust(8),
                            fmt(st.sm_freq_mhz, 0).rjust(7),
                            fmt(st.power_limit_w).rjust(8),
                            fmt(st.energy_j, 3).rjust(14),
                            fmt(st.temperature_c).rjust(6),
                        ]
                    )
                )


@click.command(name="set")
@click.option("--device", "selector", metavar="I", required=True, help="Device index or id.")
@click.option("--freq-mhz", type=Number(), default=None, help="Lock the SM clock to one value.")
@click.option(
    "--freq-range-mhz",
    type=(float, float),
    default=None,
    metavar="LO HI",
    help="Lock the SM clock to a range.",
)
@click.option("--power-limit-w", type=Number(), default=None, help="Set the power limit.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def set_(
    opts: Options,
    selector: str,
    freq_mhz: float | None,
    freq_range_mhz: tuple[float, float] | None,
    power_limit_w: float | None,
    as_json: bool,
) -> None:
    """Lock SM clocks and/or set the power limit. Everything is validated before anything changes.

    Settings stay until `powerlib reset` (or a reboot/driver reload on real GPUs).
    """
    if freq_mhz is not None and freq_range_mhz is not None:
        raise click.UsageError("give --freq-mhz or --freq-range-mhz, not both")
    if freq_mhz is None and freq_range_mhz is None and power_limit_w is None:
        raise click.UsageError(
            "nothing to set: give --freq-mhz, --freq-range-mhz or --power-limit-w"
        )
    lo_hi = (freq_mhz, freq_mhz) if freq_mhz is not None else freq_range_mhz
    with open_backend_for(opts) as backend:
        result = set_device(backend, selector, sm_clocks_mhz=lo_hi, power_limit_w=power_limit_w)
        dev, st, applied = result.device, result.state, result.applied
        if as_json:
            emit_json(
                {
                    "schema": f"powerlib.set.v{SCHEMA_VERSION}",
                    "applied": applied,
                    "device": state_json(dev, st),
                }
            )
            return
        if result.locked_sm_freqs_mhz is not None:
            lo, hi = result.locked_sm_freqs_mhz
            click.echo(
                f"device {dev.index} ({dev.device_id}): SM clock locked to "
                + (f"{lo:g} MHz" if lo == hi else f"{lo:g}-{hi:g} MHz")
            )
        if result.power_limit_w is not None:
            click.echo(
                f"device {dev.index} ({dev.device_id}): power limit set to {result.power_limit_w:g} W"
            )


@click.command()
@click.option("--device", "selector", metavar="I", default=None, help="Device index or id.")
@click.option("--all", "all_devices", is_flag=True, help="Reset every device.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def reset(opts: Options, selector: str | None, all_devices: bool, as_json: bool) -> None:
    """Unlock SM clocks and restore the default power limit.

    Operations a device does not support are skipped and reported; other failures are reported
    too, the remaining devices are still reset, and the exit status is non-zero.
    """
    if (selector is None) == (not all_devices):
        raise click.UsageError("give --device I or --all")
    with open_backend_for(opts) as backend:
        done = reset_devices(backend, selector)
        results = [o.to_json() for o in done.outcomes]
        first_error = done.error
        if as_json:
            emit_json(
                {
                    "schema": f"powerlib.reset.v{SCHEMA_VERSION}",
                    "results": results,
                    "ok": first_error is None,
                }
            )
        else:
            for r in results:
                click.echo(
                    f"device {r['index']} ({r['device_id']}): SM clocks {r['sm_clocks']}, "
                    f"power limit {r['power_limit']}"
                )
        if first_error is not None:
            raise first_error
