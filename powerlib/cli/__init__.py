"""The ``powerlib`` command line: inspect and control device power states.

Every command but the two that serve (``exporter``, ``agent serve``) takes ``--json`` (stable
schemas, units in key names; docs/json-and-exit-codes.md) and prints a table otherwise. Known
failures exit non-zero with one line on stderr and no traceback; ``-v`` shows the traceback and
INFO logs (``-vv``: DEBUG). The global options ``--backend`` and ``-v`` go before or after the
command's name (``powerlib -v status`` = ``powerlib status -v``).

Exit codes: 0 success; 1 other powerlib error (e.g. a device still modified after a restore);
2 usage error; 3 backend unavailable; 4 permission denied; 5 not supported; 6 device not found;
7 invalid argument, setting, profile or plan; 8 device busy; 9 device lost; 10 driver/vendor
error; 11 unreadable journal; 12 untrusted state folder or journal refused; 130 interrupted
(``watch`` and ``exporter`` end quietly with 0 on Ctrl-C: that is how they are stopped).
"""

from __future__ import annotations

import importlib
import logging
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

import click

from powerlib._version import __version__
from powerlib.cli.options import Options, settings_for
from powerlib.errors import PowerlibError
from powerlib.registry import check_backend_name

__all__ = ["cli", "main"]

# Each command's module is imported when the command runs (or help lists it): `powerlib plan`
# then loads no control, agent or exporter code (issue 34: the planner's whole-process time).
_COMMANDS = {
    "check": ("powerlib.cli.check", "check"),
    "env": ("powerlib.cli.devices", "env"),
    "devices": ("powerlib.cli.devices", "devices"),
    "status": ("powerlib.cli.devices", "status"),
    "watch": ("powerlib.cli.devices", "watch"),
    "measure": ("powerlib.cli.measure", "measure"),
    "exporter": ("powerlib.cli.exporter", "exporter"),
    "set": ("powerlib.cli.devices", "set_"),
    "reset": ("powerlib.cli.devices", "reset"),
    "restore": ("powerlib.cli.restore", "restore"),
    "plan": ("powerlib.cli.plan", "plan"),
    "demo": ("powerlib.cli.emulate", "demo"),
    "simulate": ("powerlib.cli.emulate", "simulate"),
    "agent": ("powerlib.cli.agent", "agent"),
    "job-energy": ("powerlib.cli.job_energy", "job_energy"),
    "kareus": ("powerlib.cli.kareus", "kareus"),
    "overlap": ("powerlib.cli.kareus", "overlap"),
}


class _CliError(click.ClickException):
    """A PowerlibError on its way out: one line, the error's own exit code."""

    def __init__(self, err: PowerlibError) -> None:
        super().__init__(str(err))
        # click declares exit_code a ClassVar, yet exits with the instance's: this error's own
        self.exit_code = err.exit_code  # type: ignore[misc]

    def show(self, file: Any = None) -> None:
        click.echo(f"powerlib: error: {self.format_message()}", err=True)


_BACKEND_HELP = "Backend to use (overrides POWERLIB_BACKEND): auto, nvidia, amd, sysfs, simulated, or a plug-in."
_VERBOSE_HELP = "Show tracebacks and INFO logs (-vv: DEBUG)."
_SEEN = "powerlib.global_options_seen"  # ctx.meta: which of the two a command has processed


def _global_option(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """Record a command's ``--backend`` or ``-v`` in the shared :class:`Options`.

    Both are eager: click processes them before the command's other options, given or not.
    Once a command (not a group) has processed both, :func:`_settle` applies them, so a bad
    backend name is refused before a missing option is.
    """
    opts = ctx.ensure_object(Options)
    if param.name == "backend":
        if value is not None:
            opts.backend = value
    else:
        opts.verbose += value
    if not isinstance(ctx.command, click.Group):
        seen = ctx.meta.setdefault(_SEEN, set())
        seen.add(param.name)
        if len(seen) == 2:
            _settle(opts)


def _settle(opts: Options) -> None:
    """Apply the global options: logging for ``-v``, then refuse an unknown backend name."""
    if opts.verbose:
        level = logging.DEBUG if opts.verbose > 1 else logging.INFO
        logging.basicConfig(
            level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
        )
        logging.getLogger().setLevel(level)
    # Every command, `env` and the planning ones included, refuses a bad setting up front:
    # an unknown POWERLIB_BACKEND is a mistake a user must hear about, not a value to print.
    check_backend_name(settings_for(opts).backend)


def _take_global_options(cmd: click.Command) -> None:
    """Let ``cmd`` (and a group's commands) take ``--backend`` and ``-v`` after its name too."""
    if getattr(cmd, "_powerlib_global_options", False):
        return
    cmd._powerlib_global_options = True  # type: ignore[attr-defined]
    taken = {opt for param in cmd.params for opt in getattr(param, "opts", ())}
    if taken & {"--backend", "-v", "--verbose"}:  # pragma: no cover - no command does
        raise TypeError(f"{cmd.name}: --backend and -v are powerlib's global options")
    cmd.params += [
        click.Option(
            ["-v", "--verbose"],
            count=True,
            is_eager=True,
            expose_value=False,
            callback=_global_option,
            help=_VERBOSE_HELP,
        ),
        click.Option(
            ["--backend"],
            metavar="NAME",
            is_eager=True,
            expose_value=False,
            callback=_global_option,
            help=_BACKEND_HELP,
        ),
    ]
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            _take_global_options(sub)


class _Group(click.Group):
    """Turns PowerlibError into a one-line message and its exit code; Ctrl-C exits 130.

    Commands load lazily from :data:`_COMMANDS`; each takes the global options after its name
    as well (:func:`_take_global_options`).
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(_COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _COMMANDS and cmd_name not in self.commands:
            module, attr = _COMMANDS[cmd_name]
            self.add_command(getattr(importlib.import_module(module), attr), cmd_name)
        cmd = super().get_command(ctx, cmd_name)
        if cmd is not None:
            _take_global_options(cmd)
        return cmd

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PowerlibError as err:
            opts = ctx.find_object(Options)
            if opts is not None and opts.verbose:
                traceback.print_exc()
            raise _CliError(err) from err
        except KeyboardInterrupt as err:  # SIGINT: 128 + 2, as a shell reports it
            opts = ctx.find_object(Options)
            if opts is not None and opts.verbose:
                traceback.print_exc()
            interrupted = PowerlibError("interrupted (SIGINT)")
            interrupted.exit_code = 130
            raise _CliError(interrupted) from err


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="powerlib")
@click.option("--backend", metavar="NAME", default=None, help=_BACKEND_HELP)
@click.option("-v", "--verbose", count=True, help=_VERBOSE_HELP)
@click.pass_context
def cli(ctx: click.Context, backend: str | None, verbose: int) -> None:
    """Inspect and control GPU/CPU power states; plan energy-saving clock schedules.

    --backend and -v go before or after the command's name.
    """
    # The command applies them (_settle) once its own --backend and -v are parsed too.
    ctx.obj = Options(backend=backend, verbose=verbose)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Console-script entry point."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="powerlib")
    sys.exit(0)  # pragma: no cover - click exits itself
