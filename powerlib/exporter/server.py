"""The exporter's HTTP server: ``/metrics`` with bounded threads, connections and time.

One selector thread owns every socket and never blocks; a fixed pool of workers only renders
answers; a request must arrive whole, and its answer be taken whole, within ``timeout_s``; one
connection over ``max_connections`` closes one not being answered, of the busiest source
(powerlib/exporter/sources.py). It often runs as root on a shared node, so no client can hold
a thread, grow its memory or push out a scrape (docs/measurement.md §7).
"""

from __future__ import annotations

import errno
import http.server
import io
import logging
import queue
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from powerlib.exporter.metrics import prometheus
from powerlib.exporter.sources import ANSWERED, IDLE, Sources, address_source

__all__ = ["MetricsServer"]

logger = logging.getLogger(__name__)

_MAX_REQUEST_BYTES = 8192  # a scrape's request line and headers are a few hundred bytes
# The listening socket's accept queue. A full queue drops a new connection's SYN, and the
# client retries it after 1 s, then 3 s: a user who opens connections faster than a turn of
# the loop takes them would stall every scrape. Its connections cost the kernel a few KB each.
_BACKLOG = 1024


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
    """Renders the answer to one request that :class:`MetricsServer` has already read whole.

    ``GET`` and ``HEAD`` of ``/metrics`` (a query string is ignored) return the registry in the
    format the ``Accept`` header asks for (Prometheus text, or OpenMetrics); any other path is
    404 and any other method 501. Nothing a request says changes anything. The answer goes to
    a buffer, never to the socket: the server's selector thread sends it.
    """

    server: MetricsServer  # type: ignore[assignment]
    server_version = "powerlib-exporter"
    sys_version = ""

    def setup(self) -> None:
        data, out = self.request
        self.rfile = io.BytesIO(data)
        self.wfile = out

    def finish(self) -> None:
        pass  # the server sends the buffer and closes the socket

    def do_GET(self) -> None:  # http.server's naming
        self._metrics(body=True)

    def do_HEAD(self) -> None:  # http.server's naming
        self._metrics(body=False)

    def _metrics(self, *, body: bool) -> None:
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404, "only /metrics is served")
            return
        exposition = prometheus().exposition
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

    def log_message(self, format: str, *args: Any) -> None:  # http.server's name
        pass  # a scrape every 15 s is not news; a bad request gets its answer


_READING, _WORKING, _SENDING, _CLOSED = range(4)  # a connection's states, in order


class _Conn:
    """One connection: its request so far, then what is left of its answer to send.

    ``deadline`` is when the request must be whole (``_READING``), or when the answer must
    have been taken whole (``_SENDING``); a worker rendering the answer (``_WORKING``) has none.
    """

    __slots__ = (
        "addr",
        "buf",
        "deadline",
        "out",
        "request",
        "sent",
        "sock",
        "source",
        "state",
        "watched",
    )

    def __init__(self, sock: socket.socket, addr: Any, source: object, deadline: float) -> None:
        self.sock = sock
        self.addr = addr
        self.source = source  # who it counts against (powerlib/exporter/sources.py)
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


class MetricsServer:
    """An HTTP server for ``/metrics`` whose threads, connections and their time are bounded.

    One thread owns every socket: it accepts connections, reads requests and sends answers
    through a selector, never blocking. A request (request line and headers, at most 8 KiB)
    must arrive whole within ``timeout_s`` of the connection's accept, and its answer must be
    taken whole within ``timeout_s`` of the moment it is ready, or the connection is closed. A
    fixed pool of ``workers`` threads only renders answers into bytes (cached while
    ``cache_key`` returns the same value), so no client holds a thread, whether it sends
    slowly or reads slowly. At most ``max_connections`` are open at once: one more closes one
    still waiting for its request (else one not taking its answer) of the source holding the
    most connections, never a request being rendered; if every one is, new ones wait in the
    accept queue until one is answered (docs/measurement.md §7).

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
        self._sources = Sources()
        self._listening = True  # the listener is registered with the selector
        self._full = False  # stopped accepting: every connection holds a request being rendered
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
                accept = False
                for key, _ in self._selector.select(self._next_timeout(time.monotonic())):
                    conn = key.data
                    if conn is _LISTEN:
                        accept = True  # last: requests that arrived go before new connections
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
                if accept and self._listening:
                    self._accept()
                elif self._full and self._has_room():
                    self._full = False
                    self._listen(True)
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
            self._listen(True)

    def _listen(self, on: bool) -> None:
        if on and not self._listening:
            self._selector.register(self._listener, selectors.EVENT_READ, _LISTEN)
        elif not on and self._listening:
            self._selector.unregister(self._listener)
        self._listening = on

    def _has_room(self) -> bool:
        return len(self._conns) < self._max_connections or self._victim() is not None

    def _victim(self) -> _Conn | None:
        """The connection to close to make room, ``None`` if every one is being rendered.

        A request not yet whole (nothing, or part of it), the oldest of the source (the
        peer's address) that holds the most connections; failing that, an
        answer not taken, chosen the same way; never a request being rendered. A user who
        opens connections, sends part of a request or nothing and closes them, over and over,
        closes only its own (docs/measurement.md §7, powerlib/exporter/sources.py).
        """
        victim: _Conn | None = self._sources.victim(IDLE) or self._sources.victim(ANSWERED)
        return victim

    def _accept(self) -> None:
        # Fewer per turn than the table holds: a request that arrives just after its
        # connection is taken is read in the next turn, before new ones can push it out.
        for _ in range(min(_BACKLOG, max(1, self._max_connections // 2))):
            if not self._has_room():  # every one holds a request being rendered: new ones
                self._full = True  # wait in the accept queue until one is answered
                self._listen(False)
                return
            try:
                sock, addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as err:
                if err.errno == errno.ECONNABORTED:
                    continue
                victim = self._victim()
                if victim is not None:  # out of descriptors (EMFILE): make room as when full
                    self._close(victim)
                    continue
                self._listen(False)
                self._resume_accept_at = time.monotonic() + _RESUME_ACCEPT_S
                logger.warning("exporter: cannot accept connections: %s", err.strerror)
                return
            victim = self._victim() if len(self._conns) >= self._max_connections else None
            if victim is not None:  # full: make room (_has_room found one)
                self._close(victim)
            sock.setblocking(False)
            source = address_source(addr)
            conn = _Conn(sock, addr, source, time.monotonic() + self.timeout_s)
            self._conns[conn] = None
            self._reading[conn] = None
            self._sources.add(conn)
            self._sources.enter(conn, IDLE)
            self._read(conn)  # a scrape sends its request at once: it is whole already
            if conn.state == _READING:
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
        self._sources.leave(conn, IDLE)
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
            self._sources.leave(conn, IDLE)
        self._unwatch(conn)
        conn.state = _SENDING
        conn.out = [memoryview(chunk) for chunk in data]
        conn.sent = 0
        conn.deadline = time.monotonic() + self.timeout_s
        self._sending[conn] = None
        self._sources.enter(conn, ANSWERED)
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
            self._sources.leave(conn, IDLE)
        elif conn.state == _SENDING:
            del self._sending[conn]
            self._sources.leave(conn, ANSWERED)
        self._sources.remove(conn)
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
