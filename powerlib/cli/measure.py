"""``powerlib measure -- CMD ARGS``: the energy of an unmodified command, per device.

The command runs as a child in its own process group (made the terminal's foreground group
when powerlib runs in the foreground, so Ctrl-C reaches the child once, as a shell would
deliver it). SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 sent to powerlib are
forwarded to the child once. powerlib exits with the child's status (128 + N when signal N
killed it). A signal sent to every process of a job (a cgroup-wide kill) reaches the child
directly as well as through powerlib.

The devices are sampled by :class:`powerlib.measurement.Measurement` in this process. A child
that uses ``powerlib.measure`` itself (or a trainer callback) reports its steps through the
file named by ``POWERLIB_MEASURE_EVENTS``; its steps then appear in the result, with the energy
of every measured device attributed to them (the lowest reporting rank's steps, so that ranks
sharing the devices are not counted twice).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from powerlib.cli.format import fmt
from powerlib.cli.options import Number, Options, OutputPath, open_backend_for
from powerlib.errors import InvalidArgumentError

__all__ = ["measure"]

FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


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
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON when it ends.")
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
    r"""Run COMMAND unmodified and report the energy each device used while it ran.

    \b
    powerlib measure -- python train.py --epochs 1
    powerlib measure --json --plot power.png -- torchrun --nproc-per-node 8 train.py
    """
    from powerlib.measurement import EVENTS_ENV, Measurement, read_events  # noqa: PLC0415

    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise InvalidArgumentError("no command to run: powerlib measure -- CMD ARGS")
    if plot_path is not None:
        from powerlib.planning.perseus.report import pyplot  # noqa: PLC0415

        pyplot()  # matplotlib missing: say so before the job runs, not after
    backend = open_backend_for(opts)
    try:
        devices = [backend.device(s) for s in selectors] or None
        with tempfile.TemporaryDirectory(prefix="powerlib-measure-") as tmp:
            events = Path(tmp) / "events.jsonl"
            m = Measurement(
                devices, backend=backend, sample_period_s=sample_period_s, events_path=False
            )
            with m:
                env = dict(os.environ) | {EVENTS_ENV: str(events)}
                status = _run(argv, env, m, jsonl_path, jsonl_interval_s)
            _record_child_windows(m, read_events(events, warn=_warn))
            result = m.result()
    finally:
        backend.close()
    doc = result.to_json() | {"command": argv, "exit_status": status}
    if out_path is not None:
        Path(out_path).write_text(finite_json(doc, indent=2) + "\n", encoding="utf-8")
    if plot_path is not None:
        plot_power(m.power_series(), result, plot_path, title=" ".join(argv))
    if as_json:
        click.echo(finite_json(doc))
    else:
        _table(doc)
    code = status if status >= 0 else 128 - status
    if code:
        sys.exit(code)


def _run(
    argv: list[str],
    env: dict[str, str],
    m: Any,
    jsonl_path: str | None,
    jsonl_interval_s: float,
) -> int:
    """Run the child to completion, forwarding signals; its status (``-N``: killed by N)."""
    try:
        proc = subprocess.Popen(argv, env=env, **_own_group())
    except OSError as err:
        raise InvalidArgumentError(f"cannot run {argv[0]!r}: {err.strerror}") from err
    with _foreground(proc.pid), _forwarding(proc):
        jsonl = open(jsonl_path, "a", encoding="utf-8") if jsonl_path is not None else None  # noqa: SIM115
        try:
            next_line = time.monotonic() + jsonl_interval_s
            while True:
                timeout = max(0.0, next_line - time.monotonic()) if jsonl else None
                try:
                    return proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    pass
                if jsonl is not None:
                    now = time.time()
                    for row in m.snapshot():
                        jsonl.write(finite_json({"time_unix_s": round(now, 3)} | row) + "\n")
                    jsonl.flush()
                    next_line += jsonl_interval_s
        finally:
            if jsonl is not None:
                jsonl.close()


def _own_group() -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}  # pragma: no cover - Python 3.10


@contextlib.contextmanager
def _forwarding(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    def forward(signum: int, _frame: object) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

    old = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _foreground(pgid: int) -> Iterator[None]:
    """Make the child's group the terminal's foreground group while it runs (if we hold it)."""
    fd: int | None = None
    try:
        if sys.stdin.isatty() and os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp():
            fd = sys.stdin.fileno()
    except (OSError, ValueError):
        fd = None
    if fd is not None:
        _set_foreground(fd, pgid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGCONT)  # it may have stopped reading the tty before
    try:
        yield
    finally:
        if fd is not None:
            _set_foreground(fd, os.getpgrp())


def _set_foreground(fd: int, pgid: int) -> None:
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        with contextlib.suppress(OSError):
            os.tcsetpgrp(fd, pgid)
    finally:
        signal.signal(signal.SIGTTOU, old)


def _warn(message: str) -> None:
    click.echo(f"powerlib: warning: {message}", err=True)


def _finite(value: Any) -> Any:
    """``value`` with every NaN and infinity, however deep, replaced by ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def finite_json(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``value`` with non-finite numbers as ``null``: never ``Infinity``/``NaN``.

    JSON has no such numbers (strict parsers, ``jq`` and the schema refuse them);
    ``allow_nan=False`` makes a missed one an error here rather than a broken document.
    """
    return json.dumps(_finite(value), allow_nan=False, **kwargs)


def _number(value: Any) -> float | None:
    """A finite float from a child's JSON number, else ``None`` (``1e999``, a 400-digit int)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _record_child_windows(m: Any, events: list[dict[str, Any]]) -> None:
    """The steps and windows the child reported: the lowest reporting rank's, on our clock.

    The child's numbers are checked: a window without finite start and end is dropped, and
    tokens that are not a finite number count as unreported (docs/measurement.md §6).
    """
    ranks = [e.get("rank", 0) for e in events if isinstance(e.get("rank", 0), int)]
    if not ranks:
        return
    first = min(ranks)
    for e in events:
        start_s, end_s = _number(e.get("start_s")), _number(e.get("end_s"))
        if e.get("rank", 0) != first or start_s is None or end_s is None:
            continue
        kind = e.get("kind")
        if kind not in ("step", "window"):
            continue
        with contextlib.suppress(InvalidArgumentError):
            m.record(
                kind,
                str(e.get("name", kind)),
                start_s,
                end_s,
                tokens=_number(e.get("tokens")),
                index=e.get("index") if isinstance(e.get("index"), int) else None,
            )


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


def plot_power(
    series: dict[str, tuple[list[float], list[float | None]]],
    result: Any,
    path: str | os.PathLike[str],
    *,
    title: str = "",
) -> None:
    """Power per device over time, with the steps shaded (alternating) and windows outlined.

    Raises:
        BackendUnavailableError: matplotlib is not installed (``pip install 'powerlib[plot]'``).
    """
    from powerlib.planning.perseus.report import pyplot  # noqa: PLC0415

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
