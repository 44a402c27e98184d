"""Prometheus metrics of every device, and of the sessions and measurements in this process.

``powerlib exporter --port 9464`` serves them over HTTP, on ``127.0.0.1`` unless ``--addr``
opens it to other hosts, with a fixed pool of threads and a timeout on every request
(docs/measurement.md §7); ``--textfile PATH`` writes them for node_exporter's textfile
collector instead. In a training process::

    from powerlib.exporter import Exporter
    with Exporter(port=9464):             # also publishes powerlib.measure / optimize series
        train()

Built on ``prometheus-client`` (the ``prometheus`` extra), on a registry of its own (the
process's default registry is left alone). A :class:`DeviceSampler` thread reads the devices
every ``interval_s`` into a cache; a scrape renders the cache and never calls a device, so a
scrape costs the same whatever the driver's latency and cannot slow a training loop's devices.
The exporter only reads: it changes no clock, no limit and writes no journal.

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
=================================================  =======  ======================================
"""

from __future__ import annotations

import errno
import http.server
import io
import logging
import math
import os
import queue
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from powerlib.device import Backend, Device, PowerState
from powerlib.errors import BackendUnavailableError, InvalidArgumentError, PowerlibError

__all__ = [
    "DEFAULT_ADDR",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_PORT",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_WORKERS",
    "DeviceSampler",
    "Exporter",
    "make_registry",
]

logger = logging.getLogger(__name__)

DEFAULT_PORT = 9464
"""The port the exporter listens on by default (OpenTelemetry's Prometheus exporter default)."""
DEFAULT_ADDR = "127.0.0.1"
"""The address it listens on by default: this host only (docs/measurement.md §7 opens it)."""
DEFAULT_TIMEOUT_S = 5.0
"""Seconds a client has to send its whole request, and then to take its whole answer."""
DEFAULT_WORKERS = 8
"""Threads that render answers: a fixed pool, never a thread per connection."""
DEFAULT_MAX_CONNECTIONS = 256
"""Connections held at once; one more closes the oldest open one."""
_MAX_REQUEST_BYTES = 8192  # a scrape's request line and headers are a few hundred bytes
_BACKLOG = 64  # the listening socket's accept queue

_MHZ = 1e6


def _prometheus() -> Any:
    try:
        import prometheus_client  # noqa: PLC0415 - optional extra
    except ImportError as err:
        raise BackendUnavailableError(
            "the exporter needs prometheus-client: pip install 'powerlib[prometheus]'"
        ) from err
    return prometheus_client


@dataclass(frozen=True, slots=True)
class _Cached:
    state: PowerState | None
    energy_j: float
    sampled_unix_s: float
    errors: int


class DeviceSampler:
    """Reads devices every ``interval_s`` on a thread of its own; scrapes read its cache.

    Energy is the device's own counter where it has one (NVML's counts since the driver
    loaded, like dcgm-exporter's ``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION``; a device reset is a
    counter reset, which Prometheus's ``rate()`` handles), else power integrated since the
    sampler started.

    Args:
        devices: The devices.
        interval_s: Seconds between reads.
    """

    def __init__(self, devices: Sequence[Device], interval_s: float = 1.0) -> None:
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise InvalidArgumentError(f"interval_s must be positive, got {interval_s!r}")
        self.devices = list(devices)
        self.interval_s = float(interval_s)
        self._lock = threading.Lock()
        self._cache: dict[str, _Cached] = {}
        self._last: dict[str, tuple[float, float | None, float | None]] = {}
        self._energy: dict[str, float] = {}
        self._errors: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.generation = 0
        """Bumped after every full read of the devices (renders are cached per generation)."""
        self.sample()

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._loop, name="powerlib-exporter", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        """Read every device once into the cache."""
        for dev in self.devices:
            key = dev.device_id
            now = time.monotonic()
            try:
                state: PowerState | None = dev.read_state()
            except PowerlibError:
                state = None
                self._errors[key] = self._errors.get(key, 0) + 1
            energy = self._energy.get(key, 0.0)
            if state is not None:
                last = self._last.get(key)
                if state.energy_j is not None:
                    energy = state.energy_j  # the device's own counter; a reset is a reset
                elif last is not None:  # no counter: power integrated (trapezoid) since start
                    t0, _, power0 = last
                    watts = [w for w in (power0, state.power_w) if w is not None]
                    if watts:
                        energy += sum(watts) / len(watts) * (now - t0)
                self._last[key] = (now, state.energy_j, state.power_w)
                self._energy[key] = energy
            previous = self._cache.get(key)
            cached = _Cached(
                state=state if state is not None else (previous.state if previous else None),
                energy_j=energy,
                sampled_unix_s=time.time()
                if state is not None
                else (previous.sampled_unix_s if previous else 0.0),
                errors=self._errors.get(key, 0),
            )
            with self._lock:
                self._cache[key] = cached
        self.generation += 1

    def cached(self) -> dict[str, _Cached]:
        """The latest reading of each device (a copy)."""
        with self._lock:
            return dict(self._cache)


