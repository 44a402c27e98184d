"""``powerlib agent serve``'s server: the socket, the connections and their limits, systemd.

A training job does not run as root, and clocks and power limits need root. The agent does (one
per node, under systemd); jobs ask it over a Unix socket (:mod:`powerlib.agent.protocol`).
:class:`Agent` is the daemon: it listens, reads each connection's request lines and hands them to
its :class:`~powerlib.agent.leases.Leases`, which changes a device only for a client that a rule
admits (:mod:`powerlib.agent.authz`), only while that client holds the device's lease, and puts
the device back the moment the client goes (docs/agent.md). What this module holds:

* **The socket.** Alone in its folder, which may hold none of the agent's state, grants or allow
  list (pods mount it, docs/agent.md §4); a stale socket is replaced, nothing else is. Under
  systemd, socket activation (``LISTEN_FDS``) and ``sd_notify`` (``READY=1``, ``STOPPING=1``).
* **The end of a client.** When the connection closes, or the client process dies (a pidfd:
  this catches a forked child that keeps the socket), its socket is aborted and its leases end.
* **Hostile clients.** Lines are capped (:data:`~powerlib.agent.protocol.MAX_LINE_BYTES`), a
  partial line must complete within ``line_timeout_s``, each uid (or pod) is rate limited, all
  its connections together (:mod:`powerlib.agent.throttle`), each uid may hold a bounded number
  of connections, and every connection is its own coroutine, so a slow or flooding client delays
  only itself; an answer that never changes (``devices``) is encoded once. Device calls run on a
  thread pool when they are slow, never stalling the event loop (docs/agent.md §5).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from powerlib.agent import protocol
from powerlib.agent.authz import Rules
from powerlib.agent.leases import Client, Leases
from powerlib.agent.listener import (
    check_socket_folder,
    group_id,
    prepare_socket_folder,
    raise_nofile_limit,
    sd_notify,
    systemd_listen_fd,
)
from powerlib.agent.logs import LogLimiter
from powerlib.agent.peer import Peer, peer_of, pidfd_of
from powerlib.agent.throttle import PoolThrottle
from powerlib.backend import Backend
from powerlib.errors import ConfigError, PermissionDeniedError, PowerlibError

__all__ = ["Agent"]

logger = logging.getLogger(__name__)


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
        rate_per_s: Requests one uid (or pod) may make per second, all its connections
            together, in bursts of a quarter of it; a quarter of that while no rule admits it
            (it can only read). Root on the host: each connection that much.
        workers: Threads for device calls that are slow.
        inline_below_s: A device whose calls take less runs them on the event loop (see
            :meth:`~powerlib.agent.leases.Leases.call`); 0 sends every call to the thread pool.
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
        self.gid = group_id(group)
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
        self.line_timeout_s = line_timeout_s
        self.rate_per_s = rate_per_s
        self._rates = PoolThrottle(max_pools=4096)  # bounded, like _log_limits
        self._devices_json: bytes | None = None
        self.listen_fd = listen_fd if listen_fd is not None else systemd_listen_fd()
        self.allow_path = allow_path
        self.leases = Leases(backend, rules, workers=workers, inline_below_s=inline_below_s)
        """The devices, their leases and the changes made through them (also ``events``)."""
        self._ids = itertools.count(1)
        self._clients: dict[int, Client] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.base_events.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self.ready = False

    # -- start and stop --------------------------------------------------------------------------

    def prepare(self) -> None:
        """Take the state folder's agent lock, restore what a dead agent left, index devices.

        Raises:
            ConfigError: Another agent serves this state folder.
        """
        self.leases.prepare()

    async def serve(self, *, started: Callable[[], None] | None = None) -> None:
        """Serve until :meth:`stop` (or SIGTERM/SIGINT under :meth:`run`); restores on the way out."""
        if not self.leases.prepared:
            self.leases.prepare()
        raise_nofile_limit()
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        if self.listen_fd is not None:
            sock = socket.socket(fileno=self.listen_fd)
            if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
                raise ConfigError("the inherited socket (LISTEN_FDS) is not a Unix stream socket")
            bound = sock.getsockname()
            if isinstance(bound, str) and bound.startswith("/"):
                check_socket_folder(
                    Path(bound).parent, state_dir=Path(self.backend.settings.state_dir),
                    grants_dir=self.rules.grants_dir, allow_path=self.allow_path,
                )  # fmt: skip
            self._server = await asyncio.start_unix_server(
                self._serve_client, sock=sock, limit=protocol.MAX_LINE_BYTES, backlog=1024
            )
        else:
            # chmod and chown below act on the path: nobody else may write its folder
            prepare_socket_folder(
                self.socket_path, state_dir=Path(self.backend.settings.state_dir),
                grants_dir=self.rules.grants_dir, allow_path=self.allow_path,
            )  # fmt: skip
            self._server = await asyncio.start_unix_server(
                self._serve_client, path=str(self.socket_path), limit=protocol.MAX_LINE_BYTES,
                backlog=1024,
            )  # fmt: skip
            os.chmod(self.socket_path, self.socket_mode)
            if self.gid is not None:
                os.chown(self.socket_path, -1, self.gid)
        housekeeping = asyncio.create_task(self._housekeeping())
        self.ready = True
        sd_notify("READY=1\nSTATUS=serving " + str(len(self.leases.wire_devices)) + " device(s)")
        logger.info(
            "powerlib agent ready on %s (%d devices)",
            self.socket_path,
            len(self.leases.wire_devices),
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
            await self.leases.end_all("agent stopping")
            await self._server.wait_closed()
            if self.listen_fd is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.socket_path)
            self.ready = False

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
                await self.leases.end_gone_jobs()
            except Exception:  # noqa: BLE001 - housekeeping must never stop serving
                logger.exception("agent: housekeeping failed")

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
        self.leases.close()

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
        client = Client(id=next(self._ids), peer=peer, writer=writer)
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
        """Whether the kubelet gave any container of ``pod`` a device.

        A pod is judged by its GPU container, not by the first of its containers to connect
        (:meth:`~powerlib.agent.kubernetes.KubernetesGrants.pod_granted`).

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
            # the pod's standing, whichever of its containers asks first (docs/agent.md §5)
            granted = bool(await self.leases.call(self.rules.kubernetes.pod_granted, peer.pid))
        except PowerlibError:
            granted = False
        if len(self._pod_standing) > 4096:
            self._pod_standing.clear()
        self._pod_standing[pod] = (time.monotonic(), granted)
        return granted

    def _admit(self, client: Client) -> str | None:
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

    async def _read_loop(self, client: Client, reader: asyncio.StreamReader) -> None:
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

    async def _throttle(self, client: Client) -> None:
        """One rate per uid or pod, all its connections together (docs/agent.md §5).

        A flood waits on its own coroutines, each for its pool's next slot, so the loop serves
        the other pools between its requests (and yields between requests even at no wait).
        Root on the host is exempt from the pool's rate: each of its connections has a bucket.
        """
        if client.pool != "root":
            rate = self.rate_per_s if client.granted else self.rate_per_s / 4
            await asyncio.sleep(self._rates.delay_s(client.pool, rate, rate / 4))
            return
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

    async def _handle(self, client: Client, line: bytes) -> bool:
        """Answer one line; False when the connection must close (a protocol error)."""
        try:
            msg = protocol.decode_request(line)
        except protocol.ProtocolError as err:
            await self._refuse(client, err)
            return False
        rid = msg.get("id")
        if msg["op"] == "devices":  # the same answer all the agent's life: encoded once
            return await self._write(client, self._devices_line(rid))
        try:
            result = await self.leases.dispatch(client, msg)
        except PowerlibError as err:
            return await self._send(client, protocol.error_reply(rid, err))
        except Exception as err:  # noqa: BLE001 - a driver bug must not kill the agent
            client.log_limit.log(
                logger, logging.ERROR, "agent: %s failed for %s", msg["op"],
                client.peer.describe(), exc_info=True,
            )  # fmt: skip
            return await self._send(client, protocol.error_reply(rid, err))
        return await self._send(client, protocol.reply(rid, result))

    def _devices_line(self, rid: Any) -> bytes:
        """``devices``' reply line: the devices encoded at the first request, the id spliced in.

        Byte for byte what :func:`protocol.encode` makes of the reply (a test holds it to that).
        """
        tail = b"null}\n"
        if self._devices_json is None:
            empty = protocol.encode(protocol.reply(None, None))  # ...,"result":null}\n
            whole = protocol.encode(protocol.reply(None, self.leases.wire_devices))
            self._devices_json = whole[len(empty) - len(tail) : -2]
        head = protocol.encode(protocol.reply(rid, None))
        assert head.endswith(tail)  # the result is the reply's last key
        return head[: -len(tail)] + self._devices_json + b"}\n"

    async def _send(self, client: Client, message: dict[str, object]) -> bool:
        return await self._write(client, protocol.encode(message))

    async def _write(self, client: Client, line: bytes) -> bool:
        if client.ended:
            return False
        try:
            client.writer.write(line)
            await client.writer.drain()
        except (ConnectionError, RuntimeError):
            return False
        return True

    async def _refuse(self, client: Client, err: PowerlibError) -> None:
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

    # -- the end of a client ---------------------------------------------------------------------

    def _on_exit(self, client: Client) -> None:
        """The pidfd became readable: the client process exited (its socket may live on)."""
        loop = self._loop
        if loop is None:  # pragma: no cover - the reader is only added while the loop serves
            return
        if client.pidfd is not None:
            loop.remove_reader(client.pidfd)
        task = loop.create_task(self._end(client, "process exited"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _end(self, client: Client, reason: str) -> None:
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
        await self.leases.end_client(client, reason, detected)
