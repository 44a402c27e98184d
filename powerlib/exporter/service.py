"""Prometheus metrics of every device, and of the sessions and measurements in this process.

``powerlib exporter --port 9464`` serves them over HTTP, on ``127.0.0.1`` unless ``--addr``
opens it to other hosts, with a fixed pool of threads and a timeout on every request
(docs/measurement.md §7); ``--textfile PATH`` writes them for node_exporter's textfile
collector instead. In a training process::

    from powerlib.exporter import Exporter
    with Exporter(port=9464):             # also publishes powerlib.measure / optimize series
        train()

Built on ``prometheus-client`` (the ``prometheus`` extra), on a registry of its own (the
process's default registry is left alone). A
:class:`~powerlib.exporter.metrics.ReadingCache` thread reads the devices every
``interval_s`` into a cache; a scrape renders the cache and never calls a device, so a
scrape costs the same whatever the driver's latency and cannot slow a training loop's devices.
The exporter only reads: it changes no clock, no limit and writes no journal.
The cache and the metric families are :mod:`powerlib.exporter.metrics`; the bounded
HTTP server is :mod:`powerlib.exporter.server`.

Names follow Prometheus conventions: base units (joules, watts, hertz, celsius, seconds),
``_total`` on counters. Labels match dcgm-exporter's where they mean the same (``gpu``: the
index, ``UUID``, ``device``: e.g. ``nvidia0``, ``modelName``, ``Hostname``), so dashboards built
for ``DCGM_FI_DEV_POWER_USAGE`` need only the metric name changed. Per device at most 13 series.

=================================================  =======  ======================================
metric                                             type     meaning
=================================================  =======  ======================================
``powerlib_device_info``                           gauge 1  labels ``name``, ``vendor``, ``kind``,
                                                            ``backend``, ``energy_source``
``powerlib_device_energy_joules_total``            counter  the device's energy counter
``powerlib_device_power_watts``                    gauge    power draw
``powerlib_device_sm_clock_hertz``                 gauge    compute clock
``powerlib_device_power_limit_watts``              gauge    power limit in force
``powerlib_device_power_limit_min_watts``          gauge    lowest settable limit
``powerlib_device_power_limit_max_watts``          gauge    highest settable limit
``powerlib_device_power_limit_default_watts``      gauge    default limit
``powerlib_device_locked_sm_clock_min_hertz``      gauge    lock floor (when the backend can tell)
``powerlib_device_locked_sm_clock_max_hertz``      gauge    lock ceiling (when the backend can tell)
``powerlib_device_temperature_celsius``            gauge    temperature
``powerlib_device_sample_timestamp_seconds``       gauge    Unix time of the cached reading
``powerlib_device_sample_errors_total``            counter  failed reads
``powerlib_session_steps_total``                   counter  steps of a ``powerlib.measure``
``powerlib_session_step_seconds``                  summary  step time (``_sum``, ``_count``)
``powerlib_session_energy_joules_total``           counter  energy of a measurement's devices
``powerlib_session_tokens_total``                  counter  tokens the steps reported
``powerlib_session_planned_saving_ratio``          gauge    saving the applied plan replayed
``powerlib_session_stage_sm_clock_hertz``          gauge    clock a session last asked its stage
``powerlib_session_measured_saving_ratio``         gauge    saving the closed loop measured
                                                            (labels ``verdict``, ``method``,
                                                            ``judged``; also ``_ci_ratio``,
                                                            and ``slowdown_ratio`` with its
                                                            ``slowdown_ci_ratio``)
=================================================  =======  ======================================
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import stat
import threading
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

from powerlib.backend import Backend
from powerlib.device import Device
from powerlib.errors import InvalidArgumentError
from powerlib.exporter.metrics import ReadingCache, make_registry, prometheus
from powerlib.exporter.server import MetricsServer

__all__ = [
    "DEFAULT_ADDR",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_PORT",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_WORKERS",
    "Exporter",
]

DEFAULT_PORT = 9464
"""The port the exporter listens on by default (OpenTelemetry's Prometheus exporter default)."""
DEFAULT_ADDR = "127.0.0.1"
"""The address it listens on by default: this host only (docs/measurement.md §7 opens it)."""
DEFAULT_TIMEOUT_S = 5.0
"""Seconds a client has to send its whole request, and then to take its whole answer."""
DEFAULT_WORKERS = 8
"""Threads that render answers: a fixed pool, never a thread per connection."""
DEFAULT_MAX_CONNECTIONS = 256
"""Connections held at once; one more closes one not being answered, of the busiest source."""

logger = logging.getLogger(__name__)


class Exporter:
    """Sampler + registry + HTTP server (or textfile writer); a context manager.

    Args:
        devices: Devices to publish (default: every device of ``backend``); ``[]`` publishes
            only sessions and measurements.
        backend: A :class:`Backend`, a backend name, or ``None`` (``POWERLIB_BACKEND``).
        port: HTTP port (``0``: any free port, see :attr:`port`); ``None`` serves nothing.
        addr: Address to listen on. The default, ``127.0.0.1``, serves this host only; for
            Prometheus on other hosts give the node's IP, or ``0.0.0.0`` for every interface
            (the metrics are read-only, but anyone who reaches the port reads them).
        interval_s: Seconds between device reads.
        textfile: Write the metrics here every ``interval_s`` (atomically) instead of, or as
            well as, serving them.
        sessions: Also publish this process's measurements and sessions.
        timeout_s: Seconds a client has to send its whole request, and, once its answer is
            ready, to take it whole; then the connection is closed.
        workers: Threads that render answers (a fixed pool; connections never get their own,
            and one thread sends every answer without blocking).
        max_connections: Connections held at once; one more closes one still waiting for
            its request, of the source holding the most, never one being answered
            (docs/measurement.md §7).
    """

    def __init__(
        self,
        devices: Iterable[Device | int | str] | None = None,
        *,
        backend: Backend | str | None = None,
        port: int | None = DEFAULT_PORT,
        addr: str = DEFAULT_ADDR,
        interval_s: float = 1.0,
        textfile: str | os.PathLike[str] | None = None,
        sessions: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        workers: int = DEFAULT_WORKERS,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        prometheus()
        if port is not None and not 0 <= port <= 65535:
            raise InvalidArgumentError(f"port must be 0-65535, got {port}")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise InvalidArgumentError(f"timeout_s must be positive, got {timeout_s!r}")
        if not 1 <= workers <= 256:
            raise InvalidArgumentError(f"workers must be 1-256, got {workers!r}")
        if not 1 <= max_connections <= 65536:
            raise InvalidArgumentError(f"max_connections must be 1-65536, got {max_connections!r}")
        self.timeout_s = float(timeout_s)
        self._workers = int(workers)
        self._max_connections = int(max_connections)
        self._devices_spec = None if devices is None else list(devices)
        self._backend_spec = backend
        self._port = port
        self._addr = addr
        self.interval_s = interval_s
        self.textfile = Path(textfile) if textfile is not None else None
        self._sessions = sessions
        self._backend: Backend | None = None
        self._own_backend = False
        self.sampler: ReadingCache | None = None
        self.registry: Any = None
        self._server: MetricsServer | None = None
        self._writer: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def port(self) -> int | None:
        """The port served (the one chosen when ``port=0``)."""
        return None if self._server is None else int(self._server.server_port)

    @property
    def address(self) -> tuple[Any, ...] | None:
        """The address served, ``(host, port)`` as bound (``None`` when not serving)."""
        return None if self._server is None else self._server.server_address

    def start(self) -> Exporter:
        """Open the devices, start sampling and serving. Returns ``self``."""
        devices = self._open_devices()
        self.sampler = ReadingCache(devices, self.interval_s) if devices else None
        self.registry = make_registry(self.sampler, sessions=self._sessions)
        if self.sampler is not None:
            self.sampler.start()
        if self._port is not None:
            try:
                self._server = MetricsServer(
                    self._addr,
                    self._port,
                    self.registry,
                    timeout_s=self.timeout_s,
                    workers=self._workers,
                    max_connections=self._max_connections,
                    cache_key=None if self._sessions else self._generation,
                )
            except OSError as err:
                self.close()
                raise InvalidArgumentError(
                    f"cannot listen on {self._addr}:{self._port}: {err.strerror or err}"
                ) from err
        if self.textfile is not None:
            try:
                self.write_textfile()
            except BaseException:
                self.close()  # the sampler and the server stop; a refusal is one line
                raise
            self._writer = threading.Thread(
                target=self._write_loop, name="powerlib-textfile", daemon=True
            )
            self._writer.start()
        return self

    def _generation(self) -> int:
        """What the registry renders changes only with this (no sessions published)."""
        return 0 if self.sampler is None else self.sampler.generation

    def render(self) -> bytes:
        """The metrics in the Prometheus text format (what a scrape returns)."""
        return prometheus().generate_latest(self.registry)  # type: ignore[no-any-return]

    def write_textfile(self) -> None:
        """Write the metrics to :attr:`textfile` atomically (temporary file, then rename).

        Raises:
            InvalidArgumentError: The folder is writable by others without the sticky bit,
                or the target is a symbolic link or not a regular file.
            OSError: The file cannot be written.
        """
        assert self.textfile is not None
        write_file_safely(self.textfile, self.render())

    def _write_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.write_textfile()
            except (OSError, InvalidArgumentError) as err:  # the next write may succeed
                logger.warning("exporter: %s", err)

    def close(self) -> None:
        """Stop serving, writing and sampling; release what it opened. Idempotent."""
        self._stop.set()
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.sampler is not None:
            self.sampler.stop()
        if self._own_backend and self._backend is not None:
            self._backend.close()
            self._own_backend = False

    def __enter__(self) -> Exporter:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _open_devices(self) -> list[Device]:
        spec = self._devices_spec
        if spec == []:
            return []
        if isinstance(self._backend_spec, Backend):
            self._backend = self._backend_spec
        elif not (spec and all(isinstance(d, Device) for d in spec)):
            from powerlib.registry import open_backend  # noqa: PLC0415 - a backend opens only when no devices are given

            self._backend = open_backend(self._backend_spec)
            self._own_backend = True
        if spec is None:
            assert self._backend is not None
            return list(self._backend.devices())
        out = []
        for d in spec:
            if isinstance(d, Device):
                out.append(d)
            else:
                assert self._backend is not None
                out.append(self._backend.device(d))
        return out


def write_file_safely(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically, following no link an other user planted.

    ``powerlib exporter --textfile`` often runs as root, into a folder node_exporter reads
    and that may be shared. The temporary file has an unpredictable name and is created in
    the folder's descriptor with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a planted name or link
    fails the create, it is never followed), written, fsynced and renamed over ``path``
    (docs/agent.md §5).

    Raises:
        InvalidArgumentError: The folder is writable by others without the sticky bit (they
            could replace the file between the write and the rename), or ``path`` is a
            symbolic link or not a regular file.
        OSError: The folder cannot be opened, or the file written.
    """
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        mode = os.fstat(folder).st_mode
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            raise InvalidArgumentError(
                f"refusing to write {path}: its folder is writable by all without the sticky bit"
            )
        try:
            target = os.stat(path.name, dir_fd=folder, follow_symlinks=False).st_mode
        except FileNotFoundError:
            target = stat.S_IFREG
        if not stat.S_ISREG(target):
            what = "a symbolic link" if stat.S_ISLNK(target) else "not a regular file"
            raise InvalidArgumentError(f"refusing to write {path}: it is {what}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for _ in range(100):
            temp = f".{path.name}.{secrets.token_hex(8)}.tmp"
            try:
                fd = os.open(temp, flags, 0o644, dir_fd=folder)
                break
            except FileExistsError:  # a name someone took (2**64 of them): draw again
                continue
        else:
            raise FileExistsError(f"no free temporary name next to {path}")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=folder)
            raise
    finally:
        os.close(folder)
