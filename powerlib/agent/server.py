"""``powerlib agent``: the node daemon that owns the devices and leases them per job.

A training job does not run as root, and clocks and power limits need root. The agent does (one
per node, under systemd); jobs ask it over a Unix socket (:mod:`powerlib.agent.protocol`), and it
changes a device only for a client that a rule admits (:mod:`powerlib.agent.authz`), only while
that client holds the device's lease, and puts the device back the moment the client goes
(docs/agent.md):

* **Lease = connection.** A client's first change of a device takes its lease (one owner per
  device; another client gets ``DeviceBusyError`` naming the owner's uid, pid and job). Each
  lease is a :class:`~powerlib.control.ControlSession` of the agent's, so every change is
  journaled before it is made. When the connection closes, or the client process dies (a pidfd:
  this catches a forked child that keeps the socket), each of its devices is restored to what it
  was before the lease, compare-then-restore, one device at a time so one failure stops no other.
* **Crash safety.** An agent that starts restores whatever journals a dead agent left before it
  serves anyone; it holds a lock file so that two agents never serve one state folder.
* **Hostile clients.** Lines are capped (:data:`~powerlib.agent.protocol.MAX_LINE_BYTES`), a
  partial line must complete within ``line_timeout_s``, each connection is rate limited, each
  uid may hold a bounded number of connections, and every connection is its own coroutine, so a
  slow or flooding client delays only itself. Device calls run on a thread pool, never on the
  event loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import fcntl
import grp
import itertools
import logging
import os
import resource
import select
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from powerlib.agent import protocol
from powerlib.agent.authz import Rules
from powerlib.agent.logs import LogLimiter
from powerlib.agent.node import let_others_traverse
from powerlib.agent.peer import Peer, peer_of, pidfd_of
from powerlib.control import ControlSession
from powerlib.device import Backend, Device, normalize_pci
from powerlib.errors import (
    ConfigError,
    DeviceBusyError,
    DeviceLostError,
    DeviceNotFoundError,
    PermissionDeniedError,
    PowerlibError,
)
from powerlib.control import check_trusted, show_path
from powerlib.control import restore_journals

__all__ = ["Agent", "AgentEvent", "sd_notify"]

logger = logging.getLogger(__name__)

SD_LISTEN_FDS_START = 3
_OFFLOAD_CALLS = 100
"""After a slow call, how many of that device's calls go to the thread pool before one is tried
inline again."""


@dataclass
class AgentEvent:
    """A lease that ended, with its timing (monotonic seconds): what the benchmark reads."""

    device_id: str
    pid: int
    uid: int
    reason: str
    detected_s: float
    restore_started_s: float = float("nan")
    restore_done_s: float = float("nan")
    ok: bool = False


@dataclass
class _Client:
    id: int
    peer: Peer
    writer: asyncio.StreamWriter
    pidfd: int | None = None
    leases: dict[str, _Lease] = field(default_factory=dict)
    ended: bool = False
    tokens: float = 0.0
    refilled_s: float = 0.0
    verdicts: dict[str, tuple[bool, str]] = field(default_factory=dict)
    """A pod's verdict per device, kept for the connection (docs/agent.md §3)."""
    pool: str = ""
    """Whose share of the connection table it counts against: ``uid:<n>``, ``pod:<uid>``."""
    granted: bool = True
    """Whether a rule could admit it on some device when it connected (else it is in the small
    pool of ungranted connections, which can never crowd out a granted job)."""
    active_s: float = 0.0
    """When it last sent a request (monotonic): lease-less connections idle too long close."""
    busy: bool = False
    """A request of it is being answered (never idle then)."""
    log_limit: LogLimiter = field(default_factory=LogLimiter)
    """The log lines this connection may cause: refusals, protocol errors (docs/agent.md §5)."""


@dataclass
class _Lease:
    device: Device
    client: _Client
    rule: str
    session: ControlSession
    since_s: float
    journaled: bool = False
    """Whether a change was made: the first writes and fsyncs the journal, on the pool."""
    changed: bool = False
    """Whether a change through it succeeded; a lease whose first change failed is dropped."""
    targets: dict[str, Any] = field(default_factory=dict)
    """The value each item was last set to through this lease (for a restore's report)."""
    busy: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by a change in flight and by the restore: a restore never runs under a change that
    a worker thread is still making (which would land after it, unjournaled)."""


def sd_notify(message: str) -> bool:
    """Tell systemd (``NOTIFY_SOCKET``) something, e.g. ``READY=1``; False when not under it."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            s.sendto(message.encode(), address)
        except OSError as err:
            logger.warning("sd_notify(%s) failed: %s", message, err)
            return False
    return True


