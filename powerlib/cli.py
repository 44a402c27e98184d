"""The ``powerlib`` command line: inspect and control device power states.

Every command takes ``--json`` (stable schemas, units in key names; see the README) and prints a
table otherwise. Known failures exit non-zero with one line on stderr and no traceback; ``-v``
shows the traceback and INFO logs (``-vv``: DEBUG).

Exit codes: 0 success; 1 other powerlib error (e.g. a device still modified after a restore);
2 usage error; 3 backend unavailable; 4 permission denied; 5 not supported; 6 device not found;
7 invalid argument, setting, profile or plan; 8 device busy; 9 device lost; 10 driver/vendor
error; 11 unreadable journal; 12 untrusted state folder or journal refused; 130 interrupted.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from importlib import metadata
from typing import Any, NoReturn

import click

from powerlib import __version__
from powerlib.cli_options import Number, OutputPath, plan_outputs, progress_bar, select_and_write
from powerlib.cli_options import emit_json as _emit_json
from powerlib.cli_overlap import overlap as _overlap_group
from powerlib.config import Settings
from powerlib.control import (
    RestoreOutcome,
    ensure_not_controlled,
    restore_failure,
    restore_journals,
)
from powerlib.device import Backend, Device, PowerState
from powerlib.errors import PowerlibError
from powerlib.registry import (
    AUTO_ORDER,
    backend_names,
    check_backend_name,
    open_backend,
    probe_backends,
)

__all__ = ["cli", "main"]

SCHEMA_VERSION = 1


@dataclass(slots=True)
class _Options:
    """Global options shared by every command."""

    backend: str | None = None
    verbose: int = 0


class _CliError(click.ClickException):
    """A PowerlibError on its way out: one line, the error's own exit code."""

    def __init__(self, err: PowerlibError) -> None:
        super().__init__(str(err))
        self.exit_code = err.exit_code

    def show(self, file: Any = None) -> None:
        click.echo(f"powerlib: error: {self.format_message()}", err=True)


