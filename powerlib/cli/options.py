"""What the commands share: global options, option types, progress bars, plan outputs, JSON."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from powerlib.errors import InvalidArgumentError, PermissionDeniedError

__all__ = [
    "Number",
    "Options",
    "OutputPath",
    "PhaseBars",
    "emit_json",
    "open_backend_for",
    "plan_outputs",
    "progress_bar",
    "settings_for",
]

if TYPE_CHECKING:
    from powerlib.backend import Backend
    from powerlib.config import Settings

    _StrParam = click.ParamType[str]
else:
    _StrParam = click.ParamType  # a generic class only in later click 8 releases


@dataclass(slots=True)
class Options:
    """Global options shared by every command."""

    backend: str | None = None
    verbose: int = 0


def settings_for(opts: Options) -> Settings:
    """The environment's settings, ``--backend`` applied."""
    from powerlib.config import Settings  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    settings = Settings.from_env()
    return settings.replace(backend=opts.backend) if opts.backend else settings


def open_backend_for(opts: Options) -> Backend:
    """Open the backend the global options and the environment name."""
    from powerlib.registry import open_backend  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    return open_backend(settings=settings_for(opts))


def emit_json(data: object) -> None:
    """Print a ``--json`` result."""
    click.echo(json.dumps(data, indent=2, sort_keys=False))


class Number(click.FloatRange):
    """A float option that refuses NaN and infinities (click's ranges let NaN through).

    A non-finite value is an invalid argument (exit 7, one line naming the option); bounds
    behave as click's :class:`~click.FloatRange` (a usage error, exit 2). Help shows the bounds
    (``[x>0]``, ``[0<=x<=0.2]``), nothing when there are none (click would show ``x<=None``).
    """

    name = "number"

    def _describe_range(self) -> str:
        low = None if self.min is None else f"{self.min:g}{'<' if self.min_open else '<='}"
        high = None if self.max is None else f"{'<' if self.max_open else '<='}{self.max:g}"
        if low is None and high is None:
            return ""
        if low is None:
            return f"x{high}"
        if high is None:
            return f"x{'>' if self.min_open else '>='}{self.min:g}"
        return f"{low}x{high}"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """Parse ``value``; refuse NaN and infinities, then apply the bounds."""
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            name = param.opts[0] if isinstance(param, click.Option) else "value"
            raise InvalidArgumentError(f"{name}: must be a finite number, got {value!r}")
        return super().convert(number, param, ctx)


class _Quiet:
    """A progress bar that shows nothing (stderr is not a terminal)."""

    length: int = 1
    pos: int = 0

    def update(self, n: int) -> None:
        self.pos += n

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def progress_bar(label: str, length: int = 1, *, in_logs: bool = False) -> Any:
    """A click progress bar (with ETA) on stderr when it is a terminal, else a silent one.

    Logs and pipes get no bar, so a failing command's stderr stays its one error line; with
    ``in_logs`` they get the label once (click's non-terminal form), for steps of minutes.
    """
    if not (in_logs or sys.stderr.isatty()):
        return _Quiet()
    return click.progressbar(length=length, label=label, file=sys.stderr, show_pos=True)


def _writable(path: Path, mode: int = os.W_OK | os.X_OK) -> bool:
    # The effective uid decides (a setuid or seteuid caller), as for the open() that follows.
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