class Agent:
    """The daemon. Build it over an open backend, then :meth:`run` (or ``await serve()``).

    Args:
        backend: The real backend (or the simulated one); the agent owns it.
        socket_path: Where to listen (ignored under systemd socket activation).
        rules: Who may control what.
        group: Group owning the socket (gid or name); ``None`` keeps root's.
        socket_mode: The socket's mode (default 0660: root and the group).
        max_connections: Connections held at once, all clients together.
        max_per_uid: Connections one uid may hold (root on the host is not limited); under
            Kubernetes, one pod (its root included).
        max_ungranted: Connections held at once by clients no rule admits on any device
            (default a quarter of ``max_connections``): the rest is reserved for granted ones.
        idle_timeout_s: A connection that holds no lease and sends nothing for this long is
            closed (the client reconnects when it next needs the agent).
        line_timeout_s: How long a partial request line may stay incomplete.
        rate_per_s: Requests a connection may make per second (a burst of a quarter of it).
        workers: Threads for device calls that are slow.
        inline_below_s: A device whose calls take less runs them on the event loop (see
            :meth:`_call`); 0 sends every call to the thread pool.
        listen_fd: An inherited listening socket (systemd); default from ``LISTEN_FDS``.
        allow_path: Where the allow list was read from (it must not lie in the socket's
            folder).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        socket_path: Path,
        rules: Rules,
        group: int | str | None = None,
        socket_mode: int = 0o660,
        max_connections: int = 4096,
        max_per_uid: int = 128,
        max_ungranted: int | None = None,
        idle_timeout_s: float = 60.0,
        line_timeout_s: float = 10.0,
        rate_per_s: float = 2000.0,
        workers: int = 8,
        inline_below_s: float = 0.002,
        listen_fd: int | None = None,
        allow_path: Path | None = None,
    ) -> None:
        self.backend = backend
        self.socket_path = Path(socket_path)
        self.rules = rules
        self.gid = _gid(group)
        self.socket_mode = socket_mode
        self.max_connections = max_connections
        self.max_per_uid = max_per_uid
        self.max_ungranted = (
            max(1, max_connections // 4) if max_ungranted is None else max_ungranted
        )
        self.idle_timeout_s = idle_timeout_s
        self._pod_standing: dict[str, tuple[float, bool]] = {}
        self._pod_lookups: dict[str, asyncio.Future[bool]] = {}
        self._log_limits: dict[str, LogLimiter] = {}
        self._job_events: dict[str, list[AgentEvent]] = {}
        """Leases each job grant admitted that ended, until ``revoke`` reports them."""
        self.line_timeout_s = line_timeout_s
        self.rate_per_s = rate_per_s
        self.listen_fd = listen_fd if listen_fd is not None else _systemd_fd()
        self.inline_below_s = inline_below_s
        self.allow_path = allow_path
        self._offload: dict[str, int] = {}
        self._slow: dict[str, int] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="powerlib-agent"
        )
        self._ids = itertools.count(1)
        self._clients: dict[int, _Client] = {}
        self._leases: dict[str, _Lease] = {}
        self._by_form: dict[str, Device] = {}
        self._wire_devices: list[dict[str, Any]] = []
        self.events: collections.deque[AgentEvent] = collections.deque(maxlen=10_000)
        """The latest ended leases (bounded: a client looping change/release cannot grow it)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.base_events.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._lock_fd: int | None = None
        self.ready = False
        self.recovered: list[Any] = []
        rules.resolve = self._resolve_id

    # -- start and stop --------------------------------------------------------------------------

    def prepare(self) -> None:
        """Take the state folder's agent lock, restore what a dead agent left, index devices.

        Raises:
            ConfigError: Another agent serves this state folder.
        """
        state = Path(self.backend.settings.state_dir)
        state.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(
            state / "agent.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"another powerlib agent serves the state folder {show_path(state)}"
            ) from None
        self._lock_fd = fd
        # A dead agent's leases: its journals name it as the owner, and it is gone.
        self.recovered = restore_journals(self.backend.settings)
        for outcome in self.recovered:
            (logger.info if outcome.ok else logger.error)("start-up restore: %s", outcome)
        for dev in self.backend.devices():
            details = dict(dev.details())
            self._wire_devices.append(protocol.info_to_wire(dev.info, details))
            self._by_form[str(dev.index)] = dev
            self._by_form[dev.device_id] = dev
            self._by_form[dev.device_id.lower()] = dev
            pci = details.get("pci_bus_id")
            bus_id = normalize_pci(pci) if isinstance(pci, str) else None
            if bus_id is not None:
                self._by_form[bus_id] = dev

    async def serve(self, *, started: Callable[[], None] | None = None) -> None:
        """Serve until :meth:`stop` (or SIGTERM/SIGINT under :meth:`run`); restores on the way out."""
        if self._lock_fd is None:
            self.prepare()
        _raise_nofile_limit()
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        if self.listen_fd is not None:
            sock = socket.socket(fileno=self.listen_fd)
            if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
                raise ConfigError("the inherited socket (LISTEN_FDS) is not a Unix stream socket")
            bound = sock.getsockname()
            if isinstance(bound, str) and bound.startswith("/"):
                self._check_socket_folder(Path(bound).parent)
            self._server = await asyncio.start_unix_server(
                self._serve_client, sock=sock, limit=protocol.MAX_LINE_BYTES, backlog=1024
            )
        else:
            folder = self.socket_path.parent
            self._check_socket_folder(folder)
            folder.mkdir(mode=0o755, parents=True, exist_ok=True)
            # chmod and chown below act on the path: nobody else may write its folder
            check_trusted(
                folder, os.lstat(folder), what="agent socket's folder", directory=True,
                trusted_uids={0, os.geteuid()},
            )  # fmt: skip
            _let_others_reach(folder, Path(self.backend.settings.state_dir))
            _clear_stale_socket(self.socket_path)
            self._server = await asyncio.start_unix_server(
                self._serve_client, path=str(self.socket_path), limit=protocol.MAX_LINE_BYTES,
                backlog=1024,
            )  # fmt: skip
            os.chmod(self.socket_path, self.socket_mode)
            if self.gid is not None:
                os.chown(self.socket_path, -1, self.gid)
        housekeeping = asyncio.create_task(self._housekeeping())
        self.ready = True
        sd_notify("READY=1\nSTATUS=serving " + str(len(self._wire_devices)) + " device(s)")
        logger.info(
            "powerlib agent ready on %s (%d devices)", self.socket_path, len(self._wire_devices)
        )
        if started is not None:
            started()
        try:
            await self._stopping.wait()
        finally:
            sd_notify("STOPPING=1")
            housekeeping.cancel()
            self._server.close()
            for client in list(self._clients.values()):
                await self._end(client, "agent stopping")
            # a client that left just before has its restore in flight: wait for it (a restore
            # holds its lease's lock), and restore anything still leased
            for lease in list(self._leases.values()):
                await self._restore(lease, "agent stopping")
            await self._server.wait_closed()
            if self.listen_fd is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.socket_path)
            self.ready = False

    def _check_socket_folder(self, folder: Path) -> None:
        """Refuse a socket folder that holds the agent's state, grants or allow list.

        Pods mount the socket's folder (read-only, docs/agent.md §3), and a container's root is
        the host's: whatever lies in that folder a root pod could write, so the folder holds
        the socket and nothing of the agent's.

        Raises:
            ConfigError: One of them lies in (or is) the socket's folder.
        """
        where = Path(os.path.realpath(folder))
        state = Path(self.backend.settings.state_dir)
        for what, path in (
            ("state folder", state),
            ("grants folder", self.rules.grants_dir),
            ("allow list", self.allow_path),
        ):
            if path is None:
                continue
            real = Path(os.path.realpath(path))
            if real == where or where in real.parents:
                raise ConfigError(
                    f"refusing to serve: the {what} {show_path(path)} lies in the socket's folder "
                    f"{show_path(folder)}, which pods mount; give the socket a folder of its own "
                    "(the default is /run/powerlib/agent/agent.sock)"
                )

    async def _housekeeping(self) -> None:
        """Close idle lease-less connections; end the leases of a job whose grant went."""
        period = max(0.05, min(0.5, self.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            try:
                now = time.monotonic()
                for client in list(self._clients.values()):
                    if (
                        not client.leases
                        and not client.busy
                        and now - client.active_s > self.idle_timeout_s
                    ):
                        await self._end(client, f"idle for {self.idle_timeout_s:g} s, no lease")
                jobs = {g.job for g in self.rules.grants()[0] if g.job is not None}
                gone = {
                    lease.rule[4:]
                    for lease in self._leases.values()
                    if lease.rule.startswith("job:") and lease.rule[4:] not in jobs
                }
                for job in gone:
                    await self._end_job(job, f"job {job}'s grant is gone")
            except Exception:  # noqa: BLE001 - housekeeping must never stop serving
                logger.exception("agent: housekeeping failed")

    async def _end_job(self, job: str, reason: str) -> None:
        """End and restore every lease job ``job``'s grant admitted.

        A lease being ended already (by the housekeeping, or its client's end) is awaited too:
        its restore holds the lease's lock.
        """
        leases = [lease for lease in self._leases.values() if lease.rule == f"job:{job}"]
        if leases:
            logger.info("agent: %s: ending %d lease(s)", reason, len(leases))
        await asyncio.gather(*(self._restore(lease, reason) for lease in leases))

    async def _revoke(self, job: str) -> list[dict[str, Any]]:
        """``powerlib agent revoke``: end the job's leases; every one that ended, whoever ended it."""
        await self._end_job(job, f"job {job}'s grant was revoked")
        ended = self._job_events.pop(job, [])
        return [{"device_id": e.device_id, "uid": e.uid, "pid": e.pid, "ok": e.ok} for e in ended]

    def stop(self) -> None:
        """Ask :meth:`serve` to return (thread-safe)."""
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)

    def run(self) -> None:
        """Serve in this thread until SIGTERM or SIGINT; restore every lease; release the lock."""

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, self.stop)
            await self.serve()

        try:
            asyncio.run(main())
        finally:
            self.close()

    @contextlib.contextmanager
    def in_thread(self, timeout_s: float = 30.0) -> Iterator[Agent]:
        """Serve from a thread of this process for the ``with`` block (tests, benchmarks).

        Returns once the socket answers; on exit it stops the agent (every lease restored),
        joins the thread and closes the agent.

        Raises:
            PowerlibError: What :meth:`serve` raised while starting (e.g. another agent's lock).
        """
        ready = threading.Event()
        failed: list[BaseException] = []

        def main() -> None:
            try:
                asyncio.run(self.serve(started=ready.set))
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
                failed.append(err)
                ready.set()

        thread = threading.Thread(target=main, name="powerlib-agent-loop", daemon=True)
        thread.start()
        try:
            if not ready.wait(timeout_s):
                raise ConfigError(f"the agent did not start within {timeout_s:g} s")
            if failed:
                raise failed[0]
            yield self
        finally:
            self.stop()
            thread.join(timeout=timeout_s)
            self.close()

    def close(self) -> None:
        """Release the thread pool and the agent lock (leases were restored by :meth:`serve`)."""
        self._pool.shutdown(wait=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- one client ------------------------------------------------------------------------------

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        sock = writer.get_extra_info("socket")
        if self._stopping is not None and self._stopping.is_set():
            writer.transport.abort()  # accepted as the agent stopped: no new leases now
            return
        try:
            peer = peer_of(sock)
        except OSError:
            writer.transport.abort()
            return
        client = _Client(id=next(self._ids), peer=peer, writer=writer)
        client.tokens, client.refilled_s = self.rate_per_s / 4, time.monotonic()
        client.active_s = time.monotonic()
        client.pool, client.granted = await self._standing(peer)
        if client.pool != "root":  # one budget of log lines per uid or pod, not per connection:
            client.log_limit = self._log_limit(client.pool)  # reconnecting gets no fresh one
        # from here to the table insert nothing awaits: the limits hold under any interleaving
        refusal = self._admit(client)
        if refusal is not None:
            if peer.pidfd is not None:
                os.close(peer.pidfd)
            await self._reply_and_close(writer, None, PermissionDeniedError(refusal))
            return
        client.pidfd = pidfd_of(peer)
        if client.pidfd is None:  # gone already (or its pid reused): nothing to serve
            writer.transport.abort()
            return
        self._clients[client.id] = client
        assert self._loop is not None
        self._loop.add_reader(client.pidfd, self._on_exit, client)
        try:
            await self._read_loop(client, reader)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            await self._end(client, "connection closed")

    async def _standing(self, peer: Peer) -> tuple[str, bool]:
        """Which share of the connection table ``peer`` counts against, and if it is granted.

        Granted: some rule could admit it on some device (docs/agent.md §5).

        A process in a pod counts against its pod (root included: a container's uid 0 is no
        one's exemption); the pod's allocation is asked of the kubelet at most every few
        seconds per pod. Root on the host is not limited.
        """
        pods = self.rules.kubernetes
        if pods is not None:
            pod = pods.pod_of(peer.pid)
            if pod is not None:
                return f"pod:{pod}", await self._pod_granted(pod, peer)
        if peer.uid == 0 and (pods is None or pods.is_host_process(peer.pid)):
            return "root", True
        job_grants, _ = self.rules.grants()
        granted = any(g.admits(peer.uid, peer.gids) for g in (*self.rules.allow, *job_grants))
        return f"uid:{peer.uid}", granted

    def _log_limit(self, pool: str) -> LogLimiter:
        limit = self._log_limits.get(pool)
        if limit is None:
            if len(self._log_limits) >= 4096:  # bounded: the oldest budget goes first
                self._log_limits.pop(next(iter(self._log_limits)))
            limit = self._log_limits[pool] = LogLimiter()
        return limit

    async def _pod_granted(self, pod: str, peer: Peer) -> bool:
        """Whether the kubelet gave ``pod`` any device.

        Asked once per pod at a time, and kept a few seconds, so a pod opening connections in a
        loop cannot make the agent flood the runtime.
        """
        now = time.monotonic()
        cached = self._pod_standing.get(pod)
        if cached is not None and now - cached[0] < 5.0:
            return cached[1]
        if pod == "?":  # a process the agent cannot place is never granted
            return False
        pending = self._pod_lookups.get(pod)
        if pending is None:
            pending = asyncio.ensure_future(self._ask_pod(pod, peer))
            self._pod_lookups[pod] = pending
            pending.add_done_callback(lambda _: self._pod_lookups.pop(pod, None))
        return await asyncio.shield(pending)

    async def _ask_pod(self, pod: str, peer: Peer) -> bool:
        try:
            found = await self._call(self.rules.kubernetes.devices_of, peer.pid)
            granted = bool(found is not None and found.devices)
        except PowerlibError:
            granted = False
        if len(self._pod_standing) > 4096:
            self._pod_standing.clear()
        self._pod_standing[pod] = (time.monotonic(), granted)
        return granted

    def _admit(self, client: _Client) -> str | None:
        # root on the host is never turned away: an epilog's `powerlib agent revoke` must get in
        if len(self._clients) >= self.max_connections and client.pool != "root":
            return f"the agent holds {len(self._clients)} connections, its limit; try again later"
        if not client.granted:
            held = sum(1 for c in self._clients.values() if not c.granted)
            if held >= self.max_ungranted:
                return (
                    f"{held} connections of clients that no rule admits are open, their limit "
                    "(the rest is kept for granted jobs); try again later"
                )
        if client.pool != "root":
            held = sum(1 for c in self._clients.values() if c.pool == client.pool)
            if held >= self.max_per_uid:
                who = client.pool.replace(":", " ", 1)
                return f"{who} holds {held} connections, the limit per {who.split()[0]}"
        return None

    async def _read_loop(self, client: _Client, reader: asyncio.StreamReader) -> None:
        buf = bytearray()
        too_long = protocol.ProtocolError(
            f"a request line is longer than {protocol.MAX_LINE_BYTES} bytes"
        )
        while not client.ended:
            timeout = self.line_timeout_s if buf else None
            try:
                chunk = await asyncio.wait_for(reader.read(protocol.MAX_LINE_BYTES), timeout)
            except asyncio.TimeoutError:
                await self._refuse(client, protocol.ProtocolError(
                    f"a request line stayed incomplete for {self.line_timeout_s:g} s"
                ))  # fmt: skip
                return
            if not chunk:
                return
            buf += chunk
            start = 0
            while True:
                nl = buf.find(b"\n", start)
                if nl < 0:
                    break
                line = bytes(buf[start:nl])
                start = nl + 1
                if len(line) > protocol.MAX_LINE_BYTES:
                    await self._refuse(client, too_long)
                    return
                # every line counts against the rate, blank ones too: none can spin the loop
                await self._throttle(client)
                if not line.strip():
                    continue  # counted against the rate, but it keeps no connection from idling
                client.busy = True
                try:
                    if not await self._handle(client, line):
                        return
                finally:
                    client.busy = False
                    client.active_s = time.monotonic()
                if client.ended:
                    return
            del buf[:start]  # one copy per chunk, not one per line
            if len(buf) > protocol.MAX_LINE_BYTES:
                await self._refuse(client, too_long)
                return

    async def _throttle(self, client: _Client) -> None:
        """A token bucket per connection: a flood waits on its own coroutine, nobody else's."""
        now = time.monotonic()
        burst = self.rate_per_s / 4
        client.tokens = min(burst, client.tokens + (now - client.refilled_s) * self.rate_per_s)
        client.refilled_s = now
        if client.tokens < 1:
            await asyncio.sleep((1 - client.tokens) / self.rate_per_s)
            client.tokens = 1
        else:
            await asyncio.sleep(0)  # let the other clients' lines in between
        client.tokens -= 1

    async def _handle(self, client: _Client, line: bytes) -> bool:
        """Answer one line; False when the connection must close (a protocol error)."""
        try:
            msg = protocol.decode_request(line)
        except protocol.ProtocolError as err:
            await self._refuse(client, err)
            return False
        rid = msg.get("id")
        try:
            result = await self._dispatch(client, msg)
        except PowerlibError as err:
            return await self._send(client, protocol.error_reply(rid, err))
        except Exception as err:  # noqa: BLE001 - a driver bug must not kill the agent
            client.log_limit.log(
                logger, logging.ERROR, "agent: %s failed for %s", msg["op"],
                client.peer.describe(), exc_info=True,
            )  # fmt: skip
            return await self._send(client, protocol.error_reply(rid, err))
        return await self._send(client, protocol.reply(rid, result))

    async def _send(self, client: _Client, message: dict[str, Any]) -> bool:
        if client.ended:
            return False
        try:
            client.writer.write(protocol.encode(message))
            await client.writer.drain()
        except (ConnectionError, RuntimeError):
            return False
        return True

    async def _refuse(self, client: _Client, err: PowerlibError) -> None:
        client.log_limit.log(
            logger, logging.WARNING, "agent: closing %s: %s", client.peer.describe(),
            protocol.one_line(err.message),
        )  # fmt: skip
        await self._send(client, protocol.error_reply(None, err))

    async def _reply_and_close(
        self, writer: asyncio.StreamWriter, rid: Any, err: PowerlibError
    ) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError, asyncio.TimeoutError):
            writer.write(protocol.encode(protocol.error_reply(rid, err)))
            await asyncio.wait_for(writer.drain(), 1.0)  # a peer that never reads: dropped
        with contextlib.suppress(Exception):
            writer.transport.abort()

    # -- operations ------------------------------------------------------------------------------

    async def _dispatch(self, client: _Client, msg: dict[str, Any]) -> Any:
        op = msg["op"]
        peer = client.peer
        if op == "ping":
            return None
        if op == "hello":
            return {
                "protocol": protocol.PROTOCOL,
                "version": protocol.VERSION,
                "backend": self.backend.name,
                "uid": peer.uid,
                "pid": peer.pid,
                "agent_pid": os.getpid(),
            }
        if op == "devices":
            return self._wire_devices
        if op == "leases":
            host_root = client.pool == "root"
            return [
                {"device_id": k, "uid": v.client.peer.uid, "pid": v.client.peer.pid, "rule": v.rule,
                 "since_s": v.since_s}
                for k, v in self._leases.items()
                if host_root or v.client is client
            ]  # fmt: skip
        if op == "revoke":
            if client.pool != "root":  # root on the host (a Slurm epilog), not a pod's root
                raise PermissionDeniedError(
                    f"{peer.describe()} may not revoke a job's grant: only root on the host may",
                    operation=op,
                )
            self.rules.invalidate()
            return await self._revoke(msg["job"])
        dev = self._resolve(msg["device"])
        allowed, why = await self._authorize(client, dev, _shown(msg["device"], dev))
        if not allowed:
            client.log_limit.log(
                logger, logging.WARNING, "agent: refused %s %s: %s", op, peer.describe(),
                protocol.one_line(why),
            )  # fmt: skip
            raise PermissionDeniedError(why, device=dev.device_id, operation=op)
        if op == "read":
            state = await self._call(dev.read_state, device=dev.device_id)
            return protocol.state_to_wire(state)
        if op == "release":
            lease = client.leases.get(dev.device_id)
            if lease is not None:
                await self._restore(lease, "released")
            return None
        lease = self._lease(client, dev, why)
        try:
            async with lease.busy:
                if self._leases.get(dev.device_id) is not lease:  # restored while this waited
                    raise DeviceLostError(
                        "the lease ended (the client is gone, or its grant was revoked)",
                        device=dev.device_id,
                    )
                result = await self._change(op, lease, msg)
                lease.changed = True
                return result
        except BaseException:
            if not lease.changed and self._leases.get(dev.device_id) is lease:
                # a failed first change leaves no lease: the device stays free for others
                await self._restore(lease, "its first change failed")
            raise

    async def _change(self, op: str, lease: _Lease, msg: dict[str, Any]) -> Any:
        dev = lease.device
        # the lease's first change journals (write + fsync): never on the event loop
        where = dev.device_id if lease.journaled else None
        lease.journaled = True
        if op == "lock_sm_clocks":
            lo, hi = await self._call(
                lease.session.lock_sm_clocks,
                dev,
                msg["min_mhz"],
                msg.get("max_mhz"),
                device=where,
            )
            lease.targets["sm_clocks"] = [lo, hi]
            return [lo, hi]
        if op == "reset_sm_clocks":
            await self._call(lease.session.reset_sm_clocks, dev, device=where)
            lease.targets["sm_clocks"] = None
            return None
        if op == "set_power_limit":
            applied = await self._call(
                lease.session.set_power_limit, dev, msg["power_limit_w"], device=where
            )
            lease.targets["power_limit"] = applied
            return applied
        if op == "reset_power_limit":
            await self._call(lease.session.reset_power_limit, dev, device=where)
            lease.targets["power_limit"] = dev.info.default_power_limit_w
            return None
        raise protocol.ProtocolError(f"unknown operation {op!r}")  # decode_request stops these

    async def _authorize(self, client: _Client, dev: Device, shown: str) -> tuple[bool, str]:
        """The rules' verdict for this client and device.

        A host process is judged on the event loop (its rules read only files). A process in a
        pod is judged on the pool (the kubelet and the runtime may be asked), and the verdict,
        either way, is kept for the connection: a container's devices do not change while it
        runs, and a pod that keeps asking for a device it was not given must not make the
        agent ask the runtime for each request.
        """
        peer = client.peer
        if not client.pool.startswith("pod:"):
            return self.rules.check(peer.uid, peer.gids, dev.device_id, shown, peer.pid)
        verdict = client.verdicts.get(dev.device_id)
        if verdict is not None:
            return verdict
        try:
            verdict = await self._call(
                self.rules.check, peer.uid, peer.gids, dev.device_id, shown, peer.pid
            )
        except PowerlibError as err:
            verdict = (
                False,
                f"uid {peer.uid} pid {peer.pid}: cannot tell which pod it runs in: {err.message}",
            )
        if client.pidfd is None or _exited(client.pidfd):
            # the process was read by pid on the pool: if it is gone, that pid may now be
            # someone else's, and the verdict theirs
            raise DeviceLostError("the client is gone", device=dev.device_id)
        client.verdicts[dev.device_id] = verdict
        return verdict

    def _resolve(self, selector: str | int) -> Device:
        dev = self._lookup(selector)
        if dev is None:
            raise DeviceNotFoundError(
                f"no device {selector!r} on this node (an index, UUID or PCI bus id; "
                f"{len(self._wire_devices)} device(s))"
            )
        return dev

    def _lookup(self, selector: str | int) -> Device | None:
        text = str(selector).strip()
        dev = self._by_form.get(text) or self._by_form.get(text.lower())
        if dev is None:
            pci = normalize_pci(text)
            dev = self._by_form.get(pci) if pci else None
        return dev

    def _resolve_id(self, selector: str) -> str | None:
        dev = self._lookup(selector)
        return None if dev is None else dev.device_id

    def _lease(self, client: _Client, dev: Device, rule: str) -> _Lease:
        if client.ended:  # its process exited while this request waited: no new lease
            raise DeviceLostError("the client is gone", device=dev.device_id)
        lease = self._leases.get(dev.device_id)
        if lease is not None and lease.client is not client:
            owner = lease.client.peer
            raise DeviceBusyError(
                f"leased by uid {owner.uid} pid {owner.pid} ({lease.rule}) since "
                f"{time.strftime('%H:%M:%S', time.localtime(lease.since_s))}",
                device=dev.device_id,
            )
        if lease is None:
            # No guardian per lease: the agent restores every lease when a client goes and its
            # own journals when it restarts (docs/agent.md); a guardian per lease would also
            # restore under a restarted agent (docs/real-gpu.md §6).
            session = ControlSession(self.backend, guardian=False, handle_signals=False)
            lease = _Lease(
                device=dev, client=client, rule=rule, session=session, since_s=time.time()
            )
            self._leases[dev.device_id] = lease
            client.leases[dev.device_id] = lease
            # a client looping change/release must not flood the log: its own limit
            client.log_limit.log(
                logger, logging.INFO, "agent: %s leases %s (%s)", client.peer.describe(),
                dev.device_id, rule,
            )  # fmt: skip
        return lease

    async def _call(self, fn: Callable[..., Any], *args: Any, device: str | None = None) -> Any:
        """Run a device call: inline while the device answers fast, else on the thread pool.

        Handing a call to a thread and back costs ~0.1 ms on a loaded 2-core node, as much as a
        fast driver call itself. A device's calls run on the event loop until two in a row take
        longer than ``inline_below_s`` (one slow call is normal: a lease's first change writes
        and fsyncs its journal); then the next :data:`_OFFLOAD_CALLS` calls of that device go
        to the pool, so a device that stalls delays only its own clients.
        """
        assert self._loop is not None
        inline = (
            self.inline_below_s > 0 and device is not None and self._offload.get(device, 0) <= 0
        )
        t0 = time.perf_counter()
        try:
            if inline:
                return fn(*args)
            return await self._loop.run_in_executor(self._pool, fn, *args)
        finally:
            if device is not None:
                slow = time.perf_counter() - t0 > self.inline_below_s
                if inline:
                    streak = self._slow.get(device, 0) + 1 if slow else 0
                    self._slow[device] = streak
                    if streak >= 2:
                        self._offload[device] = _OFFLOAD_CALLS
                else:
                    self._offload[device] = _OFFLOAD_CALLS if slow else self._offload[device] - 1

    # -- the end of a client ---------------------------------------------------------------------

    def _on_exit(self, client: _Client) -> None:
        """The pidfd became readable: the client process exited (its socket may live on)."""
        if client.pidfd is not None and self._loop is not None:
            self._loop.remove_reader(client.pidfd)
        task = self._loop.create_task(self._end(client, "process exited"))  # type: ignore[union-attr]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _end(self, client: _Client, reason: str) -> None:
        if client.ended:
            return
        client.ended = True
        detected = time.monotonic()
        self._clients.pop(client.id, None)
        if client.pidfd is not None:
            assert self._loop is not None
            self._loop.remove_reader(client.pidfd)
            os.close(client.pidfd)
            client.pidfd = None
        with contextlib.suppress(Exception):
            # abort, not close: a peer that stopped reading (or a child that keeps its socket)
            # must not keep the socket and its buffers alive past the client's end
            client.writer.transport.abort()
        leases = list(client.leases.values())
        if leases:
            client.log_limit.log(
                logger, logging.INFO, "agent: %s: %s; restoring %d device(s)",
                client.peer.describe(), reason, len(leases),
            )  # fmt: skip
        # each device on its own: one that fails does not stop the others
        await asyncio.gather(*(self._restore(lease, reason, detected) for lease in leases))

    async def _restore(
        self, lease: _Lease, reason: str, detected_s: float | None = None
    ) -> AgentEvent | None:
        """Restore ``lease``'s device and end the lease; its event (None: already ended)."""
        dev_id = lease.device.device_id
        detected = time.monotonic() if detected_s is None else detected_s
        async with lease.busy:  # after a change in flight, never under it
            if self._leases.get(dev_id) is not lease:
                return None  # already restored (a release and the client's end can both ask)
            event = AgentEvent(
                device_id=dev_id, pid=lease.client.peer.pid, uid=lease.client.peer.uid,
                reason=reason, detected_s=detected,
            )  # fmt: skip
            self.events.append(event)
            if lease.rule.startswith("job:"):  # for `powerlib agent revoke`'s report
                self._job_events.setdefault(lease.rule[4:], []).append(event)
                while len(self._job_events) > 1024:
                    self._job_events.pop(next(iter(self._job_events)))

            def restore() -> list[Any]:
                event.restore_started_s = time.monotonic()
                return lease.session.close()

            try:
                outcomes = await self._call(restore)
                # a value the lease did not set (another root process changed the device under
                # it) is left as found, and the lease's restore is not ok: say which and whose
                event.ok = all(o.ok and o.found is None for o in outcomes)
                peer = lease.client.peer
                for o in outcomes:
                    if o.found is not None:
                        logger.error(
                            "agent: restore %s: not ok: its %s reads %s, not the %s that %s (%s) "
                            "set through the agent: someone else changed it; left as found",
                            dev_id, o.item.replace("_", " "), _value(o.item, o.found),
                            _value(o.item, lease.targets.get(o.item)), peer.describe(), lease.rule,
                        )  # fmt: skip
                        continue
                    if o.ok:
                        lease.client.log_limit.log(
                            logger, logging.INFO, "agent: restore %s: %s", dev_id, o
                        )
                    else:  # a failure is always told
                        logger.error("agent: restore %s: %s", dev_id, o)
            except Exception:  # noqa: BLE001 - ControlSession.close never raises; belt and braces
                logger.exception("agent: restoring %s failed", dev_id)
            finally:
                event.restore_done_s = time.monotonic()
                self._leases.pop(dev_id, None)
                lease.client.leases.pop(dev_id, None)
        return event


