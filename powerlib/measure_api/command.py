"""The energy of an unmodified command, per device: what ``powerlib measure -- CMD`` runs.

:func:`run_command` runs the command as a child in its own process group (made the terminal's
foreground group when this process holds the terminal, so Ctrl-C reaches the child once, as a
shell would deliver it). SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 sent to this
process while the child runs are forwarded to the child once (from the main thread only: Python
delivers signals there). A signal sent to every process of a job (a cgroup-wide kill) reaches
the child directly as well as through this process.

The devices are sampled by a :class:`~powerlib.measure_api.measure.Measurement` in this
process. A child that uses ``powerlib.measure`` itself (or a trainer callback) reports its
steps through the file named by ``POWERLIB_MEASURE_EVENTS`` (:mod:`powerlib.measure_api.events`);
its steps then appear in the result, with the energy of every measured device attributed to
them (the lowest reporting rank's steps, so that ranks sharing the devices are not counted
twice). docs/measurement.md §6.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from powerlib.backend import Backend
from powerlib.config import MEASURE_EVENTS_ENV, child_environment
from powerlib.device import Device
from powerlib.errors import InvalidArgumentError
from powerlib.measure_api.events import number, read_events
from powerlib.measure_api.measure import Measurement
from powerlib.measure_api.result import MeasurementResult, finite_json

__all__ = ["FORWARDED", "CommandMeasurement", "run_command"]

FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
"""The signals :func:`run_command` forwards to the child."""


@dataclass(frozen=True, slots=True)
class CommandMeasurement:
    """A command's exit status and the energy the devices used while it ran.

    Attributes:
        command: The command line that ran.
        exit_status: The child's status: its exit code, or ``-N`` when signal ``N`` killed it.
        result: The measurement, with the steps and windows the child reported.
        power_series: Per device id: read times (s after the start) and power (W), the input
            of :func:`~powerlib.measure_api.plot.plot_power`.
    """

    command: tuple[str, ...]
    exit_status: int
    result: MeasurementResult
    power_series: dict[str, tuple[list[float], list[float | None]]]

    @property
    def exit_code(self) -> int:
        """The status a shell reports for the child: its exit code, or ``128 + N`` for signal N."""
        return self.exit_status if self.exit_status >= 0 else 128 - self.exit_status

    def to_json(self) -> dict[str, object]:
        """The result's JSON (``powerlib.measurement/1``) plus ``command`` and ``exit_status``."""
        return self.result.to_json() | {
            "command": list(self.command),
            "exit_status": self.exit_status,
        }


def run_command(
    argv: Sequence[str],
    devices: Iterable[Device | int | str] | None = None,
    *,
    backend: Backend | str | None = None,
    sample_period_s: float = 0.01,
    jsonl: str | os.PathLike[str] | None = None,
    jsonl_interval_s: float = 1.0,
    env: Mapping[str, str] | None = None,
    warn: Callable[[str], None] | None = None,
    stdout: int | None = None,
) -> CommandMeasurement:
    """Run ``argv`` to completion, forwarding signals, and measure the devices meanwhile.

    Args:
        argv: The command and its arguments (the child's stdin and stderr are ours, and its
            stdout unless ``stdout`` says otherwise).
        devices: What to measure (``Device`` objects, indexes or ids of ``backend``'s
            devices); default every device of the backend.
        backend: A :class:`Backend`, a backend name, or ``None`` (``POWERLIB_BACKEND``).
        sample_period_s: How often the devices are read.
        jsonl: While the command runs, append one JSON line per device here every
            ``jsonl_interval_s`` (``time_unix_s`` and the
            :meth:`~powerlib.measure_api.measure.Measurement.snapshot` row).
        jsonl_interval_s: Seconds between those lines.
        env: The child's environment (default this process's), to which
            ``POWERLIB_MEASURE_EVENTS`` is added.
        warn: Called with the one warning line about the child's events file (malformed
            lines, not a regular file, past its size cap; default: logged).
        stdout: A file descriptor for the child's stdout (``None``: ours). ``powerlib measure
            --json`` passes 2, so that its stdout holds nothing but its JSON document.

    Returns:
        The exit status and the measurement; the child's status is returned, never raised.

    Raises:
        InvalidArgumentError: ``argv`` is empty, a bad interval, or the command cannot be
            started (the message names it and why).
        BackendUnavailableError: A backend named explicitly cannot open.
    """
    command = tuple(str(a) for a in argv)
    if not command:
        raise InvalidArgumentError("no command to run")
    if not (math.isfinite(jsonl_interval_s) and jsonl_interval_s > 0):
        raise InvalidArgumentError(
            f"jsonl_interval_s must be a positive number of seconds, got {jsonl_interval_s!r}"
        )
    m = Measurement(
        None if devices is None else list(devices),
        backend=backend,
        sample_period_s=sample_period_s,
        events_path=False,  # the child writes the events file; this measurement only reads it
    )
    # The child owns the run's folder as we do and may share it: the events file is read
    # through a descriptor of the folder taken before the child starts (a folder swapped for a
    # link changes nothing), and a leftover the child made unremovable is no error of ours.
    with tempfile.TemporaryDirectory(prefix="powerlib-measure-", ignore_cleanup_errors=True) as tmp:
        events = Path(tmp) / "events.jsonl"
        child_env = child_environment({MEASURE_EVENTS_ENV: str(events)}, env)
        folder = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            with m:
                status = _run(list(command), child_env, m, jsonl, jsonl_interval_s, stdout)
            record_child_windows(m, read_events(events, warn=warn, dir_fd=folder))
        finally:
            os.close(folder)
    return CommandMeasurement(
        command=command, exit_status=status, result=m.result(), power_series=m.power_series()
    )


def _run(
    argv: list[str],
    env: dict[str, str],
    m: Measurement,
    jsonl_path: str | os.PathLike[str] | None,
    jsonl_interval_s: float,
    stdout: int | None = None,
) -> int:
    """Run the child to completion, forwarding signals; its status (``-N``: killed by N)."""
    try:
        proc = subprocess.Popen(argv, env=env, stdout=stdout, **_own_group())
    except OSError as err:
        raise InvalidArgumentError(f"cannot run {argv[0]!r}: {err.strerror}") from err
    with _foreground(proc.pid), _forwarding(proc):
        jsonl = open(jsonl_path, "a", encoding="utf-8") if jsonl_path is not None else None
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
    """Forward :data:`FORWARDED` to ``proc`` while it runs (main thread only: see the module)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

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
        if (
            threading.current_thread() is threading.main_thread()  # SIGTTOU is ignored there
            and sys.stdin.isatty()
            and os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
        ):
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


def record_child_windows(m: Measurement, events: list[dict[str, object]]) -> None:
    """Record on ``m`` the steps and windows the child reported: the lowest reporting rank's.

    The child's numbers are checked: a window without finite start and end is dropped, and
    tokens that are not a finite number count as unreported (docs/measurement.md §6).
    """
    ranks = [rank for e in events if isinstance(rank := e.get("rank", 0), int)]
    if not ranks:
        return
    first = min(ranks)
    for e in events:
        start_s, end_s = number(e.get("start_s")), number(e.get("end_s"))
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
                tokens=number(e.get("tokens")),
                index=index if isinstance(index := e.get("index"), int) else None,
            )