def _device_labels(dev: Device, hostname: str) -> dict[str, str]:
    info = dev.info
    return {
        "gpu": str(info.index),
        "UUID": info.device_id,
        "device": f"{info.vendor}{info.index}" if info.kind.value == "gpu" else f"cpu{info.index}",
        "modelName": info.name,
        "Hostname": hostname,
    }


class _Collector:
    """Renders the sampler's cache, and this process's sessions and measurements."""

    def __init__(self, sampler: DeviceSampler | None, hostname: str, *, sessions: bool) -> None:
        self._sampler = sampler
        self._hostname = hostname
        self._sessions = sessions
        self._rendered: tuple[int, list[Any]] | None = None  # (generation, device families)

    def describe(self) -> list[Any]:
        return []  # unchecked collector: names vary with what is running

    def collect(self) -> Iterator[Any]:
        _prometheus()
        import prometheus_client.core as core  # noqa: PLC0415 - optional extra

        if self._sampler is not None:
            generation = self._sampler.generation
            cached = self._rendered
            if cached is None or cached[0] != generation:
                cached = (generation, list(self._devices(core)))
                self._rendered = cached
            yield from cached[1]
        if self._sessions:
            yield from self._session_metrics(core)

    def _devices(self, core: Any) -> Iterator[Any]:
        assert self._sampler is not None
        keys = ["gpu", "UUID", "device", "modelName", "Hostname"]
        fam = {
            "info": core.GaugeMetricFamily(
                "powerlib_device_info",
                "Device identity (value 1)",
                labels=[*keys, "name", "vendor", "kind", "backend", "energy_source"],
            ),
            "energy": core.CounterMetricFamily(
                "powerlib_device_energy_joules",
                "Energy counter (J): the device's own, or power integrated since the exporter started",
                labels=keys,
            ),
            "power": core.GaugeMetricFamily("powerlib_device_power_watts", "Power draw (W)", labels=keys),
            "clock": core.GaugeMetricFamily("powerlib_device_sm_clock_hertz", "Compute (SM) clock (Hz)", labels=keys),
            "limit": core.GaugeMetricFamily("powerlib_device_power_limit_watts", "Power limit in force (W)", labels=keys),
            "limit_min": core.GaugeMetricFamily("powerlib_device_power_limit_min_watts", "Lowest settable power limit (W)", labels=keys),
            "limit_max": core.GaugeMetricFamily("powerlib_device_power_limit_max_watts", "Highest settable power limit (W)", labels=keys),
            "limit_default": core.GaugeMetricFamily("powerlib_device_power_limit_default_watts", "Default power limit (W)", labels=keys),
            "lock_min": core.GaugeMetricFamily("powerlib_device_locked_sm_clock_min_hertz", "Locked compute clock floor (Hz)", labels=keys),
            "lock_max": core.GaugeMetricFamily("powerlib_device_locked_sm_clock_max_hertz", "Locked compute clock ceiling (Hz)", labels=keys),
            "temp": core.GaugeMetricFamily("powerlib_device_temperature_celsius", "Temperature (C)", labels=keys),
            "stamp": core.GaugeMetricFamily("powerlib_device_sample_timestamp_seconds", "Unix time of the cached reading (s)", labels=keys),
            "errors": core.CounterMetricFamily("powerlib_device_sample_errors", "Failed device reads", labels=keys),
        }  # fmt: skip
        cache = self._sampler.cached()
        for dev in self._sampler.devices:
            info = dev.info
            labels = _device_labels(dev, self._hostname)
            values = [labels[k] for k in keys]
            source = "counter" if info.capabilities.has_energy_counter else "integrated"
            fam["info"].add_metric(
                [*values, info.name, info.vendor, info.kind.value, info.backend, source], 1.0
            )
            entry = cache.get(info.device_id)
            if entry is None:
                continue
            fam["energy"].add_metric(values, entry.energy_j)
            fam["errors"].add_metric(values, float(entry.errors))
            if info.power_limit_range_w is not None:
                fam["limit_min"].add_metric(values, info.power_limit_range_w[0])
                fam["limit_max"].add_metric(values, info.power_limit_range_w[1])
            if info.default_power_limit_w is not None:
                fam["limit_default"].add_metric(values, info.default_power_limit_w)
            st = entry.state
            if st is None:
                continue
            fam["stamp"].add_metric(values, entry.sampled_unix_s)
            for name, value, scale in (
                ("power", st.power_w, 1.0),
                ("clock", st.sm_freq_mhz, _MHZ),
                ("limit", st.power_limit_w, 1.0),
                ("temp", st.temperature_c, 1.0),
            ):
                if value is not None:
                    fam[name].add_metric(values, value * scale)
            if st.locked_sm_freqs_mhz is not None:
                fam["lock_min"].add_metric(values, st.locked_sm_freqs_mhz[0] * _MHZ)
                fam["lock_max"].add_metric(values, st.locked_sm_freqs_mhz[1] * _MHZ)
        yield from fam.values()

    def _session_metrics(self, core: Any) -> Iterator[Any]:
        from powerlib.measurement import active_measurements  # noqa: PLC0415

        labels = ["measurement", "rank", "Hostname"]
        steps = core.CounterMetricFamily("powerlib_session_steps", "Steps measured", labels=labels)
        step_s = core.SummaryMetricFamily(
            "powerlib_session_step_seconds", "Step time (s)", labels=labels
        )
        energy = core.CounterMetricFamily(
            "powerlib_session_energy_joules", "Energy of the measured devices (J)", labels=labels
        )
        tokens = core.CounterMetricFamily(
            "powerlib_session_tokens", "Tokens the steps reported", labels=labels
        )
        for i, m in enumerate(active_measurements()):
            values = [str(i), str(m.rank), self._hostname]
            done = [w for w in list(m.windows) if w.kind == "step" and w.end_s is not None]
            steps.add_metric(values, float(len(done)))
            step_s.add_metric(values, len(done), math.fsum(w.end_s - w.start_s for w in done))  # type: ignore[operator]
            energy.add_metric(values, math.fsum(s["energy_j"] or 0.0 for s in m.snapshot()))
            tokens.add_metric(values, math.fsum(w.tokens or 0.0 for w in done))
        yield from (steps, step_s, energy, tokens)
        from powerlib.runtime.session import active_sessions  # noqa: PLC0415

        saving = core.GaugeMetricFamily(
            "powerlib_session_planned_saving_ratio",
            "Energy saving of the applied plan, replayed on the profile (fraction)",
            labels=["stage", "Hostname"],
        )
        clock = core.GaugeMetricFamily(
            "powerlib_session_stage_sm_clock_hertz",
            "Clock the session last asked for its stage (Hz)",
            labels=["stage", "Hostname"],
        )
        for s in active_sessions():
            values = [str(s.stage), self._hostname]
            summary = s.outcome.summary if s.outcome is not None else None
            pct = ((summary or {}).get("realized") or {}).get("saving_percent")
            if isinstance(pct, (int, float)):
                saving.add_metric(values, pct / 100.0)
            freq = s.controller.last_requested if s.controller is not None else None
            if freq is not None:
                clock.add_metric(values, freq * _MHZ)
        yield from (saving, clock)