def _exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (the pidfd is readable then)."""
    return bool(select.select([pidfd], [], [], 0)[0])


def _value(item: str, value: Any) -> str:
    """A setting for a log line: ``250 W``, ``1200-1410 MHz``, ``unlocked``."""
    if value is None:
        return "unlocked" if item != "power_limit" else "unknown"
    if isinstance(value, (list, tuple)):
        return "{:g}-{:g} MHz".format(*value)
    return f"{float(value):g} W"


def _let_others_reach(folder: Path, state: Path) -> None:
    """Let clients reach a socket folder inside root's state folder.

    Each folder between gets ``x`` for group and others
    (:func:`~powerlib.agent.node.let_others_traverse`).
    """
    try:
        inside = folder.resolve().relative_to(state.resolve())
    except ValueError:
        return
    path = state
    for part in ("", *inside.parts[:-1]):
        path = path / part if part else path
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            let_others_traverse(fd)
        finally:
            os.close(fd)


def _shown(selector: str | int, dev: Device) -> str:
    text = str(selector)
    return text if text == dev.device_id else f"{text} ({dev.device_id})"


def _gid(group: int | str | None) -> int | None:
    if group is None or isinstance(group, int):
        return group
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"no such group {group!r} for the agent's socket") from None


def _systemd_fd() -> int | None:
    """The first socket systemd passed (socket activation), or ``None``."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    try:
        count = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return None
    if count < 1:
        return None
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)  # not inherited by anything we start
    return SD_LISTEN_FDS_START


def _clear_stale_socket(path: Path) -> None:
    """Remove a socket a dead agent left; refuse to remove anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{show_path(path)} exists and is not a socket; refusing to replace it")
    os.unlink(path)


def _raise_nofile_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