class _Group(click.Group):
    """Turns PowerlibError into a one-line message and its exit code; Ctrl-C exits 130."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PowerlibError as err:
            opts = ctx.find_object(_Options)
            if opts is not None and opts.verbose:
                traceback.print_exc()
            raise _CliError(err) from err
        except KeyboardInterrupt as err:  # SIGINT: 128 + 2, as a shell reports it
            opts = ctx.find_object(_Options)
            if opts is not None and opts.verbose:
                traceback.print_exc()
            interrupted = PowerlibError("interrupted (SIGINT)")
            interrupted.exit_code = 130
            raise _CliError(interrupted) from err


def _settings(opts: _Options) -> Settings:
    settings = Settings.from_env()
    return settings.replace(backend=opts.backend) if opts.backend else settings


def _open(opts: _Options) -> Backend:
    return open_backend(settings=_settings(opts))


def _pct(value: float | None) -> str:
    """A percentage, or "n/a" when it could not be computed."""
    return "n/a" if value is None else f"{value:.2f} %"


def _fmt(value: float | None, digits: int = 1, unit: str = "") -> str:
    """Format a reading for a table; absent values read "n/a" (never a fake number or unit)."""
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" + (f" {unit}" if unit else "")


def _table(
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


def _state_json(dev: Device, state: PowerState) -> dict[str, object]:
    info = dev.info
    return {
        "index": info.index,
        "device_id": info.device_id,
        "name": info.name,
        "vendor": info.vendor,
        "kind": info.kind.value,
        "backend": info.backend,
        "is_simulated": info.is_simulated,
        "timestamp_s": state.timestamp_s,
        "power_w": state.power_w,
        "energy_j": state.energy_j,
        "memory_energy_j": state.memory_energy_j,
        "sm_freq_mhz": state.sm_freq_mhz,
        "locked_sm_freqs_mhz": None
        if state.locked_sm_freqs_mhz is None
        else list(state.locked_sm_freqs_mhz),
        "power_limit_w": state.power_limit_w,
        "temperature_c": state.temperature_c,
    }


def _status_json(dev: Device, state: PowerState) -> dict[str, object]:
    info = dev.info
    data = _state_json(dev, state)
    data.update(
        {
            "supported_sm_freqs_mhz": list(info.supported_sm_freqs_mhz),
            "min_sm_freq_mhz": info.min_sm_freq_mhz,
            "max_sm_freq_mhz": info.max_sm_freq_mhz,
            "power_limit_range_w": None
            if info.power_limit_range_w is None
            else list(info.power_limit_range_w),
            "default_power_limit_w": info.default_power_limit_w,
            "capabilities": {
                f.name: getattr(info.capabilities, f.name) for f in fields(info.capabilities)
            },
            "details": dict(dev.details()),
        }
    )
    return data


_CAPABILITY_LABELS = (
    ("can_lock_sm_clocks", "SM clock lock"),
    ("can_lock_memory_clocks", "memory clock lock"),
    ("can_set_power_limit", "power limit control"),
    ("can_reset_power_limit", "power limit reset"),
    ("has_energy_counter", "energy counter"),
    ("has_power_reading", "power reading"),
    ("has_temperature", "temperature"),
)


def _select(backend: Backend, selector: str | None) -> list[Device]:
    return list(backend.devices()) if selector is None else [backend.device(selector)]


def _freq_summary(freqs: Sequence[float]) -> str:
    if not freqs:
        return "none (clocks cannot be locked)"
    steps = {round(b - a, 3) for a, b in zip(freqs, freqs[1:])}
    step = f", step {steps.pop():g} MHz" if len(steps) == 1 else ""
    return f"{freqs[0]:g}-{freqs[-1]:g} MHz, {len(freqs)} values{step}"


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="powerlib")
@click.option(
    "--backend",
    metavar="NAME",
    default=None,
    help="Backend to use (overrides POWERLIB_BACKEND): auto, nvidia, amd, sysfs, simulated, or a plug-in.",
)
@click.option("-v", "--verbose", count=True, help="Show tracebacks and INFO logs (-vv: DEBUG).")
@click.pass_context
def cli(ctx: click.Context, backend: str | None, verbose: int) -> None:
    """Inspect and control GPU/CPU power states; plan energy-saving clock schedules."""
    ctx.obj = _Options(backend=backend, verbose=verbose)
    if verbose:
        logging.basicConfig(
            level=logging.DEBUG if verbose > 1 else logging.INFO,
            format="%(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
    # Every command, `env` and the planning ones included, refuses a bad setting up front:
    # an unknown POWERLIB_BACKEND is a mistake a user must hear about, not a value to print.
    check_backend_name(_settings(ctx.obj).backend)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def env(opts: _Options, as_json: bool) -> None:
    """Show the backend that would be chosen, and why, probe by probe."""
    settings = _settings(opts)
    names = list(dict.fromkeys([*AUTO_ORDER, *backend_names()]))
    probes = probe_backends(settings, names)
    if settings.backend == "auto":
        chosen = next(
            (p.backend for p in probes if p.is_available and p.backend in AUTO_ORDER), None
        )
        why = (
            "first available in the auto order " + " -> ".join(AUTO_ORDER)
            if chosen
            else (
                "nothing in the auto order is available; set POWERLIB_BACKEND=simulated for simulated GPUs"
            )
        )
    else:
        chosen = settings.backend
        why = "named explicitly (--backend or POWERLIB_BACKEND)"
    versions = {}
    for dist in ("click", "numpy", "psutil", "nvidia-ml-py", "pynvml", "amdsmi", "torch"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    data = {
        "schema": f"powerlib.env.v{SCHEMA_VERSION}",
        "powerlib_version": __version__,
        "python_version": platform.python_version(),
        "requested_backend": settings.backend,
        "chosen_backend": chosen,
        "reason": why,
        "probes": [
            {
                "backend": p.backend,
                "is_available": p.is_available,
                "in_auto_order": p.backend in AUTO_ORDER,
                "num_devices": p.num_devices,
                "reason": p.reason,
            }
            for p in probes
        ],
        "settings": {
            "sysfs_root": str(settings.sysfs_root),
            "state_dir": str(settings.state_dir),
            "sim_gpus": settings.sim_gpus,
            "sim_model": settings.sim_model,
            "sim_clock": settings.sim_clock,
        },
        "euid": os.geteuid(),
        "package_versions": versions,
    }
    if as_json:
        _emit_json(data)
        return
    click.echo(f"powerlib {__version__} (Python {platform.python_version()})")
    click.echo(f"requested backend: {settings.backend}")
    click.echo(f"chosen backend:    {chosen or 'none'} ({why})")
    click.echo("")
    _table(
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


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def devices(opts: _Options, as_json: bool) -> None:
    """List devices: one row each, with power, limit, clock, energy and temperature."""
    with _open(opts) as backend:
        rows = [(dev, dev.read_state()) for dev in backend.devices()]
        if as_json:
            _emit_json(
                {
                    "schema": f"powerlib.devices.v{SCHEMA_VERSION}",
                    "backend": backend.name,
                    "devices": [_state_json(dev, st) for dev, st in rows],
                }
            )
            return
        _table(
            ["IDX", "ID", "NAME", "BACKEND", "POWER W", "LIMIT W", "SM MHz", "ENERGY J", "TEMP C"],
            [
                [
                    str(dev.index),
                    dev.device_id,
                    dev.info.name,
                    dev.info.backend,
                    _fmt(st.power_w),
                    _fmt(st.power_limit_w),
                    _fmt(st.sm_freq_mhz, 0),
                    _fmt(st.energy_j, 3),
                    _fmt(st.temperature_c),
                ]
                for dev, st in rows
            ],
        )


@cli.command()
@click.option(
    "--device", "selector", metavar="I", default=None, help="Device index or id (default: all)."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def status(opts: _Options, selector: str | None, as_json: bool) -> None:
    """Show full detail: identity, power state, supported clocks, limits, capabilities."""
    with _open(opts) as backend:
        found = [(dev, dev.read_state()) for dev in _select(backend, selector)]
        if as_json:
            _emit_json(
                {
                    "schema": f"powerlib.status.v{SCHEMA_VERSION}",
                    "backend": backend.name,
                    "devices": [_status_json(dev, st) for dev, st in found],
                }
            )
            return
        for n, (dev, st) in enumerate(found):
            info = dev.info
            if n:
                click.echo("")
            click.echo(click.style(f"[{info.index}] {info.name}", bold=True))
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
                    f"{info.vendor} / {info.kind.value}"
                    + (" (simulated)" if info.is_simulated else ""),
                ),
                ("backend", info.backend),
                ("power", _fmt(st.power_w, unit="W")),
                (
                    "energy counter",
                    _fmt(st.energy_j, 3, "J")
                    + (
                        ""
                        if st.memory_energy_j is None
                        else f" (memory {_fmt(st.memory_energy_j, 3, 'J')})"
                    ),
                ),
                ("SM clock", f"{_fmt(st.sm_freq_mhz, 0, 'MHz')} ({lock})"),
                ("supported SM clocks", _freq_summary(info.supported_sm_freqs_mhz)),
                (
                    "power limit",
                    _fmt(st.power_limit_w, unit="W")
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
                ("temperature", _fmt(st.temperature_c, unit="C")),
            ]
            lines += [
                (key, json.dumps(value) if not isinstance(value, str) else value)
                for key, value in dev.details().items()
            ]
            width = max(len(k) for k, _ in lines)
            for key, value in lines:
                click.echo(f"  {key.ljust(width)}  {value}")
            caps = set(info.capabilities.names())
            click.echo("  capabilities:")
            for name, label in _CAPABILITY_LABELS:
                click.echo(f"    {label}: {'yes' if name in caps else 'no'}")


@cli.command()
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
    opts: _Options, interval_s: float, count: int | None, selector: str | None, as_json: bool
) -> None:
    """Sample power states periodically; AVG W is the energy-counter delta over the interval."""
    with _open(opts) as backend:
        chosen = _select(backend, selector)
        last: dict[str, PowerState] = {}
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
        for n in _ticks(interval_s, count):
            for dev in chosen:
                st = dev.read_state()
                prev = last.get(dev.device_id)
                avg_w = _avg_power_w(prev, st)
                last[dev.device_id] = st
                if as_json:
                    row = _state_json(dev, st)
                    row["sample"] = n
                    row["avg_power_w"] = avg_w
                    click.echo(json.dumps(row))
                else:
                    click.echo(
                        "  ".join(
                            [
                                time.strftime("%H:%M:%S", time.localtime(st.timestamp_s))
                                if st.timestamp_s > 1e9
                                else f"{st.timestamp_s:8.2f}",
                                str(dev.index).rjust(3),
                                _fmt(st.power_w).rjust(8),
                                _fmt(avg_w).rjust(8),
                                _fmt(st.sm_freq_mhz, 0).rjust(7),
                                _fmt(st.power_limit_w).rjust(8),
                                _fmt(st.energy_j, 3).rjust(14),
                                _fmt(st.temperature_c).rjust(6),
                            ]
                        )
                    )


def _ticks(interval_s: float, count: int | None) -> Iterator[int]:
    start = time.monotonic()
    n = 0
    while count is None or n < count:
        yield n
        n += 1
        if count is not None and n >= count:
            return
        delay = start + n * interval_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def _avg_power_w(prev: PowerState | None, cur: PowerState) -> float | None:
    if prev is None or prev.energy_j is None or cur.energy_j is None:
        return None
    dt = cur.timestamp_s - prev.timestamp_s
    return (cur.energy_j - prev.energy_j) / dt if dt > 0 else None


@cli.command(name="set")
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
    opts: _Options,
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
    with _open(opts) as backend:
        dev = backend.device(selector)
        ensure_not_controlled(backend, dev)
        lo_hi = (freq_mhz, freq_mhz) if freq_mhz is not None else freq_range_mhz
        if lo_hi is not None:
            dev.validate_sm_clocks(*lo_hi)
        if power_limit_w is not None:
            dev.validate_power_limit(power_limit_w)
        applied: dict[str, object] = {}
        if lo_hi is not None:
            applied["locked_sm_freqs_mhz"] = list(dev.lock_sm_clocks(*lo_hi))
        if power_limit_w is not None:
            applied["power_limit_w"] = dev.set_power_limit(power_limit_w)
        st = dev.read_state()
        if as_json:
            _emit_json(
                {
                    "schema": f"powerlib.set.v{SCHEMA_VERSION}",
                    "applied": applied,
                    "device": _state_json(dev, st),
                }
            )
            return
        if "locked_sm_freqs_mhz" in applied:
            lo, hi = applied["locked_sm_freqs_mhz"]  # type: ignore[misc]
            click.echo(
                f"device {dev.index} ({dev.device_id}): SM clock locked to "
                + (f"{lo:g} MHz" if lo == hi else f"{lo:g}-{hi:g} MHz")
            )
        if "power_limit_w" in applied:
            click.echo(
                f"device {dev.index} ({dev.device_id}): power limit set to {applied['power_limit_w']:g} W"
            )


@cli.command()
@click.option("--device", "selector", metavar="I", default=None, help="Device index or id.")
@click.option("--all", "all_devices", is_flag=True, help="Reset every device.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def reset(opts: _Options, selector: str | None, all_devices: bool, as_json: bool) -> None:
    """Unlock SM clocks and restore the default power limit.

    Operations a device does not support are skipped and reported; other failures are reported
    too, the remaining devices are still reset, and the exit status is non-zero.
    """
    if (selector is None) == (not all_devices):
        raise click.UsageError("give --device I or --all")
    with _open(opts) as backend:
        results = []
        first_error: PowerlibError | None = None
        for dev in _select(backend, selector):
            caps = dev.info.capabilities
            outcome: dict[str, object] = {"index": dev.index, "device_id": dev.device_id}
            try:
                ensure_not_controlled(backend, dev)
            except PowerlibError as err:
                outcome.update(sm_clocks=f"skipped: {err}", power_limit="skipped")
                results.append(outcome)
                first_error = first_error or err
                continue
            for key, supported, op in (
                ("sm_clocks", caps.can_lock_sm_clocks, dev.reset_sm_clocks),
                ("power_limit", caps.can_reset_power_limit, dev.reset_power_limit),
            ):
                if not supported:
                    outcome[key] = "not supported"
                    continue
                try:
                    op()
                    outcome[key] = "reset"
                except PowerlibError as err:
                    outcome[key] = f"failed: {err}"
                    first_error = first_error or err
            results.append(outcome)
        if as_json:
            _emit_json(
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


def _trust_owner_uids(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> tuple[int, ...]:
    """``--trust-owner`` values (uids or user names) as uids."""
    import pwd

    uids = []
    for value in values:
        if value.isdigit():
            uids.append(int(value))
            continue
        try:
            uids.append(pwd.getpwnam(value).pw_uid)
        except KeyError:
            raise click.BadParameter(
                f"no user is named {value!r}; give a uid or a user name"
            ) from None
    return tuple(uids)


def _still_modified(outcome: RestoreOutcome) -> dict[str, object]:
    """A failed restore step as a ``still_modified`` row (``item: unknown`` for a journal)."""
    return {
        "device_id": outcome.device_id,
        "item": "unknown" if outcome.item == "journal" else outcome.item,
        "journal": outcome.journal,
        "reason": outcome.action,
        "error_code": outcome.error_code,
    }


@cli.command()
@click.option(
    "--stale",
    "mode",
    flag_value="stale",
    default=True,
    help="Restore journals whose owner process is gone (default).",
)
@click.option(
    "--all",
    "mode",
    flag_value="all",
    help="Also restore journals of running owners (for an operator clearing a node).",
)
@click.option("--dry-run", is_flag=True, help="Show what would be restored; change nothing.")
@click.option(
    "--trust-owner",
    "trusted_uids",
    metavar="UID",
    multiple=True,
    callback=_trust_owner_uids,
    help=(
        "Also act on a state folder and journals owned by this user (uid or name), e.g. the "
        'Slurm job\'s: --trust-owner "$SLURM_JOB_UID". Repeatable. Only the owner rule is '
        "relaxed: group/world-writable files, symlinks and fifos are still refused."
    ),
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def restore(
    opts: _Options, mode: str, dry_run: bool, trusted_uids: tuple[int, ...], as_json: bool
) -> None:
    """Put devices back from the journals that sessions left in the state directory.

    A session journals each device's original settings before changing it and deletes the
    journal once it has restored them; a journal left behind means its owner was killed
    (SIGKILL, OOM, crash). Run this from a Slurm epilog or a systemd unit to clean up a node.
    Each journal reopens the backend it was written with; --backend is ignored here.

    Only trusted state is acted on: folders and journals owned by you or root (or a
    --trust-owner), not writable by group or others, real folders and regular files. Anything
    else is refused with one line naming its path, owner and mode (exit 12). After restoring,
    each device is read back; whatever is still modified is listed and the exit code is
    non-zero.
    """
    settings = Settings.from_env()
    report: dict[str, object] = {
        "schema": f"powerlib.restore.v{SCHEMA_VERSION}",
        "state_dir": str(settings.state_dir),
        "mode": mode,
        "dry_run": dry_run,
        "trusted_uids": sorted({os.geteuid(), 0, *trusted_uids}),
    }
    try:
        outcomes = restore_journals(
            settings, include_live=mode == "all", dry_run=dry_run, trusted_uids=trusted_uids
        )
    except PowerlibError as err:  # the state folder itself: nothing was done
        if as_json:
            report.update(
                ok=False,
                error=str(err),
                exit_code=err.exit_code,
                outcomes=[],
                still_modified=[
                    {
                        "device_id": "?",
                        "item": "unknown",
                        "journal": None,
                        "reason": str(err),
                        "error_code": err.exit_code,
                    }
                ],
            )
            _emit_json(report)
        raise
    failure = restore_failure(outcomes)
    if as_json:
        report.update(
            ok=failure is None,
            error=None if failure is None else str(failure),
            exit_code=0 if failure is None else failure.exit_code,
            outcomes=[o.to_json() for o in outcomes],
            still_modified=[_still_modified(o) for o in outcomes if not o.ok],
        )
        _emit_json(report)
    elif not outcomes:
        click.echo(f"nothing to restore in {settings.state_dir}")
    else:
        for o in outcomes:
            owner = f" (journal of pid {o.owner_pid})" if o.owner_pid is not None else ""
            line = f"{o.device_id} {o.item}: {o.action}{owner}"
            click.echo(click.style(line, fg=None if o.ok else "red"))
    if failure is not None:
        raise failure


@cli.command()
@click.argument("profile_path", metavar="PROFILE", type=click.Path(dir_okay=False))
@click.option("--stages", type=click.IntRange(min=1), required=True, help="Pipeline stages N.")
@click.option(
    "--microbatches",
    type=click.IntRange(min=1),
    required=True,
    help="Microbatches M per iteration.",
)
@click.option(
    "--schedule",
    type=click.Choice(["1f1b", "gpipe", "interleaved"]),
    default="1f1b",
    show_default=True,
)
@click.option(
    "--chunks",
    type=click.IntRange(min=1),
    default=None,
    help="Virtual stages per GPU (interleaved; default 2).",
)
@click.option(
    "--p-block-w",
    type=Number(),
    required=True,
    help="Power while blocked on communication (A100: 83.64, A40: 70.38).",
)
@click.option(
    "--unit-time-s",
    type=Number(),
    required=True,
    help="Time quantum τ (the artifact: 0.001).",
)
@click.option(
    "--order",
    type=click.Choice(["filter-then-subtract", "subtract-then-filter"]),
    default="filter-then-subtract",
    show_default=True,
    help="Pareto filter before or after the effective-energy conversion (the paper: before).",
)
@click.option(
    "--cost-model",
    type=click.Choice(["exp", "convex"]),
    default="exp",
    show_default=True,
    help="Exponential fit (the paper) or the lower convex hull of the measured points.",
)
@click.option(
    "--policy",
    type=click.Choice(["fastest", "deadline", "min-energy"]),
    default="fastest",
    show_default=True,
    help="Which frontier point to write as the plan.",
)
@click.option(
    "--argmin",
    is_flag=True,
    help="Deadline policy: min-energy point with T <= T' (the paper's emulation rule) instead of the slowest.",
)
@plan_outputs
def plan(
    profile_path: str,
    stages: int,
    microbatches: int,
    schedule: str,
    chunks: int | None,
    p_block_w: float,
    unit_time_s: float,
    order: str,
    cost_model: str,
    policy: str,
    deadline_s: float | None,
    argmin: bool,
    max_slowdown: float,
    switch_latency_s: float,
    frontier_out: str | None,
    plan_out: str | None,
    plot_path: str | None,
    max_work: int,
    as_json: bool,
) -> None:
    """Compute the Perseus time-energy frontier of a pipeline from a PROFILE and pick a plan.

    PROFILE is a CSV (stage,instruction,frequency,time,energy; extra rank columns are merged:
    time = max, energy = mean) or a JSON profile. Savings are against every instruction at its
    maximum frequency, blocking power included, at the chosen plan's iteration time.
    """
    from powerlib.planning.choice import Policy  # noqa: PLC0415
    from powerlib.planning.perseus.frontier import (  # noqa: PLC0415 - keep CLI start fast
        WORK_HINT,
        compute_frontier,
        estimate_pipeline_work,
    )
    from powerlib.planning.pipeline import build_schedule  # noqa: PLC0415

    if policy == "deadline" and deadline_s is None:
        raise click.UsageError("--policy deadline needs --deadline-s")
    num_chunks = chunks if chunks is not None else (2 if schedule == "interleaved" else 1)
    profile = _read_profile(profile_path)
    profile.validate_for(stages, ())  # a profile of 8 stages cannot plan 100000
    # Before the schedule is even built: M = 100000 or τ = 1e-7 s would otherwise run for hours.
    estimate_pipeline_work(
        profile.option_points(),
        num_stages=stages,
        num_microbatches=microbatches,
        num_chunks=num_chunks,
        unit_time_s=unit_time_s,
    ).check(max_work, hint=WORK_HINT)
    sched = build_schedule(schedule, stages, microbatches, num_chunks)
    started = time.perf_counter()
    with progress_bar("solving frontier") as bar:

        def progress(done: int, expected: int) -> None:
            bar.length = max(expected, 1)
            bar.update(1)

        frontier = compute_frontier(
            profile,
            sched,
            schedule_name=schedule,
            num_microbatches=microbatches,
            num_chunks=num_chunks,
            p_block_w=p_block_w,
            unit_time_s=unit_time_s,
            order=order,
            cost_model=cost_model,
            progress=progress,
            max_work=max_work,
        )
    solve_time_s = time.perf_counter() - started
    _, data = select_and_write(
        frontier,
        Policy(
            name=policy,
            deadline_s=deadline_s,
            argmin=argmin,
            max_slowdown=max_slowdown,
            switch_latency_s=switch_latency_s,
        ),
        frontier_out=frontier_out,
        plan_out=plan_out,
        plot_path=plot_path,
        solve_time_s=solve_time_s,
    )
    if as_json:
        _emit_json(data)
        return
    c = data["chosen"]
    click.echo(
        f"frontier: {data['num_points']} points, {data['t_max_s']:.4f} s (all slowest) -> "
        f"{data['t_min_s']:.4f} s (T_min); minimum energy {data['t_star_energy_j']:.1f} J at "
        f"T* = {data['t_star_s']:.4f} s; solved in {solve_time_s:.1f} s"
    )
    click.echo(
        f"chosen ({policy}): {c['time_s']:.4f} s, {c['energy_j']:.1f} J planned; "
        f"{c['realized_time_s']:.4f} s, {c['realized_energy_j']:.1f} J replayed on the profile"
    )
    click.echo(
        f"all max frequency at that time: {data['baseline']['energy_j']:.1f} J -> "
        f"saving {_pct(data['saving_percent'])} planned"
    )
    r = data["realized"]
    sped_up = r["instructions_sped_up"]
    click.echo(
        f"replayed on the measured profile: saving {_pct(r['saving_percent'])} at "
        f"{r['slowdown_percent']:+.3f} % iteration time vs all max"
        + (f" ({sped_up} instruction(s) sped up by the slowdown guard)" if sped_up else "")
    )
    for label, path in (("frontier", frontier_out), ("plan", plan_out), ("plot", plot_path)):
        if path:
            click.echo(f"{label} written to {path}")


def _read_profile(path: str) -> Any:
    """``Profile.read`` with a progress bar (and ETA) on stderr for files over 1 MB."""
    from powerlib.planning.profile import Profile  # noqa: PLC0415 - keep CLI start fast

    try:
        size = os.stat(path).st_size
    except OSError:
        size = 0  # Profile.read says what is wrong with the path
    if size < 1_000_000:
        return Profile.read(path)
    with progress_bar("reading profile") as bar:

        def progress(done: int, total: int) -> None:
            bar.length = max(total, 1)
            bar.update(done - bar.pos)

        return Profile.read(path, progress=progress)


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
    default=0.005,
    show_default=True,
    help="Clock-change latency of the emulated GPUs.",
)


def _versus_all_max(base: dict[str, Any], label: str, run: dict[str, Any]) -> None:
    """The all-max-clock vs plan table of `demo` and `simulate`."""
    _table(
        ["", "iteration time", "energy / iteration"],
        [
            ["all max clock", f"{base['time_s']:.4f} s", f"{base['energy_j']:.1f} J"],
            [label, f"{run['time_s']:.4f} s", f"{run['energy_j']:.1f} J"],
        ],
    )


@cli.command()
@_EMULATED_PROFILE
@click.option("--microbatches", type=click.IntRange(min=1), default=12, show_default=True)
@click.option(
    "--schedule",
    type=click.Choice(["1f1b", "gpipe", "interleaved"]),
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
    type=click.Choice(["fastest", "deadline", "min-energy"]),
    default=None,
    help="Plan policy (default: fastest; deadline with --straggler).",
)
@_EMULATED_P_BLOCK
@_EMULATED_SWITCH_LATENCY
@click.option(
    "--counter-period-s",
    type=Number(min=0.0),
    default=0.001,
    show_default=True,
    help="Energy-counter update period of the emulated GPUs.",
)
@click.option(
    "--noise",
    type=Number(min=0.0, max=0.2),
    default=0.0,
    show_default=True,
    help="Multiplicative noise (std) on every instruction's time and energy.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Noise seed.")
@click.option(
    "--out-dir",
    type=OutputPath(folder=True),
    default="powerlib-demo",
    show_default=True,
    help="Where profile.csv, frontier.csv, plan.json, summary.json and the pictures go.",
)
@click.option("--no-plot", is_flag=True, help="Skip frontier.png and timeline.png.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def demo(
    profile_path: str | None,
    microbatches: int,
    schedule: str,
    straggler: float | None,
    policy: str | None,
    p_block_w: float,
    switch_latency_s: float,
    counter_period_s: float,
    noise: float,
    seed: int,
    out_dir: str,
    no_plot: bool,
    as_json: bool,
) -> None:
    """The whole method on emulated GPUs, no GPU needed: profile -> plan -> apply.

    An 8-stage pipeline of emulated A100s runs GPT-3 175B's measured per-stage times and
    energies (the Perseus artifact's profile) in virtual time, through the same session code a
    training job uses. Prints all-max-clock vs powerlib: iteration time, energy per iteration,
    saving and slowdown.
    """
    from powerlib.emulator.demo import DemoConfig, run_demo  # noqa: PLC0415 - keep CLI start fast

    report = run_demo(
        DemoConfig(
            profile_path=profile_path,
            num_microbatches=microbatches,
            schedule=schedule,
            num_chunks=2 if schedule == "interleaved" else 1,
            p_block_w=p_block_w,
            switch_latency_s=switch_latency_s,
            counter_period_s=counter_period_s,
            noise=noise,
            straggler=straggler,
            policy=policy,
            out_dir=out_dir,
            plot=not no_plot,
            seed=seed,
            progress=True,
        )
    )
    if as_json:
        _emit_json(report)
        return
    w, b, p = report["workload"], report["baseline"], report["powerlib"]
    click.echo(
        f"{w['num_stages']} stages x {w['num_microbatches']} microbatches ({w['schedule']}), "
        f"emulated from {w['profile']}"
        + (
            f", straggler {w['straggler']:g}x (T' = {w['deadline_s']:.4f} s)"
            if w["straggler"]
            else ""
        )
    )
    _versus_all_max(b, f"powerlib ({report['policy']})", p)
    click.echo(
        click.style(
            f"energy saved: {report['saving_percent']:.2f} %  "
            f"(slowdown {report['slowdown_percent']:+.3f} %)",
            bold=True,
        )
    )
    prof = report["profile"]
    click.echo(
        f"profiled {len(prof['freqs_mhz'])} clocks in {prof['iterations']} iterations; "
        f"plan applied from iteration {report['apply_started_iteration']}; "
        f"{report['elapsed_s']:.1f} s"
    )
    for name, path in report["outputs"].items():
        click.echo(f"  {name}: {path}")


@cli.command()
@click.argument("plan_path", metavar="PLAN.json", type=click.Path(exists=True, dir_okay=False))
@_EMULATED_PROFILE
@_EMULATED_P_BLOCK
@_EMULATED_SWITCH_LATENCY
@click.option(
    "--deadline-s",
    type=Number(min=0.0),
    default=None,
    help="A straggler holds every iteration to this time.",
)
@click.option(
    "--iterations",
    type=click.IntRange(min=1, max=1000),
    default=3,
    show_default=True,
    help="Managed iterations to replay (their mean is reported).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def simulate(
    plan_path: str,
    profile_path: str | None,
    p_block_w: float,
    switch_latency_s: float,
    deadline_s: float | None,
    iterations: int,
    as_json: bool,
) -> None:
    """Replay a saved PLAN.json on the emulator and compare it with all maximum clocks."""
    from powerlib.emulator.demo import simulate_plan  # noqa: PLC0415 - keep CLI start fast

    result = simulate_plan(
        plan_path,
        profile_path=profile_path,
        p_block_w=p_block_w,
        switch_latency_s=switch_latency_s,
        straggler_time_s=deadline_s,
        iterations=iterations,
    )
    if as_json:
        _emit_json(result)
        return
    b, r = result["baseline"], result["plan_result"]
    _versus_all_max(b, "plan", r)
    click.echo(
        f"energy saved: {result['saving_percent']:.2f} %  (slowdown {result['slowdown_percent']:+.3f} %)"
    )


cli.add_command(_overlap_group)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Console-script entry point."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="powerlib")
    sys.exit(0)  # pragma: no cover - click exits itself


if __name__ == "__main__":  # pragma: no cover
    main()