class OutputPath(_StrParam):
    """A file or folder powerlib will write: checked before any work starts.

    A missing or non-folder parent is an invalid argument (exit 7), a folder the caller cannot
    write is a permission error (exit 4); the message names the option and the path. ``folder``
    outputs may be created (with their missing parents) when their nearest existing ancestor is
    a writable folder.
    """

    name = "path"

    def __init__(self, *, folder: bool = False) -> None:
        self.folder = folder

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        """Check ``value``; return it unchanged."""
        path = Path(os.fspath(value))
        name = "output" if param is None else param.human_readable_name
        if isinstance(param, click.Option):
            name = param.opts[0]
        label = f"{name} {path}"
        try:
            self._check(path, label)
        except OSError as err:  # e.g. EACCES on a folder above: the caller cannot reach it
            raise PermissionDeniedError(
                f"{label}: cannot check the path ({err.strerror}: {err.filename})"
            ) from None
        return str(path)

    def _check(self, path: Path, label: str) -> None:
        if self.folder:
            if path.exists() and not path.is_dir():
                raise InvalidArgumentError(f"{label}: exists and is not a folder")
            parent = path
            while not parent.exists() and parent != parent.parent:
                parent = parent.parent
        else:
            if path.is_dir():
                raise InvalidArgumentError(f"{label}: is a folder; give a file name")
            parent = path.parent
            if not parent.exists():
                raise InvalidArgumentError(f"{label}: the folder {parent} does not exist")
        if not parent.is_dir():
            raise InvalidArgumentError(f"{label}: {parent} is not a folder")
        if not _writable(parent):
            raise PermissionDeniedError(f"{label}: the folder {parent} is not writable")
        if path.exists() and not self.folder and not _writable(path, os.W_OK):
            raise PermissionDeniedError(f"{label}: the file is not writable")


_OPTIONS = (
    click.option(
        "--deadline-s",
        type=Number(min=0.0, min_open=True),
        default=None,
        help="Straggler iteration time T' (policy deadline).",
    ),
    click.option(
        "--max-slowdown",
        type=Number(min=0.0),
        default=0.001,
        show_default=True,
        help="fastest/deadline policies: speed up instructions on the realized critical path until "
        "the plan, replayed on the measurements, is at most this much slower than the baseline "
        "(fastest) or than the deadline (a fraction).",
    ),
    click.option(
        "--switch-latency-s",
        type=Number(min=0.0),
        default=0.005,
        show_default=True,
        help="Clock-change latency the slowdown guard plans for (the old clock runs meanwhile).",
    ),
    click.option(
        "--frontier-out",
        type=OutputPath(),
        default=None,
        help="Write the frontier CSV here.",
    ),
    click.option(
        "--plan-out",
        type=OutputPath(),
        default=None,
        help="Write the chosen plan (JSON) here.",
    ),
    click.option(
        "--plot",
        "plot_path",
        type=OutputPath(),
        default=None,
        help="Plot the frontier to this PNG (needs powerlib[plot]).",
    ),
    click.option(
        "--max-work",
        type=click.IntRange(min=1),
        default=50_000_000,
        show_default=True,
        help="Refuse a frontier estimated past this many instruction-steps (instructions x time "
        "quanta; about 1e-5 s and 10 bytes each here) before solving.",
    ),
    click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary."),
)


def plan_outputs(func: Callable[..., Any]) -> Callable[..., Any]:
    """The plan commands' shared output options.

    ``--deadline-s --max-slowdown --switch-latency-s --frontier-out --plan-out --plot
    --max-work --json``.
    """
    for option in reversed(_OPTIONS):
        func = option(func)
    return func


class PhaseBars:
    """One progress bar per phase for a workflow's ``progress(phase, done, total)`` callback.

    A phase's first call (``done == 0``) closes the previous bar and opens one labelled
    ``label(phase)``; later calls advance it. Use as a context manager: leaving closes the last.
    """

    def __init__(self, label: Callable[[str], str], *, in_logs: bool = False) -> None:
        self._label = label
        self._in_logs = in_logs
        self._phase: str | None = None
        self._bar: Any = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        """Open or advance ``phase``'s bar."""
        if phase != self._phase:
            self.close()
            self._phase = phase
            self._bar = progress_bar(self._label(phase), max(total, 1), in_logs=self._in_logs)
            self._bar.__enter__()
        bar = self._bar
        bar.length = max(total, 1)
        if done > bar.pos:
            bar.update(done - bar.pos)

    def close(self) -> None:
        """Close the open bar, if any."""
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
            self._bar = None

    def __enter__(self) -> PhaseBars:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
