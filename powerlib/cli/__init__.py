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
    "kareus": ("powerlib.cli.kareus", "kareus"),
    "overlap": ("powerlib.cli.kareus", "overlap"),
}


class _CliError(click.ClickException):
    """A PowerlibError on its way out: one line, the error's own exit code."""

    def __init__(self, err: PowerlibError) -> None:
        super().__init__(str(err))
        self.exit_code = err.exit_code

    def show(self, file: Any = None) -> None:
        click.echo(f"powerlib: error: {self.format_message()}", err=True)


class _Group(click.Group):
    """Turns PowerlibError into a one-line message and its exit code; Ctrl-C exits 130.

    Commands load lazily from :data:`_COMMANDS`.
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(_COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _COMMANDS and cmd_name not in self.commands:
            module, attr = _COMMANDS[cmd_name]
            self.add_command(getattr(importlib.import_module(module), attr), cmd_name)
        return super().get_command(ctx, cmd_name)

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
    ctx.obj = Options(backend=backend, verbose=verbose)
    if verbose:
        logging.basicConfig(
            level=logging.DEBUG if verbose > 1 else logging.INFO,
            format="%(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
    # Every command, `env` and the planning ones included, refuses a bad setting up front:
    # an unknown POWERLIB_BACKEND is a mistake a user must hear about, not a value to print.
    check_backend_name(settings_for(ctx.obj).backend)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Console-script entry point."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="powerlib")
    sys.exit(0)  # pragma: no cover - click exits itself