def make_registry(
    sampler: DeviceSampler | None, *, sessions: bool = True, hostname: str | None = None
) -> Any:
    """A ``prometheus_client.CollectorRegistry`` with powerlib's collector (and nothing else)."""
    prom = _prometheus()
    registry = prom.CollectorRegistry(auto_describe=False)
    registry.register(_Collector(sampler, hostname or socket.gethostname(), sessions=sessions))
    return registry


class _Buffer:
    """The handler's ``wfile``: the answer is collected here; the selector thread sends it."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.chunks.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass


class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    """Renders the answer to one request that :class:`_MetricsServer` has already read whole.

    ``GET`` and ``HEAD`` of ``/metrics`` (a query string is ignored) return the registry in the
    format the ``Accept`` header asks for (Prometheus text, or OpenMetrics); any other path is
    404 and any other method 501. Nothing a request says changes anything. The answer goes to
    a buffer, never to the socket: the server's selector thread sends it.
    """

    server: _MetricsServer  # type: ignore[assignment]
    server_version = "powerlib-exporter"
    sys_version = ""

    def setup(self) -> None:
        data, out = self.request
        self.rfile = io.BytesIO(data)
        self.wfile = out

    def finish(self) -> None:
        pass  # the server sends the buffer and closes the socket

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._metrics(body=True)

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
        self._metrics(body=False)

    def _metrics(self, *, body: bool) -> None:
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404, "only /metrics is served")
            return
        exposition = _prometheus().exposition
        encoder, content_type = exposition.choose_encoder(self.headers.get("Accept") or "")
        try:
            output = self.server.render(encoder, content_type)
        except Exception:  # a collector bug: answer, log once per scrape
            logger.exception("exporter: rendering the metrics failed")
            self.send_error(500)
            return
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(output)))
        self.end_headers()
        if body:
            self.wfile.write(output)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        pass  # a scrape every 15 s is not news; a bad request gets its answer


_READING, _WORKING, _SENDING, _CLOSED = range(4)  # a connection's states, in order


class _Conn:
    """One connection: its request so far, then what is left of its answer to send.

    ``deadline`` is when the request must be whole (``_READING``), or when the answer must
    have been taken whole (``_SENDING``); a worker rendering the answer (``_WORKING``) has none.
    """

    __slots__ = ("addr", "buf", "deadline", "out", "request", "sent", "sock", "state", "watched")

    def __init__(self, sock: socket.socket, addr: Any, deadline: float) -> None:
        self.sock = sock
        self.addr = addr
        self.buf = bytearray()
        self.deadline = deadline
        self.state = _READING
        self.request = b""
        self.out: list[memoryview] = []  # the answer's chunks not sent whole (a render is shared)
        self.sent = 0  # bytes of out[0] sent
        self.watched = False  # registered with the selector


_LISTEN = object()
_WAKE = object()
_RESUME_ACCEPT_S = 0.1  # out of descriptors with nothing to close: try accept again after this
_RENDER_CACHE_ENTRIES = 4  # content types whose answer is kept (the Accept header picks it)


class _MetricsServer:
    """An HTTP server for ``/metrics`` whose threads, connections and their time are bounded.

    One thread owns every socket: it accepts connections, reads requests and sends answers
    through a selector, never blocking. A request (request line and headers, at most 8 KiB)
    must arrive whole within ``timeout_s`` of the connection's accept, and its answer must be
    taken whole within ``timeout_s`` of the moment it is ready, or the connection is closed. A
    fixed pool of ``workers`` threads only renders answers into bytes (cached while
    ``cache_key`` returns the same value), so no client holds a thread, whether it sends
    slowly or reads slowly. At most ``max_connections`` are open at once: one more closes the
    oldest open connection, whatever it still waits for, so a new scraper always gets in
    (docs/measurement.md §7).

    Args:
        addr: Address to listen on (a name is resolved; IPv6 works).
        port: Port (``0``: any free port, see :attr:`server_port`).
        registry: What ``/metrics`` renders.
        timeout_s: Seconds for a request to arrive whole, and for its answer to be taken.
        workers: Threads that render answers.
        max_connections: Connections held at once.
        cache_key: Returns a value that changes whenever the registry's output may have
            changed; ``None`` (or a function that returns ``None``) renders every request.

    Raises:
        OSError: The address cannot be resolved or listened on.
    """

    def __init__(
        self,
        addr: str,
        port: int,
        registry: Any,
        *,
        timeout_s: float,
        workers: int,
        max_connections: int,
        cache_key: Callable[[], object] | None = None,
    ) -> None:
        self.registry = registry
        self.timeout_s = timeout_s
        self._max_connections = max_connections
        self._cache_key = cache_key
        self._rendered: dict[str, tuple[object, bytes]] = {}  # content type: (key, output)
        family, _, _, _, sockaddr = socket.getaddrinfo(
            addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self._listener = socket.create_server(sockaddr, family=family, backlog=_BACKLOG)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, _LISTEN)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        # Only the selector thread touches these (and the sockets in them).
        self._conns: OrderedDict[_Conn, None] = OrderedDict()  # accept order: the oldest first
        self._reading: OrderedDict[_Conn, None] = OrderedDict()  # deadline order
        self._sending: OrderedDict[_Conn, None] = OrderedDict()  # deadline order
        self._queue: queue.SimpleQueue[_Conn | None] = queue.SimpleQueue()  # to the workers
        self._done: queue.SimpleQueue[tuple[_Conn, list[bytes]]] = queue.SimpleQueue()  # answers
        self._resume_accept_at: float | None = None
        self._stopping = False
        self._workers = [
            threading.Thread(target=self._work, name=f"powerlib-exporter-http-{i}", daemon=True)
            for i in range(workers)
        ]
        self._thread = threading.Thread(
            target=self._serve, name="powerlib-exporter-http", daemon=True
        )
        for t in self._workers:
            t.start()
        self._thread.start()

    @property
    def server_port(self) -> int:
        """The port listened on."""
        return int(self._listener.getsockname()[1])

    @property
    def server_address(self) -> tuple[Any, ...]:
        """The address listened on (``host, port``)."""
        return tuple(self._listener.getsockname())

    def close(self) -> None:
        """Stop accepting, close every connection, and stop the threads. Idempotent."""
        self._stopping = True
        self._wake()
        self._thread.join()
        for t in self._workers:
            t.join()
        self._wake_w.close()

    def render(self, encoder: Callable[[Any], bytes], content_type: str) -> bytes:
        """The registry in ``encoder``'s format, rendered again only when ``cache_key`` changes."""
        key = None if self._cache_key is None else self._cache_key()
        if key is None:
            return encoder(self.registry)
        hit = self._rendered.get(content_type)
        if hit is not None and hit[0] == key:
            return hit[1]
        output = encoder(self.registry)
        if len(self._rendered) >= _RENDER_CACHE_ENTRIES and content_type not in self._rendered:
            self._rendered.clear()  # the client picks the content type: it must not grow this
        self._rendered[content_type] = (key, output)
        return output

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # full: the selector thread has wake-ups to read already
            pass

    # -- the selector thread ----------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._stopping:
                for key, _ in self._selector.select(self._next_timeout(time.monotonic())):
                    conn = key.data
                    if conn is _LISTEN:
                        self._accept()
                    elif conn is _WAKE:
                        while True:
                            try:
                                if not self._wake_r.recv(4096):
                                    break
                            except OSError:
                                break
                    elif conn.state == _READING:
                        self._read(conn)
                    elif conn.state == _SENDING:
                        self._send(conn)
                self._take_answers()
                self._expire(time.monotonic())
        finally:
            for conn in list(self._conns):
                self._close(conn)
            self._selector.close()
            self._listener.close()
            self._wake_r.close()
            for _ in self._workers:
                self._queue.put(None)

    def _next_timeout(self, now: float) -> float | None:
        waits = [
            next(iter(table)).deadline - now for table in (self._reading, self._sending) if table
        ]
        if self._resume_accept_at is not None:
            waits.append(self._resume_accept_at - now)
        return max(0.0, min(waits)) if waits else None

    def _expire(self, now: float) -> None:
        for table in (self._reading, self._sending):
            while table:
                conn = next(iter(table))
                if conn.deadline > now:
                    break
                self._close(conn)  # a request not whole, or an answer not taken, in time
        if self._resume_accept_at is not None and now >= self._resume_accept_at:
            self._resume_accept_at = None
            self._selector.register(self._listener, selectors.EVENT_READ, _LISTEN)

    def _accept(self) -> None:
        for _ in range(_BACKLOG):
            try:
                sock, addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as err:
                if err.errno == errno.ECONNABORTED:
                    continue
                if self._conns:  # out of descriptors (EMFILE): the oldest connection goes
                    self._close(next(iter(self._conns)))
                    continue
                self._selector.unregister(self._listener)
                self._resume_accept_at = time.monotonic() + _RESUME_ACCEPT_S
                logger.warning("exporter: cannot accept connections: %s", err.strerror)
                return
            if len(self._conns) >= self._max_connections:
                # Full: the oldest goes, whether it still sends its request, waits for its
                # answer or does not take it. No connection holds a thread, so any can go,
                # and a new scraper always gets in.
                self._close(next(iter(self._conns)))
            sock.setblocking(False)
            conn = _Conn(sock, addr, time.monotonic() + self.timeout_s)
            self._conns[conn] = None
            self._reading[conn] = None
            self._watch(conn, selectors.EVENT_READ)

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        if not chunk:
            self._close(conn)
            return
        start = max(0, len(conn.buf) - 3)
        conn.buf += chunk
        if len(conn.buf) > _MAX_REQUEST_BYTES:
            self._answer(conn, [b"HTTP/1.0 431 Request Header Fields Too Large\r\n\r\n"])
            return
        tail = conn.buf[start:]
        if b"\r\n\r\n" not in tail and b"\n\n" not in tail:
            return
        del self._reading[conn]
        self._unwatch(conn)
        conn.request = bytes(conn.buf)
        conn.buf = bytearray()
        conn.state = _WORKING
        self._queue.put(conn)

    def _take_answers(self) -> None:
        while True:
            try:
                conn, data = self._done.get_nowait()
            except queue.Empty:
                return
            if conn.state == _WORKING:  # else closed while rendered: the answer is dropped
                self._answer(conn, data)

    def _answer(self, conn: _Conn, data: list[bytes]) -> None:
        """Start sending ``data``: it must be taken whole within ``timeout_s`` from now."""
        if conn.state == _READING:
            del self._reading[conn]
        self._unwatch(conn)
        conn.state = _SENDING
        conn.out = [memoryview(chunk) for chunk in data]
        conn.sent = 0
        conn.deadline = time.monotonic() + self.timeout_s
        self._sending[conn] = None
        self._send(conn)

    def _send(self, conn: _Conn) -> None:
        try:
            while conn.out:
                conn.sent += conn.sock.send(conn.out[0][conn.sent :])
                if conn.sent == len(conn.out[0]):
                    del conn.out[0]
                    conn.sent = 0
        except BlockingIOError:  # the client's window is full: wait until it reads
            if not conn.watched:
                self._watch(conn, selectors.EVENT_WRITE)
            return
        except OSError:  # the client left
            pass
        self._close(conn)  # one request per connection (HTTP/1.0)

    def _watch(self, conn: _Conn, events: int) -> None:
        self._selector.register(conn.sock, events, conn)
        conn.watched = True

    def _unwatch(self, conn: _Conn) -> None:
        if conn.watched:
            self._selector.unregister(conn.sock)
            conn.watched = False

    def _close(self, conn: _Conn) -> None:
        if conn.state == _CLOSED:
            return
        if conn.state == _READING:
            del self._reading[conn]
        elif conn.state == _SENDING:
            del self._sending[conn]
        conn.state = _CLOSED  # a worker skips it, or its answer is dropped
        conn.request = b""
        conn.out = []
        self._unwatch(conn)
        del self._conns[conn]
        conn.sock.close()

    # -- the workers: they render, and never touch a socket ----------------------------------

    def _work(self) -> None:
        while (conn := self._queue.get()) is not None:
            request = conn.request
            if conn.state != _WORKING:  # closed while queued: evicted, or the server stops
                continue
            try:
                out = _Buffer()
                _MetricsHandler((request, out), conn.addr, self)  # type: ignore[arg-type]
                data = out.chunks  # the body is the render itself, not a copy
            except Exception:  # a worker that died would shrink the pool for good
                logger.exception("exporter: answering %s failed", conn.addr)
                data = []  # closes the connection
            self._done.put((conn, data))
            self._wake()


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
        max_connections: Connections held at once; one more closes the oldest open one
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
        _prometheus()
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
        self.sampler: DeviceSampler | None = None
        self.registry: Any = None
        self._server: _MetricsServer | None = None
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
        self.sampler = DeviceSampler(devices, self.interval_s) if devices else None
        self.registry = make_registry(self.sampler, sessions=self._sessions)
        if self.sampler is not None:
            self.sampler.start()
        if self._port is not None:
            try:
                self._server = _MetricsServer(
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
            self.write_textfile()
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
        return _prometheus().generate_latest(self.registry)  # type: ignore[no-any-return]

    def write_textfile(self) -> None:
        """Write the metrics to :attr:`textfile` atomically (temporary file, then rename)."""
        assert self.textfile is not None
        _prometheus().write_to_textfile(str(self.textfile), self.registry)

    def _write_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.write_textfile()
            except OSError:
                continue

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
            from powerlib.registry import open_backend  # noqa: PLC0415

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
